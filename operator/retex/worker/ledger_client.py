"""The worker's ledger: the operations of retex.ledger.Ledger that a worker needs, sent to the
operator's ledger endpoint with the pod's projected ServiceAccount token. Workers hold no database
credentials (docs/security.md).

Same contract as the Ledger methods: the same records, the same typed errors, and an outage
(the operator restarting, Postgres down behind it) retried for `retry_for_seconds`, and past that
for as long as `keep_trying()` says (the worker: while it holds its Lease, so an operator outage
of any length costs a running attempt nothing), then `LedgerUnavailable`. An endpoint that answers
"not now" (429, or 503 with Retry-After: it is up, and protecting itself or other tenants) is
retried, no sooner than it asks and with jitter, for as long as it answers so: such an answer is
no outage, and a worker giving up its attempt over it would count a disruption the task never
had (before its Lease, the reaper judges a running pod slow, never stuck). Every operation is
idempotent when repeated by the same attempt (the Ledger's "a repeated call" rules), so a request
whose reply was lost is simply sent again.
"""

from __future__ import annotations

import json
import logging
import random
import ssl
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import urllib3

from retex.ledger import LedgerUnavailable, StepRecord, TaskRecord, UnstorableValue
from retex.ledger.wire import PATH_PREFIX, RequestRefused, error_from_json, step_from_json, task_from_json, to_json
from retex.logs import log_line

log = logging.getLogger(__name__)
# Longer than the endpoint's own Postgres retry window (retex.operator.ledger_endpoint), so a slow
# answer is waited for rather than sent again while it is still being worked on.
REQUEST_TIMEOUT = urllib3.Timeout(connect=5.0, read=30.0)
_TRANSIENT_STATUSES = frozenset({408, 502, 503, 504})
_SERVER_ERROR_TRIES = 3  # a 500 is a bug until shown otherwise: a few tries, then a refusal
ERROR_MAX_CHARS = 4096  # as the ledger keeps them: a longer text would only be cut there
MAX_RETRY_DELAY_SECONDS = 2.0


