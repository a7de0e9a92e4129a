"""D − R bounds the operator's writes only: the cluster-wide LIST of Tasks gets a longer timeout."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from retex.kube.operator_calls import LIST_TIMEOUT_SECONDS, KubeCalls


def test_the_task_list_has_a_longer_timeout_than_writes(monkeypatch):
    seen: dict[str, Any] = {}

    def list_cluster_custom_object(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs)
        return {"items": []}

    monkeypatch.setattr(client.CustomObjectsApi, "list_cluster_custom_object", list_cluster_custom_object)
    calls = KubeCalls(client.ApiClient(client.Configuration()), instance="x", request_timeout=5.0)
    assert list(calls.list_tasks()) == []
    assert seen["_request_timeout"] == LIST_TIMEOUT_SECONDS > 5.0


def test_the_lease_watchs_relist_has_the_task_lists_timeout(monkeypatch):
    """A silent API server cannot hang the lease watch's relist for ever while its thread lives."""
    from retex.kube.leasewatch import LeaseObserver

    seen: dict[str, Any] = {}
    observer: LeaseObserver

    def list_lease_for_all_namespaces(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        observer.stop()
        raise RuntimeError("stop here")

    monkeypatch.setattr(client.CoordinationV1Api, "list_lease_for_all_namespaces", list_lease_for_all_namespaces)
    observer = LeaseObserver(client.ApiClient(client.Configuration()))
    observer.run()
    assert seen.get("_request_timeout") == LIST_TIMEOUT_SECONDS


def _paged_calls(monkeypatch, answers: list[Any]) -> tuple[KubeCalls, list[dict[str, Any]]]:
    """KubeCalls whose Task LIST answers each page from `answers` (a dict, or an exception raised)."""
    asked: list[dict[str, Any]] = []

    def list_cluster_custom_object(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        asked.append(kwargs)
        answer = answers[len(asked) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(client.CustomObjectsApi, "list_cluster_custom_object", list_cluster_custom_object)
    return KubeCalls(client.ApiClient(client.Configuration()), instance="x", request_timeout=5.0, list_page_size=2), asked


def test_a_continue_token_expired_between_pages_ends_the_list_with_what_was_read(monkeypatch):
    from kubernetes.client.exceptions import ApiException

    calls, asked = _paged_calls(monkeypatch, [
        {"items": [{"n": 1}, {"n": 2}], "metadata": {"continue": "t1"}},
        ApiException(status=410, reason="Gone"),
    ])
    assert list(calls.list_tasks()) == [{"n": 1}, {"n": 2}]
    assert [(a["limit"], a["_continue"]) for a in asked] == [(2, None), (2, "t1")]


def test_a_first_page_refused_is_an_error_not_an_empty_list(monkeypatch):
    from kubernetes.client.exceptions import ApiException

    calls, _ = _paged_calls(monkeypatch, [ApiException(status=410, reason="Gone")])
    with pytest.raises(ApiException):
        list(calls.list_tasks())
