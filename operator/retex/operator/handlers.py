"""kopf handlers: thin glue. Decisions live in the ledger; API calls in retex.kube.

kopf settings chosen (see docs/operator.md for why): progress in annotations under retex.dev,
our own finalizer name, handlers return None (nothing dumped into status), watch timeouts so a
silent stream reconnects, sync handlers (kopf runs them in its thread pool, so the blocking
Kubernetes and Postgres clients never stall its event loop), log lines not posted as Events.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import kopf

from retex.api import GROUP, PLURAL, VERSION
from retex.failpoints import failpoint
from retex.kube.calls import KubeCalls
from retex.kube.client import api_client
from retex.kube.leasewatch import LeaseObserver
from retex.ledger import Ledger
from retex.operator.admission import admission_for
from retex.operator.dispatch import Promoter, Relay
from retex.operator.reaper import Reaper
from retex.operator.settings import OperatorSettings
from retex.operator.status import StatusMirror

log = logging.getLogger(__name__)
TASKS = (GROUP, VERSION, PLURAL)


class Runtime:
    """The operator's long-lived parts: one ledger, one API client, and the background loops."""

    def __init__(self, settings: OperatorSettings):
        self.ledger = Ledger(settings.database_url).open()
        api = api_client()
        self.kube = KubeCalls(api)
        self.leases = LeaseObserver(api)
        self.relay = Relay(self.ledger, self.kube, settings.worker, interval=settings.relay_interval_seconds,
                           failpoints_from_annotations=settings.failpoints_from_annotations)
        self.promoter = Promoter(self.ledger, self.relay)
        self.reaper = Reaper(self.ledger, self.kube, self.leases, interval=settings.reaper_interval_seconds,
                             on_replaced=self.relay.wake.set)
        self.mirror = StatusMirror(self.ledger, self.kube, self.leases, resync_seconds=settings.resync_seconds)
        self._loops = [self.leases, self.relay, self.promoter, self.reaper, self.mirror]
        self._threads = [
            threading.Thread(target=fn, name=name, daemon=True)
            for name, fn in [("lease-watch", self.leases.run), ("relay", self.relay.run),
                             ("promoter", self.promoter.run), ("reaper", self.reaper.run),
                             ("status-mirror", self.mirror.run), ("ledger-listen", self.mirror.listen)]
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        for loop in self._loops:
            loop.stop()
        for thread in self._threads:
            thread.join(timeout=5)
        self.ledger.close()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = "retex.dev/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="retex.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="retex.dev")
    settings.posting.enabled = False
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.watching.inactivity_timeout = 330
    settings.networking.request_timeout = 30
    memo.runtime = Runtime(OperatorSettings.from_env())
    memo.runtime.start()


@kopf.on.cleanup()
def shutdown(memo: kopf.Memo, **_: Any) -> None:
    memo.runtime.stop()


@kopf.on.resume(*TASKS)
@kopf.on.create(*TASKS)
def admit(uid: str, namespace: str, name: str, spec: kopf.Spec, memo: kopf.Memo, **_: Any) -> None:
    """Into the ledger with its first dispatch, in one transaction; idempotent by UID (R1)."""
    runtime: Runtime = memo.runtime
    failpoint("before-admit")  # crash-matrix R1: the Task exists, the ledger row does not
    result = runtime.ledger.admit(admission_for(uid=uid, namespace=namespace, name=name, spec=dict(spec)))
    failpoint("after-admit")  # crash-matrix R2: ledger row and dispatch committed, no Job yet
    if result.duplicate_of:
        log.info("%s/%s duplicates task %s by idempotencyKey; not run", namespace, name, result.duplicate_of)
    if spec.get("cancel"):
        runtime.ledger.request_cancel(uid)
    runtime.relay.wake.set()
    runtime.promoter.wake.set()
    runtime.mirror.mark(result.uid)


@kopf.on.field(*TASKS, field="spec.cancel", new=True)
def cancel(uid: str, memo: kopf.Memo, **_: Any) -> None:
    memo.runtime.ledger.request_cancel(uid)


@kopf.on.delete(*TASKS, optional=True)
def deleted(uid: str, memo: kopf.Memo, **_: Any) -> None:
    """Best effort without a finalizer: the ledger stops the task (its history is kept); owner
    references take the Job and Lease away."""
    memo.runtime.ledger.abandon(uid, reason="TaskDeleted")
