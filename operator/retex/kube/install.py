"""Which install of retex this operator belongs to: a uid made at the install's first start and
kept on a Lease in the operator's namespace (`retex-install`, annotation `retex.dev/install-uid`),
so every replica and every restart of one install tells the ledger the same uid, and an install
in another namespace or cluster — a Lease of its own — another. A Lease because the operator's
Role already governs Leases in its namespace (create, and get of these two by name); it is never
held or renewed."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from retex.kube.errors import conflict, not_found
from retex.logs import log_line

log = logging.getLogger(__name__)

INSTALL_LEASE_NAME = "retex-install"
INSTALL_UID_ANNOTATION = "retex.dev/install-uid"


def install_lease(namespace: str, uid: str) -> dict[str, Any]:
    """The Lease that records an install's uid (never held: it has no holder)."""
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": INSTALL_LEASE_NAME, "namespace": namespace,
                         "labels": {"app.kubernetes.io/name": "retex", "app.kubernetes.io/component": "operator"},
                         "annotations": {INSTALL_UID_ANNOTATION: uid}}}


def install_uid(api: client.ApiClient, namespace: str, *, request_timeout: float) -> str:
    """This install's uid: read from its Lease, or made now and recorded (the first replica to
    create it wins; the others read the winner's). A uid made now is logged: on an install whose
    ledger another uid owns, it means the Lease was deleted (the operator then refuses to start)."""
    coordination = client.CoordinationV1Api(api)
    for _ in range(3):
        try:
            lease = coordination.read_namespaced_lease(INSTALL_LEASE_NAME, namespace, _request_timeout=request_timeout)
        except ApiException as exc:
            if not not_found(exc):
                raise
        else:
            uid = ((lease.metadata.annotations if lease.metadata else None) or {}).get(INSTALL_UID_ANNOTATION)
            if not uid:
                raise RuntimeError(f"Lease {namespace}/{INSTALL_LEASE_NAME} has no {INSTALL_UID_ANNOTATION} annotation; "
                                   "delete it only with the ledger it names")
            return str(uid)
        made = str(uuid.uuid4())
        try:
            coordination.create_namespaced_lease(namespace, install_lease(namespace, made),  # type: ignore[arg-type]  # a manifest dict; the client validates it into V1Lease
                                                 _request_timeout=request_timeout)
        except ApiException as exc:
            if not conflict(exc):  # AlreadyExists: another replica made it first; read its uid
                raise
        else:
            log_line(log, logging.WARNING, "a new install uid made and kept on its Lease (a first start, or the Lease "
                     "was deleted)", uid=made, namespace=namespace, lease=INSTALL_LEASE_NAME)
    raise RuntimeError(f"Lease {namespace}/{INSTALL_LEASE_NAME} could be neither read nor created")