class LedgerClient:
    def __init__(self, url: str, token_file: str, *, retry_for_seconds: float, ca_pem: str | None = None):
        self._url = url.rstrip("/") + PATH_PREFIX
        self._token_file = Path(token_file)
        self._retry_for = retry_for_seconds
        # https: the endpoint's certificate is checked against the CA the operator handed over
        # (else the system's), host name included; a token is never sent to whoever answers.
        self._http = urllib3.PoolManager(maxsize=2, retries=False, timeout=REQUEST_TIMEOUT, cert_reqs="CERT_REQUIRED",
                                         ca_cert_data=ca_pem or None)
        self.keep_trying: Callable[[], bool] = lambda: False

    def close(self) -> None:
        self._http.clear()

    # -- the worker's operations (retex.ledger.Ledger's signatures) -------------------------

    def get(self, uid: str) -> TaskRecord:
        return task_from_json(self._call("get", uid=uid))

    def claim_attempt(self, uid: str, epoch: int, *, pod: str, node: str | None) -> TaskRecord:
        # `pod` is the endpoint's to know (the token's pod); it is not sent.
        return task_from_json(self._call("claim_attempt", uid=uid, epoch=epoch, node=node))

    def begin_step(self, uid: str, epoch: int, idx: int, *, actor: str) -> StepRecord:
        # One id for this call and every retry of it: a repeat whose first reply was lost gets the
        # first answer (Ledger.begin_step), not "started by your own attempt".
        return step_from_json(self._call("begin_step", uid=uid, epoch=epoch, idx=idx, request=uuid.uuid4().hex))

    def start_run(self, uid: str, epoch: int, idx: int, *, actor: str) -> None:
        self._call("start_run", uid=uid, epoch=epoch, idx=idx)

    def seconds_until_step_deadline(self, uid: str, idx: int, *, begun_at: datetime | None,
                                    after_seconds: float) -> float:
        return float(self._call("seconds_until_step_deadline", uid=uid, idx=idx, begun_at=to_json(begun_at),
                                after_seconds=after_seconds))

    def commit_step(self, uid: str, epoch: int, idx: int, result: Any, *, actor: str) -> None:
        self._call("commit_step", uid=uid, epoch=epoch, idx=idx, result=result)

    def fail_step(self, uid: str, epoch: int, idx: int, error: str, *, retryable: bool, actor: str) -> TaskRecord:
        return task_from_json(self._call("fail_step", uid=uid, epoch=epoch, idx=idx, error=error[:ERROR_MAX_CHARS],
                                         retryable=retryable))

    def flag_step(self, uid: str, epoch: int, idx: int, why: str, *, actor: str) -> TaskRecord:
        return task_from_json(self._call("flag_step", uid=uid, epoch=epoch, idx=idx, why=why[:ERROR_MAX_CHARS]))

    def complete_task(self, uid: str, epoch: int, *, actor: str) -> TaskRecord:
        return task_from_json(self._call("complete_task", uid=uid, epoch=epoch))

    def finish_cancelled(self, uid: str, epoch: int, *, actor: str) -> TaskRecord:
        return task_from_json(self._call("finish_cancelled", uid=uid, epoch=epoch))

    # -- transport ---------------------------------------------------------------------------

    def _call(self, operation: str, **body: Any) -> Any:
        # allow_nan=False: NaN is not JSON; the endpoint would refuse it, and the ledger too.
        try:
            data = json.dumps(body, allow_nan=False).encode()
        except ValueError as exc:
            raise UnstorableValue(f"the ledger refused the value: {exc}") from exc
        deadline = time.monotonic() + self._retry_for
        delay, server_errors = 0.1, 0
        while True:
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self._token()}"}
            retry_after: float | None = None
            try:
                reply = self._http.request("POST", self._url + operation, body=data, headers=headers)
                status, payload = reply.status, _payload(reply.data)
                why = f"{status} {payload.get('message', '')}"
                if status in (429, 503):
                    retry_after = _seconds(reply.headers.get("Retry-After"))
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                if _certificate_refused(exc):  # no retry cures it, and the Lease would be held on
                    raise RequestRefused(0, f"the ledger endpoint's certificate does not verify against the CA "
                                            f"the operator handed over (RETEX_LEDGER_CA): {exc}") from None
                status, payload, why = 0, {}, str(exc)
            if status == 200:
                return payload["result"]
            if status == 409:
                raise error_from_json(payload)
            server_errors += status == 500
            if retry_after is None:
                if status and (status not in _TRANSIENT_STATUSES and status != 500
                               or server_errors >= _SERVER_ERROR_TRIES):
                    raise RequestRefused(status, str(payload.get("message", payload)))
                if time.monotonic() + delay > deadline and not self.keep_trying():
                    raise LedgerUnavailable(f"{operation}: ledger endpoint unavailable: {why}")
                pause = delay * random.uniform(0.5, 1.0)
            else:  # "not now" from a live endpoint: no sooner than asked, spread so as not to return together
                pause = max(retry_after, delay) * random.uniform(1.0, 1.5)
            log_line(log, logging.WARNING, "ledger endpoint unavailable; retrying", operation=operation,
                     retry_in_seconds=round(pause, 2), why=why)
            time.sleep(pause)
            delay = min(delay * 2, MAX_RETRY_DELAY_SECONDS)

    def _token(self) -> str:
        # Read at every call: the kubelet rotates projected tokens in place.
        try:
            return self._token_file.read_text().strip()
        except OSError as exc:  # no projected token: a set-up fault no retry cures
            raise RequestRefused(0, f"cannot read the ledger token {self._token_file}: {exc}") from exc


def _payload(data: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(data or b"{}")
    except ValueError:
        return {"message": data[:200].decode(errors="replace")}
    return payload if isinstance(payload, dict) else {"message": str(payload)}


def _seconds(retry_after: str | None) -> float | None:
    """A Retry-After of delta-seconds (the endpoint sends no dates); None if absent or not one."""
    try:
        return max(0.0, float(retry_after)) if retry_after is not None else None
    except ValueError:
        return None


def _certificate_refused(exc: BaseException) -> bool:
    """Whether TLS refused the endpoint's certificate (not a connection dropped mid-handshake)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError) or any(
                isinstance(arg, ssl.SSLCertVerificationError) for arg in seen.args):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
