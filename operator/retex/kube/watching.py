"""The loop of the operator's own watches (worker Leases, worker pods): list page by page, then
watch from the list's resourceVersion; list again only after 410 Gone or an error, telling the
watcher it was blind meanwhile. A silent API server cannot hang it: the list has a read timeout,
the watch a server-side timeout and a longer client one."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from retex.kube.errors import expired
from retex.kube.operator_calls import LIST_TIMEOUT_SECONDS
from retex.logs import log_line

log = logging.getLogger(__name__)

# Objects per page of a watch's LIST: the operator holds one page's response at a time.
LIST_PAGE_SIZE = 500

ObjectKey = tuple[str, str]  # (namespace, name): what a watcher keys what it saw by


def object_key(obj: dict[str, Any]) -> ObjectKey:
    return obj["metadata"].get("namespace") or "", obj["metadata"]["name"]


def _list_in_pages(list_all: Callable[..., Any], label_selector: str) -> tuple[list[dict[str, Any]], str]:
    """Every object the selector matches, and the version to watch from. One page of raw bytes
    is held at a time, not the whole list's. Every page is read at the first page's
    resourceVersion (the server's consistent snapshot), which each page repeats; an expired
    continue token (410) is raised, and the caller lists again from the start."""
    items: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        answer = list_all(label_selector=label_selector, limit=LIST_PAGE_SIZE, _continue=token,
                          _request_timeout=LIST_TIMEOUT_SECONDS, _preload_content=False)
        page = json.loads(answer.data)
        items += page.get("items") or []
        token = page["metadata"].get("continue")
        if not token:
            return items, page["metadata"]["resourceVersion"]


def list_then_watch(list_all: Callable[..., Any], *, label_selector: str, stopped: threading.Event,
                    listed: Callable[[list[dict[str, Any]]], None], changed: Callable[[str, dict[str, Any]], None],
                    went_blind: Callable[[], None], what: str,
                    before_each_round: Callable[[], None] = lambda: None) -> None:
    """Until `stopped`: `listed(items)` after each list, `changed(type, object)` for each ADDED,
    MODIFIED or DELETED, `went_blind()` when the watch fails. Objects are plain dicts, as the API
    server sent them. `list_all` is a `list_*_for_all_namespaces` of the kubernetes client."""
    version: str | None = None
    while not stopped.is_set():
        before_each_round()
        try:
            if version is None:
                items, version = _list_in_pages(list_all, label_selector)
                listed(items)
            stream = watch.Watch()
            for change in stream.stream(list_all, label_selector=label_selector, resource_version=version,
                                        allow_watch_bookmarks=True, timeout_seconds=60, _request_timeout=90):
                if stopped.is_set():
                    stream.stop()
                    return
                version = change["raw_object"]["metadata"]["resourceVersion"]
                if change["type"] in ("ADDED", "MODIFIED", "DELETED"):
                    changed(change["type"], change["raw_object"])
        except ApiException as exc:
            version = None
            went_blind()
            if not expired(exc):
                log_line(log, logging.WARNING, f"{what} watch failed; relisting", http_status=exc.status)
                stopped.wait(1.0)
        except Exception as exc:  # connection refused while the API server restarts, etc.
            version = None
            went_blind()
            log_line(log, logging.WARNING, f"{what} watch interrupted; relisting", error=str(exc))
            stopped.wait(1.0)
