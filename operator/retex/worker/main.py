"""`retex-worker`: run one attempt of one task, then exit with a code the operator acts on.

0 = the attempt is over and the ledger says why; 3 = not ours (stale), nothing done;
75 = disrupted (drain, lease lost or missing, ledger unavailable); anything else = crash.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any

from pydantic import ValidationError

from retex.api.models import TaskSpec
from retex.failpoints import failpoint
from retex.kube.leases import Holder, LeaseTiming
from retex.kube.rest import RestClient
from retex.ledger import FenceRejected, LedgerUnavailable, TaskNotFound, spec_hash
from retex.ledger.wire import RequestRefused
from retex.logs import log_line
from retex.machine import TaskPhase
from retex.worker import logs
from retex.worker.attempt import Attempt, AttemptEnd, ExitCode
from retex.worker.config import LEDGER_RETRY_SECONDS, ConfigError, WorkerConfig
from retex.worker.drain import Drain
from retex.worker.hardening import refuse_same_user_inspection
from retex.worker.lease import AttemptLease, LeaseRefused, LeaseUnavailable
from retex.worker.ledger_client import LedgerClient
from retex.worker.supervision import Supervision

log = logging.getLogger("retex.worker")
CRASHED = 1
BAD_ENVIRONMENT = 2


class SpecNotTheTasks(Exception):
    """The ledger's copy of the spec is not the Task's this Job was built from: run nothing."""


def main() -> int:
    try:
        config = WorkerConfig.from_env()
    except ConfigError as exc:
        print(f"retex-worker: {exc}", file=sys.stderr)
        return BAD_ENVIRONMENT
    tagger = logs.configure(task_uid=config.task_uid, namespace=config.namespace, name=config.name,
                            epoch=config.epoch, pod=config.pod_name)
    age = logs.process_age_seconds()
    log_line(log, logging.INFO, "worker started", process_age_seconds=None if age is None else round(age, 3))
    drain = Drain(config.drain_seconds)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: _begin_drain(drain))
    refuse_same_user_inspection()
    ledger = LedgerClient(config.ledger_url, config.ledger_token_file, retry_for_seconds=LEDGER_RETRY_SECONDS,
                          ca_pem=config.ledger_ca)
    try:
        end = run(config, ledger, drain, tagger)
    except RequestRefused as exc:
        # The endpoint does not take this pod for a worker of this attempt: a set-up fault (token
        # audience, RBAC) or a forged pod. Nothing was written; the Lease is left to expire.
        log_line(log, logging.ERROR, "the ledger endpoint refused this worker", why=str(exc))
        return BAD_ENVIRONMENT
    except SpecNotTheTasks as exc:
        log_line(log, logging.ERROR, "spec refused: not the Task's", why=str(exc))
        return BAD_ENVIRONMENT
    except Exception:
        # A bug or an impossible state: a crash, counted as a failure by the operator. The Lease
        # is left to expire.
        log_line(log, logging.ERROR, "worker crashed", exc_info=True)
        return CRASHED
    finally:
        ledger.close()
    log_line(log, logging.INFO, "worker exiting", exit_code=int(end.code), why=end.why)
    return int(end.code)


def run(config: WorkerConfig, ledger: LedgerClient, drain: Drain, tagger: logs.TaskFields) -> AttemptEnd:
    # Read before touching the Lease: a stale pod (old epoch, terminal task) must leave no trace.
    try:
        record = ledger.get(config.task_uid)
    except TaskNotFound:
        return AttemptEnd(ExitCode.STALE, "the task is not in the ledger")
    except LedgerUnavailable as exc:
        return AttemptEnd(ExitCode.DISRUPTED, str(exc))
    if record.epoch != config.epoch or record.phase != TaskPhase.RUNNING:
        return AttemptEnd(ExitCode.STALE, f"task is {record.phase} at epoch {record.epoch}")
    if spec_hash(record.spec) != config.spec_hash:
        raise SpecNotTheTasks(f"the ledger's spec (hash {spec_hash(record.spec)[:12]}) is not the one this Job was "
                              f"built from ({config.spec_hash[:12]}); nothing run, the Lease untouched")

    # The Lease's duration is the Job's (the operator's); the renew deadline may come from the spec.
    timing = LeaseTiming.of(config.lease_duration_seconds, _renew_deadline(record.spec))
    lease = AttemptLease(RestClient.from_environment(), config.namespace, config.lease_name,
                         Holder(config.pod_name, config.epoch), timing)
    try:
        lease.acquire()
    except LeaseRefused as exc:
        return AttemptEnd(ExitCode.STALE, str(exc))
    except LeaseUnavailable as exc:
        return AttemptEnd(ExitCode.DISRUPTED, str(exc))
    failpoint("after-lease", task=config.name, uid=config.task_uid)
    lease.start_renewing()
    # Past its first minute, an unreachable endpoint (the operator restarting, however long) is
    # waited out for as long as this attempt holds its Lease: nobody can replace it meanwhile.
    ledger.keep_trying = lease.still_held
    end: AttemptEnd | None = None
    try:
        actor = f"worker:{config.pod_name}"
        claimed = ledger.claim_attempt(config.task_uid, config.epoch, pod=config.pod_name, node=config.node_name)
        end = Attempt(ledger, claimed, epoch=config.epoch, actor=actor, lease=lease,
                      supervision=Supervision(drain=drain), tagger=tagger).run()
    except FenceRejected as exc:
        end = AttemptEnd(ExitCode.STALE, str(exc))
    except LedgerUnavailable as exc:
        end = AttemptEnd(ExitCode.DISRUPTED, str(exc))
    finally:
        if end is not None:  # a crash leaves the Lease to expire: the operator counts it as a failure
            lease.release()
    return end


def _renew_deadline(spec: dict[str, Any]) -> float | None:
    """The spec's renew deadline; None (the default) for a spec the models refuse: the attempt
    then ends the task over it, fenced, while holding the Lease."""
    try:
        return TaskSpec.model_validate(spec).lease.renew_deadline_seconds
    except ValidationError:
        return None


def _begin_drain(drain: Drain) -> None:
    drain.begin()
    log_line(log, logging.INFO, "SIGTERM: draining", drain_seconds=drain.seconds)


if __name__ == "__main__":
    sys.exit(main())
