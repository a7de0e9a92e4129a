"""`http` steps: one request, TLS verified, with an `Idempotency-Key` header.

Headers sent besides the step's own: Idempotency-Key, X-Retex-Task-Uid, X-Retex-Step,
X-Retex-Attempt. Body: the step's `body` as JSON (a string as is); when it has none, POST, PUT and
PATCH send the envelope {"idempotencyKey", "taskUid", "step", "attempt", "payload", "results"}.
Redirects are not followed (a 3xx is an answer like any other).

Outcomes: 2xx = success, result {"status", "body"} (JSON body parsed when it fits 32 KiB, else the
beginning as text with "bodyTruncated": true). A non-2xx status is a failure, retryable for 408,
425, 429 and 5xx unless the step's status lists say otherwise — but for a step that is not
idempotent those statuses are unknown unless a list declares them (`status_outcome`). No
connection (refused, DNS, TLS handshake) = retryable failure: nothing was sent. A request that
cannot be put together (a header value http.client cannot encode; CR, LF and NUL are refused by
the models before any step runs) = permanent failure, nothing sent. A destination that resolves
only to link-local addresses (169.254.0.0/16, fe80::/10, also IPv4-mapped; and fd00:ec2::254),
where cloud metadata services hand out the node's credentials = permanent failure, nothing
sent: the API server refuses such URLs written as addresses, but a name (or 2852039166) can
resolve there. The connection goes to the address that was checked, never to a second lookup's.
Lost after sending or timed out = unknown.
Verify convention: 2xx = found (that response is the result), 404 = not found, other = error.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from retex.api.models import HttpAction, Step
from retex.worker.outcomes import (
    Abandoned,
    Failed,
    Found,
    NotFound,
    StepOutcome,
    Succeeded,
    Unknown,
    VerifyFailed,
    VerifyOutcome,
    head_text,
)
from retex.worker.processes import LEASE_LOST
from retex.worker.supervision import SecretMissing, StepCall, Supervision, secret_value

BODY_LIMIT_BYTES = 32 * 1024
ERROR_BODY_BYTES = 512
DEFAULT_RETRYABLE_STATUSES = frozenset({408, 425, 429})
_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
_POLL_SECONDS = 0.05
# A request is sent within this long of the step's begin (or its timeout, if shorter), or not at
# all: name resolution, connect and TLS handshake together. The server is then allowed the step's
# timeoutSeconds to finish with it, so a verify waits begin + this + timeoutSeconds + margin.
SEND_WITHIN_SECONDS = 10.0


# Link-local addresses are refused by ip_address(...).is_link_local; AWS's IPv6 metadata address and
# Alibaba Cloud's (100.100.100.200) are not.
_METADATA_ADDRESSES = frozenset({ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200")})


def forbidden_destination(address: str) -> bool:
    """Whether a resolved address is one no http step may reach: link-local or a metadata service."""
    ip = ipaddress.ip_address(address.split("%")[0])  # an IPv6 zone (fe80::1%eth0) is not part of the address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_link_local or ip in _METADATA_ADDRESSES


def _destination(host: str, port: int) -> str:
    """The first address `host` resolves to that a step may reach. Raises OSError when it does not
    resolve, `ForbiddenDestination` when every address it resolves to is forbidden."""
    # An AF_INET or AF_INET6 address (the only families a name resolves to here) is a string.
    addresses = [str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
    allowed = [address for address in addresses if not forbidden_destination(address)]
    if not allowed:
        raise ForbiddenDestination(
            f"{host} resolves to {', '.join(dict.fromkeys(addresses))}: http steps may not reach link-local or "
            "cloud metadata addresses (169.254.0.0/16, fe80::/10), where a node's credentials are served; "
            "nothing was sent")
    return allowed[0]


class ForbiddenDestination(Exception):
    pass


def send_within_seconds(step: Step) -> float:
    return min(float(step.timeout_seconds), SEND_WITHIN_SECONDS)


def status_outcome(step: Step, status: int, summary: str) -> Failed | Unknown:
    """A non-2xx answer. 408, 425, 429 and 5xx do not prove that nothing happened (a gateway's 504
    after the upstream committed): for a step that is not idempotent they are unknown, unless the
    step declares that status in retryableStatuses or permanentStatuses. Other statuses (3xx,
    4xx) are the server refusing the request: a clean failure."""
    declared = (step.retryable_statuses or []) + (step.permanent_statuses or [])
    ambiguous = status in DEFAULT_RETRYABLE_STATUSES or status >= 500
    if ambiguous and not step.idempotent and status not in declared:
        return Unknown(f"{summary} (not idempotent, and this status does not prove nothing happened)")
    return Failed(summary, retryable=status_retryable(step, status))


def status_retryable(step: Step, status: int) -> bool:
    if step.retryable_statuses is not None:
        return status in step.retryable_statuses
    if step.permanent_statuses is not None:
        return status not in step.permanent_statuses
    return status in DEFAULT_RETRYABLE_STATUSES or status >= 500


@dataclass(frozen=True)
class _Response:
    status: int
    body: Any  # parsed JSON, or text
    truncated: bool

    def as_result(self) -> dict[str, Any]:
        result = {"status": self.status, "body": self.body}
        if self.truncated:
            result["bodyTruncated"] = True
        return result

    def summary(self) -> str:
        text = self.body if isinstance(self.body, str) else json.dumps(self.body)
        return f"HTTP {self.status}: {text[:ERROR_BODY_BYTES]}"


@dataclass(frozen=True)
class _NotConnected:
    error: str


@dataclass(frozen=True)
class _NotSent:
    """The request could not be put together (a header value http.client refuses): nothing was sent."""

    error: str


@dataclass(frozen=True)
class _LostAfterSending:
    error: str


_Answer = _Response | _NotConnected | _NotSent | _LostAfterSending


class _Exchange:
    """One request/response on a helper thread, so the caller can give up on it at a deadline.

    Giving up (`abort`) is final: the thread sends nothing afterwards. Resolving a name has no
    timeout (getaddrinfo) and connecting may be slow, so the thread checks, under the lock that
    `abort` takes, right before it hands the request to the socket; `abort` shuts the socket down,
    so a send that races it fails; and http.client may not reconnect on its own (auto_open)."""

    def __init__(self, action: HttpAction, call: StepCall, *, send_by: float, answer_by: float,
                 held: Callable[[], bool]):
        self._action, self._call, self._held = action, call, held
        self._send_by, self._answer_by = send_by, answer_by
        self._lock = threading.Lock()
        self._aborted = False
        self._connection: http.client.HTTPConnection | None = None
        self.answer: _Answer | None = None
        self.done = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name="retex-http-step", daemon=True).start()

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            sock = self._connection.sock if self._connection is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # not close(): the thread still owns the descriptor
            except OSError:
                pass

    def _run(self) -> None:
        try:
            self.answer = self._exchange()
        except Exception as exc:  # noqa: BLE001 - whatever it was, the caller must get an answer
            self.answer = _LostAfterSending(f"unexpected {type(exc).__name__}: {exc}")
        finally:
            self.done.set()

    def _exchange(self) -> _Answer:
        body, content_type = _request_body(self._action, self._call)
        from_secrets: dict[str, str] = {}
        for header in self._action.headers_from or ():
            ref = header.value_from.secret_key_ref
            try:
                from_secrets[header.name] = secret_value(ref)
            except SecretMissing as missing:
                return _NotSent(str(missing))
            # Said without the value or http.client's message (which quotes it): errors are stored.
            if any(c in from_secrets[header.name] for c in "\r\n\x00"):
                return _NotSent(f"header {header.name} from Secret {ref.name} key {ref.key} contains CR, LF or "
                                "NUL; nothing was sent")
        headers = {**(self._action.headers or {}), **from_secrets, **_retex_headers(self._call)}
        if content_type and not any(h.lower() == "content-type" for h in headers):
            headers["Content-Type"] = content_type
        # The model's URL pattern (api/models.py) admits only a host and a port in range.
        url = urlsplit(self._action.url)
        host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
        assert host is not None
        try:
            address = _destination(host, port)
        except ForbiddenDestination as refusal:
            return _NotSent(str(refusal))
        except OSError as exc:  # the name does not resolve (now)
            return _NotConnected(f"cannot connect to {host}:{url.port or url.scheme}: {exc}")
        connect_within = max(0.001, self._send_by - time.monotonic())
        connection: http.client.HTTPConnection
        if url.scheme == "https":
            connection = http.client.HTTPSConnection(host, port, timeout=connect_within,
                                                     context=ssl.create_default_context())
        else:
            connection = http.client.HTTPConnection(host, port, timeout=connect_within)
        connection.auto_open = 0  # a connection closed under it must fail, never be reopened and sent on
        # To the address checked above (TLS still verifies the name): a second lookup could answer otherwise.
        # An instance attribute http.client sets in __init__ and calls in connect(); typeshed leaves it out.
        connection._create_connection = lambda _, timeout, source: socket.create_connection(  # type: ignore[attr-defined]
            (address, port), timeout, source)
        with self._lock:
            if self._aborted:
                return _NotSent(_GAVE_UP)
            self._connection = connection
        try:
            try:
                connection.connect()
            except OSError as exc:  # includes TLS handshake and certificate errors, and the connect timeout
                return _NotConnected(f"cannot connect to {host}:{url.port or url.scheme}: {exc}")
            path = url.path or "/"
            if url.query:
                path += f"?{url.query}"
            # http.client only buffers the request line and headers until endheaders().
            connection.putrequest(self._action.method, path)
            for name, value in headers.items():
                try:
                    connection.putheader(name, value)
                except (ValueError, UnicodeError) as exc:  # a value it cannot encode (latin-1 only)
                    why = type(exc).__name__ if name in from_secrets else f"{type(exc).__name__}: {exc}"
                    return _NotSent(f"header {name} cannot be sent: {why}; nothing was sent")
            if body is not None:
                connection.putheader("Content-Length", str(len(body)))
            with self._lock:  # the last moment the request can still be kept unsent
                if self._aborted:
                    return _NotSent(_GAVE_UP)
                if not self._held():
                    return _NotSent(LEASE_LOST)
                if time.monotonic() >= self._send_by:
                    return _NotConnected(f"not connected to {host}:{url.port or url.scheme} in time; "
                                         "nothing was sent")
                connection.sock.settimeout(max(0.001, self._answer_by - time.monotonic()))
            try:
                connection.endheaders(body)
                response = connection.getresponse()
                data = response.read(BODY_LIMIT_BYTES + 1)
            except (OSError, http.client.HTTPException) as exc:
                return _LostAfterSending(f"{type(exc).__name__}: {exc}")
            return _parse(response.status, data)
        finally:
            connection.close()


_GAVE_UP = "given up before sending"


def _retex_headers(call: StepCall) -> dict[str, str]:
    return {"Idempotency-Key": call.idempotency_key, "X-Retex-Task-Uid": call.task_uid,
            "X-Retex-Step": call.step, "X-Retex-Attempt": str(call.attempt)}


def _request_body(action: HttpAction, call: StepCall) -> tuple[bytes | None, str | None]:
    if isinstance(action.body, str):
        return action.body.encode(), None
    if action.body is not None:
        return json.dumps(action.body).encode(), "application/json"
    if action.method in _METHODS_WITH_BODY:
        envelope = {"idempotencyKey": call.idempotency_key, "taskUid": call.task_uid, "step": call.step,
                    "attempt": call.attempt, "payload": call.payload, "results": call.results}
        return json.dumps(envelope).encode(), "application/json"
    return None, None


def _parse(status: int, data: bytes) -> _Response:
    if len(data) <= BODY_LIMIT_BYTES:
        try:
            return _Response(status, json.loads(data) if data else None, truncated=False)
        except ValueError:
            pass
    text, cut = head_text(data[:BODY_LIMIT_BYTES], BODY_LIMIT_BYTES)
    return _Response(status, text, truncated=cut or len(data) > BODY_LIMIT_BYTES)


def _exchange(action: HttpAction, step: Step, call: StepCall,
              sup: Supervision) -> _Answer | Literal["timeout", "abandoned", "lease-lost"]:
    """The answer, or "timeout" / "abandoned" / "lease-lost" when the step's time, the drain or the
    lease ran out first. Closing the connection stops the client; a server may still process what
    it received, which is why a verify waits for the step's deadline (docs/worker.md)."""
    if not sup.held():
        return "lease-lost"
    deadline = call.begun + step.timeout_seconds
    exchange = _Exchange(action, call, send_by=call.begun + send_within_seconds(step), answer_by=deadline,
                         held=sup.held)
    exchange.start()
    while not exchange.done.wait(_POLL_SECONDS):
        if not sup.held():
            exchange.abort()
            return "lease-lost"
        now = time.monotonic()
        if now >= deadline:
            exchange.abort()
            return "timeout"
        if sup.drain.deadline is not None and now >= sup.drain.deadline:
            exchange.abort()
            return "abandoned"
    if exchange.answer is None:  # its thread ended by a BaseException (not an Exception): it may have sent
        return _LostAfterSending("the request's thread ended without an answer")
    return exchange.answer


