"""The operator's API calls. Bodies come from retex.kube.objects; results are plain dicts.

Every call is idempotent the way the relay needs it: create treats AlreadyExists as success,
delete treats NotFound as success.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from retex.api import GROUP, PLURAL, VERSION

MERGE_PATCH = "application/merge-patch+json"


class KubeCalls:
    def __init__(self, api: client.ApiClient):
        self._api = api
        self._batch = client.BatchV1Api(api)
        self._coordination = client.CoordinationV1Api(api)
        self._core = client.CoreV1Api(api)
        self._custom = client.CustomObjectsApi(api)

    def _plain(self, model: Any) -> dict[str, Any]:
        return self._api.sanitize_for_serialization(model)

    # -- attempts --------------------------------------------------------------------------

    def create_lease(self, body: dict[str, Any]) -> None:
        _created_or_exists(lambda: self._coordination.create_namespaced_lease(body["metadata"]["namespace"], body))

    def create_job(self, body: dict[str, Any]) -> None:
        _created_or_exists(lambda: self._batch.create_namespaced_job(body["metadata"]["namespace"], body))

    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._plain(self._batch.read_namespaced_job(name, namespace))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def delete_job(self, namespace: str, name: str) -> None:
        """Background propagation: the Job goes now, its pods after; a pod stuck Terminating on a
        lost node is never waited for."""
        try:
            self._batch.delete_namespaced_job(name, namespace, propagation_policy="Background")
        except ApiException as exc:
            if exc.status != 404:
                raise

    # -- tasks -----------------------------------------------------------------------------

    def get_task(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list_tasks(self) -> list[dict[str, Any]]:
        return self._custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]

    def patch_task_status(self, namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        """Merge-patch the status subresource. The uid precondition keeps a status from landing
        on a newer Task that reuses the name; the CRD's CEL rule refuses a lower ledgerVersion."""
        body = {"metadata": {"uid": uid}, "status": status}
        self._custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, body, _content_type=MERGE_PATCH
        )

    def patch_task_labels(self, namespace: str, name: str, uid: str, labels: dict[str, str | None]) -> None:
        """Merge-patch labels (None removes one) on the Task with this uid."""
        body = {"metadata": {"uid": uid, "labels": labels}}
        self._custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, body,
                                                    _content_type=MERGE_PATCH)

    def post_event(self, task: dict[str, Any], *, reason: str, message: str, warning: bool = False) -> None:
        meta = task["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._core.create_namespaced_event(
            meta["namespace"],
            {
                "metadata": {"generateName": f"{meta['name'][:200]}.", "namespace": meta["namespace"]},
                "involvedObject": {"apiVersion": task["apiVersion"], "kind": task["kind"], "name": meta["name"],
                                   "namespace": meta["namespace"], "uid": meta["uid"]},
                "reason": reason,
                "message": message[:1024],
                "type": "Warning" if warning else "Normal",
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
                "source": {"component": "retex-operator"},
                "reportingComponent": "retex.dev/operator",
                "reportingInstance": "retex-operator",
            },
        )

    # -- the reaper's questions about one attempt (attempt lifecycle) ------------------------

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Lease as it is now: the reaper confirms what the watch showed before acting on it.
        A LIST of one name (a consistent read), so the operator needs no `get` on Leases."""
        listed = self._coordination.list_namespaced_lease(namespace, field_selector=f"metadata.name={name}")
        items = self._plain(listed).get("items") or []
        return items[0] if items else None

    def job_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        """The pods the Job controller made for this Job (label job-name)."""
        listed = self._core.list_namespaced_pod(namespace, label_selector=f"job-name={job}")
        return self._plain(listed).get("items") or []

    def job_events(self, namespace: str, job: str) -> list[dict[str, Any]]:
        """Events about the Job (FailedCreate: a pod the API server refused, e.g. by quota)."""
        listed = self._core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.kind=Job,involvedObject.name={job}")
        return self._plain(listed).get("items") or []


def _created_or_exists(create) -> None:
    try:
        create()
    except ApiException as exc:
        if exc.status != 409:
            raise
