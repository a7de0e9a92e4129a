"""The operator's API calls. Bodies come from retex.kube.objects; results are plain dicts.

Every call is idempotent the way the relay needs it: create treats AlreadyExists as success when
the object that exists is owned by the same Task, delete treats NotFound as success. A create the
API server refuses for good raises `Refused` (with the server's message), or its subclasses
`NamespaceTerminating` when the namespace is being deleted and `NotPermitted` when RBAC does not let
the operator create it there (a namespace not onboarded); any other API status or transport
error (429, 5xx, a dropped connection, a quota that is full for now) is transient
(retex.kube.errors, where every answer's status is read).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from retex.api import GROUP, PLURAL, VERSION
from retex.api.models import MSG_LEDGER_VERSION_MONOTONIC
from retex.kube.errors import (
    Refused,
    api_message,
    causes,
    conflict,
    expired,
    invalid,
    not_found,
    raise_refusal_or_reraise,
)
from retex.logs import log_line

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
# What a namespace's Tasks may ask for and its own run limit: its TaskPolicy of this name (the one
# the admission policy judges Tasks by, manifests/base/task-policy.yaml).
TASK_POLICIES, TASK_POLICY_NAME = "taskpolicies", "default"


class NotLeading(Exception):
    """A write not sent: this replica does not lead (`KubeCalls.may_write` said no). The caller
    stops writing as the leader; nothing was asked of the API server."""

    def __init__(self, what: str):
        super().__init__(f"not the leader: {what} not sent")


class StatusNotWritten(Exception):
    """A status patch not to retry: the Task is gone (404), another Task now has its name (409: the
    uid precondition), or it already shows a newer status (422 of the CRD's rule that ledgerVersion
    never goes backwards, and of no other: `_newer_status_shown`)."""

    def __init__(self, http_status: int):
        super().__init__(f"status not written (HTTP {http_status})")
        self.http_status = http_status


# An Event's message is cut to this (the API server's own limit is larger; a dashboard shows less).
EVENT_MESSAGE_MAX = 1024


class EventNotPosted(Exception):
    """The API server did not take an Event (e.g. 403 in a namespace not onboarded)."""

    def __init__(self, http_status: int, message: str):
        super().__init__(message)
        self.http_status = http_status


def custom_object(answer: object) -> dict[str, Any]:
    """An object as the client hands it over, decoded JSON (the client types it `object`)."""
    if not isinstance(answer, dict):
        raise TypeError(f"the API server answered {type(answer).__name__}, not a JSON object")
    return answer


def _newer_status_shown(exc: ApiException) -> bool:
    """A 422 whose every cause is the CRD's ledgerVersion rule. Any other cause (the schema, another
    rule) says the status itself is wrong: that is no reason to let it go, and it lasts until fixed.
    The cause reads `Invalid value: <rule's message>` (older API servers: `Invalid value: "object": ...`)."""
    found = causes(exc)
    return invalid(exc) and bool(found) and all(
        str(cause.get("message", "")).endswith(MSG_LEDGER_VERSION_MONOTONIC) for cause in found)


LIST_TIMEOUT_SECONDS = 30.0  # a read, not fenced by D − R: kopf's own request timeout
# Tasks per page of the cluster-wide LIST: the operator holds one page (and the client's decoded
# copy of it) at a time, not every Task in the cluster.
LIST_PAGE_SIZE = 500


class KubeCalls:
    """Every call carries `request_timeout` (the election's D − R: a call made while leading is
    answered or given up by the time a successor may start), and every write first asks
    `may_write` (whether this replica leads, on its own clock), so a writer that resumes after a
    pause past its renew deadline sends nothing more. Reads are not asked. D − R bounds writes
    only: the cluster-wide LIST of Tasks (`list_tasks`), which grows with the cluster, gets
    `list_timeout` (at least `request_timeout`) per page of `list_page_size`."""

    def __init__(self, api: client.ApiClient, *, instance: str, request_timeout: float,
                 may_write: Callable[[], bool] = lambda: True, list_timeout: float = LIST_TIMEOUT_SECONDS,
                 list_page_size: int = LIST_PAGE_SIZE):
        self._api = api
        self._instance = instance  # this replica (its pod's name): who reported an Event
        self._timeout = request_timeout
        self._list_timeout = max(list_timeout, request_timeout)
        self._list_page_size = list_page_size
        self.may_write = may_write
        self._batch = client.BatchV1Api(api)
        self._coordination = client.CoordinationV1Api(api)
        self._core = client.CoreV1Api(api)
        self._custom = client.CustomObjectsApi(api)

    def _plain(self, model: Any) -> dict[str, Any]:
        return custom_object(self._api.sanitize_for_serialization(model))

    def _writing(self, what: str) -> None:
        if not self.may_write():
            raise NotLeading(what)

    # -- attempts --------------------------------------------------------------------------

    def create_lease(self, body: dict[str, Any]) -> None:
        """The Lease is shared by the task's attempts, so AlreadyExists is the normal case from the
        second attempt on; it is success only when the Lease there is owned by this Task. Anyone
        who may create Leases in the namespace can take the name first, and a Lease renewed by
        them would keep the task's dead workers looking alive. (A LIST of the name, like
        `get_lease`: the operator may not get Leases.)"""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        self._writing(f"create Lease {namespace}/{name}")
        _created_or_ours(body,
                         lambda: self._coordination.create_namespaced_lease(namespace, body,  # type: ignore[arg-type]  # a manifest dict; the client validates it into its model
                                                                             _request_timeout=self._timeout),
                         lambda: self.get_lease(namespace, name) or {"metadata": {}})

    def create_job(self, body: dict[str, Any]) -> None:
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        self._writing(f"create Job {namespace}/{name}")
        _created_or_ours(body, lambda: self._batch.create_namespaced_job(namespace, body,  # type: ignore[arg-type]  # a manifest dict; the client validates it into its model
                                                                           _request_timeout=self._timeout),
                         lambda: self._plain(self._batch.read_namespaced_job(name, namespace, _request_timeout=self._timeout)))

    def dry_run_job(self, body: dict[str, Any]) -> None:
        """Have the API server validate and admit the Job (`dryRun=All`: every admission step,
        nothing stored). Raises `Refused` when it would be refused; a name already taken is not a
        refusal here (the real create decides whose it is)."""
        try:
            self._batch.create_namespaced_job(body["metadata"]["namespace"], body, dry_run="All",  # type: ignore[arg-type]  # a manifest dict; the client validates it into its model
                                              _request_timeout=self._timeout)
        except ApiException as exc:
            if not conflict(exc):
                raise_refusal_or_reraise(exc)

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._plain(self._batch.read_namespaced_job(name, namespace, _request_timeout=self._timeout))
        except ApiException as exc:
            if not_found(exc):
                return None
            raise

    def delete_job_of(self, namespace: str, name: str, task_uid: str) -> bool:
        """Delete the Job `name` if it exists and is owned by the Task `task_uid`; True if it was."""
        job = self.get_job(namespace, name)
        if job is None or not _owned_by(job, {task_uid}):
            return False
        self.delete_job(namespace, name)
        return True

    def delete_job(self, namespace: str, name: str) -> None:
        """Background propagation: the Job goes now, its pods after; a pod stuck Terminating on a
        lost node is never waited for."""
        self._writing(f"delete Job {namespace}/{name}")
        try:
            self._batch.delete_namespaced_job(name, namespace, propagation_policy="Background",
                                              _request_timeout=self._timeout)
        except ApiException as exc:
            if not not_found(exc):
                raise

    # -- tasks -----------------------------------------------------------------------------

    def get_task(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return custom_object(self._custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                                          _request_timeout=self._timeout))
        except ApiException as exc:
            if not_found(exc):
                return None
            raise

    def list_tasks(self) -> Iterator[dict[str, Any]]:
        """Every Task in the cluster, a page at a time. A continue token that expired between
        pages (410: the list is older than etcd's compaction) ends the listing early, with the
        Tasks yielded so far: the caller's next round lists again from the start."""
        token: str | None = None
        while True:
            try:
                page = custom_object(self._custom.list_cluster_custom_object(
                    GROUP, VERSION, PLURAL, limit=self._list_page_size, _continue=token,
                    _request_timeout=self._list_timeout))
            except ApiException as exc:
                if token is None or not expired(exc):
                    raise
                log_line(log, logging.WARNING, "Task list expired between pages; the next round lists again",
                         error=api_message(exc))
                return
            yield from page["items"]
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return

    def namespace_run_limits(self) -> dict[str, int]:
        """namespace → its TaskPolicy's maxRunning, for every namespace whose TaskPolicy sets one:
        one LIST, so it is one moment's view. No TaskPolicy kind installed: none."""
        try:
            policies = custom_object(self._custom.list_cluster_custom_object(
                GROUP, VERSION, TASK_POLICIES, field_selector=f"metadata.name={TASK_POLICY_NAME}",
                _request_timeout=self._list_timeout))
        except ApiException as exc:
            if not_found(exc):
                return {}
            raise
        limits = {policy["metadata"]["namespace"]: run_limit_of(policy) for policy in policies["items"]}
        return {namespace: limit for namespace, limit in limits.items() if limit is not None}

    def patch_task_status(self, namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        """Merge-patch the status subresource. The uid precondition keeps a status from landing
        on a newer Task that reuses the name; the CRD's CEL rule refuses a lower ledgerVersion."""
        body = {"metadata": {"uid": uid}, "status": status}
        self._writing(f"status of Task {namespace}/{name}")
        try:
            self._custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, body, _content_type=MERGE_PATCH,
                _request_timeout=self._timeout)
        except ApiException as exc:
            if not_found(exc) or conflict(exc) or _newer_status_shown(exc):
                raise StatusNotWritten(exc.status) from exc
            raise

    def patch_task_labels(self, namespace: str, name: str, uid: str, labels: dict[str, str | None]) -> None:
        """Merge-patch labels (None removes one) on the Task with this uid."""
        body = {"metadata": {"uid": uid, "labels": labels}}
        self._writing(f"labels of Task {namespace}/{name}")
        self._custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, body,
                                                    _content_type=MERGE_PATCH, _request_timeout=self._timeout)

    def post_event(self, task: dict[str, Any], *, reason: str, message: str, warning: bool = False) -> None:
        meta = task["metadata"]
        self._writing(f"Event {reason} about Task {meta['namespace']}/{meta['name']}")
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "metadata": {"generateName": f"{meta['name'][:200]}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": task["apiVersion"], "kind": task["kind"], "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"]},
            "reason": reason,
            "message": message[:EVENT_MESSAGE_MAX],
            "type": "Warning" if warning else "Normal",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "source": {"component": "retex-operator"},
            "reportingComponent": "retex.dev/operator",
            "reportingInstance": self._instance,
        }
        try:
            self._core.create_namespaced_event(meta["namespace"], body,  # type: ignore[arg-type]  # a manifest dict; the client validates it into its model
                                               _request_timeout=self._timeout)
        except ApiException as exc:
            raise EventNotPosted(exc.status, api_message(exc)) from exc

    # -- the reaper's questions about one attempt (attempt lifecycle) ------------------------

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Lease as it is now: the reaper confirms what the watch showed before acting on it.
        A LIST of one name (a consistent read), so the operator needs no `get` on Leases."""
        listed = self._coordination.list_namespaced_lease(namespace, field_selector=f"metadata.name={name}",
                                                          _request_timeout=self._timeout)
        items = self._plain(listed).get("items") or []
        return items[0] if items else None

    def job_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        """The pods the Job controller made for this Job (label job-name)."""
        listed = self._core.list_namespaced_pod(namespace, label_selector=f"job-name={job}",
                                                _request_timeout=self._timeout)
        return self._plain(listed).get("items") or []

    def node_labelled(self, selector: dict[str, str]) -> bool:
        """Whether any node carries all these labels (one LIST by label selector, at most one item)."""
        found = self._core.list_node(label_selector=",".join(f"{k}={v}" for k, v in selector.items()), limit=1,
                                     _request_timeout=self._timeout)
        return bool(found.items)

    def job_events(self, namespace: str, job: str) -> list[dict[str, Any]]:
        """Events about the Job (FailedCreate: a pod the API server refused, e.g. by quota)."""
        listed = self._core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.kind=Job,involvedObject.name={job}",
            _request_timeout=self._timeout)
        return self._plain(listed).get("items") or []


def run_limit_of(policy: dict[str, Any]) -> int | None:
    """A TaskPolicy's maxRunning (None: unset), as the CRD's schema has checked it."""
    limit = (policy.get("spec") or {}).get("maxRunning")
    return int(limit) if limit is not None else None


def _owned_by(obj: dict[str, Any], owner_uids: set[str]) -> bool:
    return any(ref.get("uid") in owner_uids for ref in obj["metadata"].get("ownerReferences") or ())


def _created_or_ours(body: dict[str, Any], create: Callable[[], Any], read: Callable[[], dict[str, Any]]) -> None:
    """Create; AlreadyExists is success only if the object there is owned by the same Task (a
    repeated dispatch), otherwise the name is someone else's: a permanent refusal."""
    try:
        create()
    except ApiException as exc:
        if not conflict(exc):
            raise_refusal_or_reraise(exc)
        owners = {ref["uid"] for ref in body["metadata"].get("ownerReferences", ())}
        if not _owned_by(read(), owners):
            raise Refused(f'{body["kind"]} "{body["metadata"]["name"]}" already exists and is not owned by this '
                          "Task", 409) from exc