def run(action: HttpAction, step: Step, call: StepCall, sup: Supervision) -> StepOutcome:
    answer = _exchange(action, step, call, sup)
    if answer == "lease-lost" or answer == _NotSent(LEASE_LOST):
        return Abandoned(LEASE_LOST)
    if answer == "abandoned":
        return Abandoned("stopped at the drain deadline")
    if answer == "timeout":
        return Unknown(f"no response within {step.timeout_seconds}s")
    if isinstance(answer, _NotConnected):
        return Failed(answer.error, retryable=True)
    if isinstance(answer, _NotSent):
        return Failed(answer.error, retryable=False)  # the step as written can never be sent
    if isinstance(answer, _LostAfterSending):
        return Unknown(f"connection lost after sending: {answer.error}")
    if 200 <= answer.status < 300:
        return Succeeded(answer.as_result())
    return status_outcome(step, answer.status, answer.summary())


def verify(action: HttpAction, step: Step, call: StepCall, sup: Supervision) -> VerifyOutcome:
    answer = _exchange(action, step, call, sup)
    if answer == "lease-lost" or answer == _NotSent(LEASE_LOST):
        return Abandoned(LEASE_LOST)
    if answer == "abandoned":
        return Abandoned("stopped at the drain deadline")
    if answer == "timeout":
        return VerifyFailed(f"verify: no response within {step.timeout_seconds}s")
    if isinstance(answer, _NotConnected | _NotSent | _LostAfterSending):
        return VerifyFailed(f"verify: {answer.error}")
    if 200 <= answer.status < 300:
        return Found({**answer.as_result(), "verified": True})
    if answer.status == 404:
        return NotFound()
    return VerifyFailed(f"verify: {answer.summary()}")
