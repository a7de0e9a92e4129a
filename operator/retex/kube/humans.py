"""What the CLI does as the person running it: their kubeconfig, their namespace, their rights.

A requeue or resolve is a merge patch of annotations on the Task, made with the person's own
credentials: RBAC decides whether they may (`patch` on tasks), and the ValidatingAdmissionPolicy
`retex-requested-by` (manifests/base) checks that the annotation naming them is the username the
API server authenticated. The operator acts on the annotations and records that name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import urllib3
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from retex.api import GROUP, PLURAL, VERSION
from retex.kube.errors import NotPermitted, api_message, not_found, refusal
from retex.kube.operator_calls import MERGE_PATCH, custom_object

T = TypeVar("T")

REQUEUE_ANNOTATION = "retex.dev/requeue"
RESOLVE_ANNOTATION = "retex.dev/resolve"
REQUESTED_BY_ANNOTATION = "retex.dev/requested-by"
RECOVER_ANNOTATION = "retex.dev/recover"
RECOVER_MODES = ("from-status", "afresh")


class NoCluster(Exception):
    """No kubeconfig to use, or the API server cannot be reached."""


class NotAllowed(Exception):
    """RBAC refused the person (the message says which right is missing)."""


class RefusedByServer(Exception):
    """The API server refused the request for another reason (an admission policy), or answered what
    retex cannot read: its message."""


class TaskMissing(Exception):
    """No such Task in that namespace."""


@dataclass
class Session:
    api: client.ApiClient
    namespace: str  # the kubeconfig context's namespace, or "default"


def context_namespace(kubeconfig: str | None = None, context: str | None = None) -> str:
    """The namespace of the kubeconfig's context (the current one unless named), as kubectl picks
    it; "default" when it names none or there is no kubeconfig. Reads the file only. A context
    named and not there, or a file that is not a kubeconfig, is NoCluster: never another namespace."""
    try:
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
    except (ConfigException, OSError) as exc:
        if context is not None or (kubeconfig is not None and Path(kubeconfig).exists()):
            raise NoCluster(f"no usable kubeconfig ({exc}); pass -n for the namespace") from None
        return "default"
    except yaml.YAMLError as exc:
        raise NoCluster(f"the kubeconfig is not YAML ({type(exc).__name__}); pass -n for the namespace") from None
    chosen = next((c for c in contexts if c["name"] == context), None) if context else active
    if context and chosen is None:
        raise NoCluster(f"no context {context!r} in the kubeconfig")
    return ((chosen or {}).get("context") or {}).get("namespace") or "default"


def session(kubeconfig: str | None = None, context: str | None = None) -> Session:
    """The person's kubeconfig ($KUBECONFIG, else ~/.kube/config; or the one named) and the
    namespace of its current context."""
    try:
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
        chosen = next((c for c in contexts if c["name"] == context), None) if context else active
        if chosen is None:
            raise NoCluster(f"no context {context!r} in the kubeconfig")
        api = config.new_client_from_config(config_file=kubeconfig, context=chosen["name"])
    except (ConfigException, OSError) as exc:
        raise NoCluster(f"no usable kubeconfig ({exc}); set KUBECONFIG or pass --kubeconfig, or use "
                        "--database-url (administrators)") from None
    return Session(api, (chosen.get("context") or {}).get("namespace") or "default")


def whoami(api: client.ApiClient) -> str:
    """The username the API server authenticates these credentials as (SelfSubjectReview)."""
    review = _call(lambda: client.AuthenticationV1Api(api).create_self_subject_review(
        client.V1SelfSubjectReview(api_version="authentication.k8s.io/v1", kind="SelfSubjectReview")), "ask who you are")
    user = review.status.user_info if review.status else None
    if user is None or not user.username:
        raise RefusedByServer("the API server did not say who you are (SelfSubjectReview without a username)")
    return user.username


def get_task(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return _json(_call(lambda: client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name), f"read task {namespace}/{name}"))


def list_tasks(api: client.ApiClient, namespace: str | None, label_selector: str) -> list[dict[str, Any]]:
    custom = client.CustomObjectsApi(api)
    if namespace is None:
        listed = _call(lambda: custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, label_selector=label_selector),
                       "list tasks in all namespaces")
    else:
        listed = _call(lambda: custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                                     label_selector=label_selector),
                       f"list tasks in namespace {namespace}")
    items: list[dict[str, Any]] = _json(listed)["items"]
    return items


def task_events(api: client.ApiClient, namespace: str, uid: str) -> list[dict[str, Any]]:
    listed = _call(lambda: client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.uid={uid}"), f"list events in namespace {namespace}")
    return api.sanitize_for_serialization(listed).get("items") or []


def request_requeue(api: client.ApiClient, namespace: str, name: str, user: str) -> dict[str, Any]:
    """Annotate the Task for a requeue, as `user` (a fresh value each time: the operator acts on a
    change)."""
    return _annotate(api, namespace, name, {REQUEUE_ANNOTATION: _now(), REQUESTED_BY_ANNOTATION: user}, "requeue")


def request_resolve(api: client.ApiClient, namespace: str, name: str, user: str, *, step: str, mark_done: bool,
                    result: Any = None) -> dict[str, Any]:
    decision = {"step": step, "markDone": mark_done, "requestedAt": _now()}
    if result is not None:
        decision["result"] = result
    return _annotate(api, namespace, name, {RESOLVE_ANNOTATION: json.dumps(decision, separators=(",", ":")),
                                            REQUESTED_BY_ANNOTATION: user}, "resolve")


def request_recover(api: client.ApiClient, namespace: str, name: str, user: str, *, mode: str) -> dict[str, Any]:
    """Annotate a frozen Task for its recovery (`mode`: from-status or afresh), as `user`."""
    if mode not in RECOVER_MODES:
        raise ValueError(f"recover mode {mode!r} is not one of {', '.join(RECOVER_MODES)}")
    decision = json.dumps({"mode": mode, "requestedAt": _now()}, separators=(",", ":"))
    return _annotate(api, namespace, name, {RECOVER_ANNOTATION: decision, REQUESTED_BY_ANNOTATION: user}, "recover")


def _annotate(api: client.ApiClient, namespace: str, name: str, annotations: dict[str, str], what: str) -> dict[str, Any]:
    body = {"metadata": {"annotations": annotations}}
    return _json(_call(lambda: client.CustomObjectsApi(api).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, body, _content_type=MERGE_PATCH),
        f"{what} task {namespace}/{name} (patch on tasks.retex.dev)"))


def _json(answer: object) -> dict[str, Any]:
    try:
        return custom_object(answer)
    except TypeError as exc:
        raise RefusedByServer(str(exc)) from None


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _call(fn: Callable[[], T], doing: str) -> T:
    try:
        return fn()
    except ApiException as exc:
        if not_found(exc):
            raise TaskMissing(f"cannot {doing}: not found") from None
        refused = refusal(exc)
        if isinstance(refused, NotPermitted):
            raise NotAllowed(f"you may not {doing}: {refused.message}. Ask an administrator for that right "
                             "in this namespace (docs/cli.md)") from None
        raise RefusedByServer(f"cannot {doing}: {api_message(exc)}") from None
    except (urllib3.exceptions.HTTPError, OSError) as exc:  # connection refused, DNS, TLS
        raise NoCluster(f"cannot {doing}: the API server is unreachable ({exc})") from None
