"""The ledger endpoint: the only way a worker reaches the ledger (workers hold no DSN).

`POST /v1/attempt/<operation>` with the worker's pod-bound, audience-bound ServiceAccount token.
The caller's attempt comes from the token (retex.kube.identity), never from the request: a
request that names another task or epoch is refused, and so is a pod whose task lives in another
namespace or whose Job is not the one the operator builds for that attempt. Each operation then
runs as the same fenced Ledger method the worker used to call itself, so the epoch fence stays in
the transaction of the write. Errors go back as the ledger's own (retex.ledger.wire).

Served over TLS (`LedgerTls`: a serving certificate whose CA the workers are handed), so a token
read off the pod network cannot be replayed; plain HTTP only where the operator was told it may
(`RETEX_LEDGER_INSECURE=1`, docs/security.md). The certificate files are read again when they
change (a rotated Secret), for the connections that follow.

Any pod can reach the port, and every tenant shares it: no caller may stall or starve the others
(docs/security.md, "what tenants share"). It runs on aiohttp in an event loop
of its own thread, beside kopf's: a connection costs a coroutine, not a thread. The token is
resolved before a byte of the body is read; a request has a deadline for its headers and one for
the rest (body, handling, reply); connections are capped in total and per source address; each
call is admitted against its pod's and its namespace's quota (retex.operator.endpoint_limits);
the blocking work (TokenReviews, the ledger's psycopg calls) runs in small thread pools of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import os
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from retex.api.models import MAX_STEPS, SPEC_MAX_BYTES
from retex.kube.identity import IdentityUnavailable, NotAWorker, WorkerIdentities, WorkerIdentity
from retex.kube.objects import job_name
from retex.ledger import RESULT_LIMIT_BYTES, Ledger, LedgerError, LedgerUnavailable, TaskRecord
from retex.ledger.wire import OPERATIONS, PATH_PREFIX, UNFENCED, error_to_json, time_from_json, to_json
from retex.logs import log_line
from retex.machine import IllegalTransition
from retex.operator.endpoint_limits import Admission, ConnectionCount, FairSlots, Quota, ReplyBudget
from retex.operator.metrics import LEDGER_ENDPOINT_REFUSALS

log = logging.getLogger(__name__)
_ERROR_CHARS = 4096  # an error or a flag's reason, as the ledger keeps it
# JSON escapes a character in at most 12 bytes (a surrogate pair, \\uXXXX\\uXXXX).
_ESCAPED = 12
# The largest legal request: a commit of a result of RESULT_LIMIT_BYTES (measured as the worker
# encodes it), or a failure's error text, escaped; the rest of a body is a few hundred bytes.
MAX_BODY_BYTES = max(RESULT_LIMIT_BYTES, _ERROR_CHARS * _ESCAPED) + 4096
# The largest legal reply: a task (`get`) whose every step holds the largest result and error,
# with the largest spec. A bigger one is a bug: answered 500, never sent.
MAX_REPLY_BYTES = MAX_STEPS * (RESULT_LIMIT_BYTES + _ERROR_CHARS * _ESCAPED) + 2 * SPEC_MAX_BYTES + (64 << 10)
# Replies being written to their callers, all tenants together, and a namespace's half: a reply
# over SMALL_REPLY_BYTES (a read: `get`, `claim_attempt`, a `begin_step` holding a large result;
# each may be asked again) that does not fit is answered 503 instead. With the replies under it,
# bounded by the connections, the endpoint's reply memory stays under 128 MiB.
REPLY_BUDGET_BYTES = 64 << 20
SMALL_REPLY_BYTES = 64 << 10
# Calls admitted at once, all tenants together, running or waiting for a ledger thread (a database
# connection; `FairSlots` hands them out in turn by namespace); past it, 503 at once (the worker
# retries). Each holds its body, and then its reply, in memory.
MAX_CONCURRENT_REQUESTS = 128
LEDGER_THREADS = 8  # the endpoint's Ledger has as many connections (retex.operator.handlers)
REVIEW_THREADS = 4  # TokenReviews at once: what an unknown token can cost the API server
MAX_PENDING_REVIEWS = 64  # tokens waiting for a review; past it, 503 at once
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_ADDRESS = 256  # a pod's address: every worker of a node shares none
# A request's headers must be in within HEADER_SECONDS of its connection (or of the previous reply
# on it); its body, its handling and its reply within REQUEST_SECONDS more: 30 s in all, below the
# worker's read timeout (retex.worker.ledger_client). Idle kept-alive connections close as late.
HEADER_SECONDS = 10.0
REQUEST_SECONDS = 20.0
# A pod runs one attempt, and a worker makes one call at a time, three or four per step: the burst
# holds every call of an attempt of 64 steps however fast they come (a task of no-op steps makes
# about 350 a second), and past it the rate is what a worker waiting on a step's deadline needs;
# together they hold a step's own code, flooding with its pod's token, to 20 calls a second. A
# namespace may have half the admitted calls (the rest stay for the others); its rate
# stops only a flood; the ledger threads themselves are shared in turn (`FairSlots`), so a namespace
# alone may use them all and a busy one cannot crowd out another.
PER_POD = Quota(rate=20.0, burst=300, concurrent=2)
PER_NAMESPACE = Quota(rate=20000.0, burst=40000, concurrent=MAX_CONCURRENT_REQUESTS // 2)


@dataclass(frozen=True)
class EndpointLimits:
    per_pod: Quota = PER_POD
    per_namespace: Quota = PER_NAMESPACE
    max_concurrent: int = MAX_CONCURRENT_REQUESTS
    max_connections: int = MAX_CONNECTIONS
    max_connections_per_address: int = MAX_CONNECTIONS_PER_ADDRESS
    header_seconds: float = HEADER_SECONDS
    request_seconds: float = REQUEST_SECONDS
    reply_budget_bytes: int = REPLY_BUDGET_BYTES


class Refusal(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# What each argument of a request must be; a request with anything else is refused (400) before
# it reaches the ledger, so a missing `result` never commits null and a stray key is no option.
_ARGUMENTS: dict[str, Callable[[Any], bool]] = {
    "idx": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "node": lambda v: v is None or isinstance(v, str),
    "begun_at": lambda v: v is None or isinstance(v, str),
    "after_seconds": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e7,
    "result": lambda v: True,
    "error": lambda v: isinstance(v, str),
    "retryable": lambda v: isinstance(v, bool),
    "why": lambda v: isinstance(v, str),
    "request": lambda v: isinstance(v, str) and 0 < len(v) <= 64,
}
# A worker of the release before request ids sends none: it is served as before.
_OPTIONAL = frozenset({"request"})


def parse_request(operation: str, body: dict[str, Any]) -> dict[str, Any]:
    """The Ledger method's keyword arguments from a request body, strictly; Refusal(400) else."""
    expected = set(OPERATIONS[operation]) | {"uid"} | (set() if operation in UNFENCED else {"epoch"})
    if not expected - _OPTIONAL <= set(body) <= expected:
        raise Refusal(400, f"{operation} takes exactly {sorted(expected)}, got {sorted(body)}")
    kwargs = {name: body[name] for name in OPERATIONS[operation] if name in body}
    for name, value in kwargs.items():
        if not _ARGUMENTS[name](value):
            raise Refusal(400, f"{operation}: {name}={value!r} is not valid")
    if "begun_at" in kwargs:
        try:
            kwargs["begun_at"] = time_from_json(kwargs["begun_at"])
        except ValueError:
            raise Refusal(400, f"{operation}: begun_at is not an ISO time") from None
    return kwargs


class LedgerEndpoint:
    """Authorises a call and runs it; the HTTP plumbing is `serve`."""

    def __init__(self, ledger: Ledger, identities: WorkerIdentities):
        self._ledger = ledger
        self._identities = identities
        # (pod, task, epoch) already checked against the ledger: a task's namespace and name never
        # change. Bounded: cleared when full (a re-check costs one read).
        self._verified: set[WorkerIdentity] = set()
        self._lock = threading.Lock()

    def cached_identity(self, token: str) -> WorkerIdentity | None:
        """The token's pod if known without a TokenReview; None if only a review can tell. Cheap:
        runs on the event loop. Refusal(401) for a token refused before, or no ledger token."""
        try:
            return self._identities.cached(token)
        except NotAWorker as exc:
            raise Refusal(401, str(exc)) from None

    def identify(self, token: str) -> WorkerIdentity:
        """The token's pod, through a TokenReview if need be (blocking)."""
        try:
            return self._identities.resolve(token)
        except NotAWorker as exc:
            raise Refusal(401, str(exc)) from None
        except IdentityUnavailable as exc:
            raise Refusal(503, str(exc)) from None

    def call(self, operation: str, identity: WorkerIdentity, body: dict[str, Any]) -> Any:
        """Run `operation` for the attempt `identity` runs (blocking: the ledger's transaction)."""
        if operation not in OPERATIONS:
            raise Refusal(404, f"no operation {operation!r}")
        self._authorise(identity, operation, body)
        kwargs = parse_request(operation, body)
        method = getattr(self._ledger, operation)
        if operation in UNFENCED:
            return to_json(method(identity.task_uid, **kwargs))
        if operation == "claim_attempt":
            return to_json(method(identity.task_uid, identity.epoch, pod=identity.pod, **kwargs))
        return to_json(method(identity.task_uid, identity.epoch, actor=f"worker:{identity.pod}", **kwargs))

    def _authorise(self, identity: WorkerIdentity, operation: str, body: dict[str, Any]) -> None:
        if body.get("uid") != identity.task_uid or (operation not in UNFENCED and body.get("epoch") != identity.epoch):
            raise Refusal(403, f"pod {identity.namespace}/{identity.pod} runs attempt {identity.epoch} of task "
                               f"{identity.task_uid}; it may not act for task {body.get('uid')} epoch {body.get('epoch')}")
        with self._lock:
            if identity in self._verified:
                return
        record = self._ledger.get(identity.task_uid)  # TaskNotFound: 409, the worker exits as stale
        if record.namespace != identity.namespace or identity.job_name not in self._job_names(record, identity.epoch):
            # Says nothing of the task itself: a caller may name any uid.
            raise Refusal(403, f"pod {identity.namespace}/{identity.pod} (Job {identity.job_name}) is not a worker "
                               f"of task {identity.task_uid}")
        with self._lock:
            if len(self._verified) >= _VERIFIED_LIMIT:
                self._verified.clear()
            self._verified.add(identity)

    def _job_names(self, record: TaskRecord, epoch: int) -> set[str]:
        """The names the attempt's Job may have: the one this operator builds, and the one the
        relay recorded when it sent the attempt (a Job made by an earlier release, whose names
        were longer, keeps its name through an upgrade)."""
        names = {job_name(record.name, record.uid, epoch)}
        names.update(a.job_name for a in self._ledger.attempts(record.uid) if a.epoch == epoch and a.job_name)
        return names


_VERIFIED_LIMIT = 10_000


@dataclass(frozen=True)
class LedgerTls:
    """The endpoint's serving certificate and key (PEM files, e.g. a kubernetes.io/tls Secret
    mounted), and the CA that signed it, which workers are handed to verify it."""

    cert_file: str
    key_file: str
    ca_file: str

    def ca_pem(self) -> str:
        return open(self.ca_file).read()


class _ServingContext:
    """An SSLContext whose certificate is loaded again when its files change."""

    def __init__(self, tls: LedgerTls):
        self._tls = tls
        self._lock = threading.Lock()
        self._loaded: tuple[float, float] | None = None
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.refresh()

    def refresh(self) -> None:
        stamp = (os.stat(self._tls.cert_file).st_mtime, os.stat(self._tls.key_file).st_mtime)
        with self._lock:
            if stamp != self._loaded:
                self.context.load_cert_chain(self._tls.cert_file, self._tls.key_file)
                self._loaded = stamp


# aiohttp's own log: a malformed request (any pod may send one) is the caller's problem, answered
# 400 by aiohttp; logged, it would let any pod fill the operator's log with tracebacks.
_PROTOCOL_LOG = logging.getLogger(f"{__name__}.protocol")
_PROTOCOL_LOG.setLevel(logging.CRITICAL)


class _CappedServer(web.Server):
    """aiohttp's connection manager, counting connections against the caps and reloading a
    rotated certificate before each handshake."""

    def __init__(self, handler: Callable[[web.BaseRequest], Any], *, connections: ConnectionCount,
                 serving: _ServingContext | None, **kwargs: Any):
        super().__init__(handler, **kwargs)
        self._count = connections
        self._serving = serving
        self._addresses: dict[RequestHandler, str] = {}

    def __call__(self) -> RequestHandler:
        # Called as a connection is accepted, before its TLS handshake.
        if self._serving is not None:
            try:
                self._serving.refresh()
            except (OSError, ssl.SSLError) as exc:  # a rotation half written: keep the loaded pair
                log_line(log, logging.WARNING, "ledger endpoint: certificate not reloaded", error=str(exc))
        return super().__call__()

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if peer else ""
        if not self._count.open(address):
            LEDGER_ENDPOINT_REFUSALS.labels(namespace="", reason="connections").inc()
            transport.abort()  # before a byte is read: the caller retries
            return
        self._addresses[handler] = address
        super().connection_made(handler, transport)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        address = self._addresses.pop(handler, None)
        if address is not None:
            self._count.close(address)
        super().connection_lost(handler, exc)


# On a reply: (namespace, bytes) it holds of the budget.
_RESERVED = web.ResponseKey("retex-reply-budget", tuple[str, int])


class _Answer(Exception):
    """A reply decided before the call runs: a refusal, with its headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}


class LedgerServer:
    """The endpoint served on its own event loop, in its own thread (`serving_thread`)."""

    def __init__(self, endpoint: LedgerEndpoint, port: int, tls: LedgerTls | None, limits: EndpointLimits):
        self._endpoint = endpoint
        self._limits = limits
        self._admission = Admission(limits.per_pod, limits.per_namespace)
        self._admitted = 0
        self._pending_reviews = 0
        self._replies = ReplyBudget(limits.reply_budget_bytes, limits.reply_budget_bytes // 2, SMALL_REPLY_BYTES)
        self._ledger_threads = concurrent.futures.ThreadPoolExecutor(LEDGER_THREADS, "ledger-endpoint-call")
        self._slots = FairSlots(LEDGER_THREADS)
        self._review_threads = concurrent.futures.ThreadPoolExecutor(REVIEW_THREADS, "ledger-endpoint-review")
        self._loop = asyncio.new_event_loop()
        serving = _ServingContext(tls) if tls is not None else None
        self.http = _CappedServer(
            self._handle, connections=ConnectionCount(limits.max_connections, limits.max_connections_per_address),
            serving=serving, loop=self._loop, keepalive_timeout=limits.header_seconds, lingering_time=0,
            max_headers=32, access_log=None, logger=_PROTOCOL_LOG)
        self._listener = self._loop.run_until_complete(self._loop.create_server(
            self.http, "0.0.0.0", port, ssl=serving.context if serving else None,
            ssl_handshake_timeout=limits.header_seconds if serving else None, backlog=512))
        self.server_address: tuple[str, int] = self._listener.sockets[0].getsockname()[:2]
        self.serving_thread = threading.Thread(target=self._loop.run_forever, name="ledger-endpoint", daemon=True)
        self.serving_thread.start()  # the readiness probe watches it

    def shutdown(self) -> None:
        """Stop accepting and drop open connections; calls in flight finish in their threads."""
        async def stop() -> None:
            self._listener.close()
            self.http.pre_shutdown()
            await self.http.shutdown(1.0)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self.serving_thread.join(timeout=10)

    def server_close(self) -> None:
        self._ledger_threads.shutdown(wait=False, cancel_futures=True)
        self._review_threads.shutdown(wait=False, cancel_futures=True)
        if not self.serving_thread.is_alive():
            self._loop.close()

    # -- one request ---------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        sending: list[web.StreamResponse] = []  # the reply once its writing has begun (`_send`)
        try:
            async with asyncio.timeout(self._limits.request_seconds):
                reply = await self._answer(request)
                try:
                    return await _send(request, reply, sending)
                finally:
                    held = reply.get(_RESERVED)
                    if held is not None:
                        self._replies.release(*held)
        except (TimeoutError, ConnectionError) as exc:
            if sending and sending[0].prepared:
                # A reader too slow for its reply, or gone: nothing more can be said on this
                # connection (its status line is out), so it is dropped, never given a 408.
                if request.transport is not None:
                    request.transport.abort()
                return sending[0]
            if isinstance(exc, ConnectionError):
                raise  # the caller left before its reply began: aiohttp drops the connection quietly
            LEDGER_ENDPOINT_REFUSALS.labels(namespace="", reason="deadline").inc()
            return _json(408, {"message": f"the request took over {self._limits.request_seconds:.0f}s"}, close=True)
        except Exception as exc:  # noqa: BLE001 - a bug answers 500 and is logged here, never by aiohttp
            log_line(log, logging.ERROR, "ledger endpoint: request failed", path=request.path, exc_info=True)
            return _json(500, {"message": f"{type(exc).__name__}: {exc}"}, close=True)

    async def _answer(self, request: web.BaseRequest) -> web.Response:
        # Cheap refusals first, before reading anything of the body: any pod of the cluster can
        # reach this port, and none may tie up the operator.
        try:
            operation, token, length = _headers_checked(request)
            identity = await self._identity(token)
            return await self._admitted_call(request, operation, identity, length)
        except _Answer as answer:
            return _json(answer.status, {"message": str(answer)}, close=True, headers=answer.headers)
        except Refusal as exc:
            if exc.status in (401, 403):
                log_line(log, logging.WARNING, "ledger endpoint refused a caller", path=request.path,
                         status=exc.status, why=str(exc))
            return _json(exc.status, {"message": str(exc)}, close=True)

    async def _identity(self, token: str) -> WorkerIdentity:
        known = self._endpoint.cached_identity(token)
        if known is not None:
            return known
        if self._pending_reviews >= MAX_PENDING_REVIEWS:
            LEDGER_ENDPOINT_REFUSALS.labels(namespace="", reason="reviews-busy").inc()
            raise _Answer(503, "the ledger endpoint is busy: try again", {"Retry-After": "1"})
        self._pending_reviews += 1
        try:
            return await asyncio.shield(self._loop.run_in_executor(self._review_threads,
                                                                   self._endpoint.identify, token))
        finally:
            self._pending_reviews -= 1

    async def _admitted_call(self, request: web.BaseRequest, operation: str, identity: WorkerIdentity,
                             length: int) -> web.Response:
        namespace, pod = identity.namespace, identity.pod
        refused = self._admission.admit(namespace, pod, self._loop.time())
        if refused is not None:
            LEDGER_ENDPOINT_REFUSALS.labels(namespace=namespace, reason=f"{refused.scope}-{refused.why}").inc()
            raise _Answer(429, f"pod {namespace}/{pod}: over its {refused.scope}'s {refused.why} limit at the "
                               f"ledger endpoint: try again", {"Retry-After": str(max(1, math.ceil(refused.retry_after)))})
        if self._admitted >= self._limits.max_concurrent:
            self._admission.release(namespace, pod)
            LEDGER_ENDPOINT_REFUSALS.labels(namespace=namespace, reason="busy").inc()
            raise _Answer(503, "the ledger endpoint is busy: try again", {"Retry-After": "1"})
        self._admitted += 1
        holders = 1  # this coroutine, and the call's thread once it has one: the slots are free when both are done

        def let_go() -> None:
            nonlocal holders
            holders -= 1
            if not holders:
                self._admitted -= 1
                self._admission.release(namespace, pod)

        try:
            body = await _body(request, length)
            await self._slots.acquire(namespace)  # a ledger thread, in its namespace's turn
            try:
                work = self._ledger_threads.submit(self._endpoint.call, operation, identity, body)
            except BaseException:
                self._slots.release()
                raise
            holders += 1

            def worked() -> None:
                self._slots.release()
                let_go()

            work.add_done_callback(lambda _: self._loop.call_soon_threadsafe(worked))
            try:
                result = await asyncio.shield(asyncio.wrap_future(work))
            except Refusal:
                raise
            except LedgerUnavailable as exc:
                return _json(503, error_to_json(exc))
            except (LedgerError, IllegalTransition) as exc:
                return _json(409, error_to_json(exc))
            except Exception as exc:  # noqa: BLE001 - a bug in one call must not kill the server
                log_line(log, logging.ERROR, "ledger endpoint: operation failed", operation=operation, exc_info=True)
                return _json(500, {"message": f"{type(exc).__name__}: {exc}"})
            return self._within_budget(namespace, _result_reply(operation, result))
        finally:
            let_go()

    def _within_budget(self, namespace: str, reply: web.Response) -> web.Response:
        """The reply, its bytes held against the budget until it is written (`_handle`); a 503
        if they do not fit."""
        size = len(reply.body) if isinstance(reply.body, bytes) else 0
        if not self._replies.reserve(namespace, size):
            LEDGER_ENDPOINT_REFUSALS.labels(namespace=namespace, reason="reply-budget").inc()
            raise _Answer(503, f"the ledger endpoint is writing as many replies as it may for namespace {namespace}: "
                               "try again", {"Retry-After": "1"})
        reply[_RESERVED] = (namespace, size)
        return reply


async def _send(request: web.BaseRequest, reply: web.Response,
                sending: list[web.StreamResponse]) -> web.StreamResponse:
    """Write `reply` (put in `sending` before its first byte); a large one a chunk at a time, each
    once the connection has taken the one before. Written whole, TLS would encrypt all of it at
    once into a buffer of its own, which holds it however slowly the caller reads and lets the
    write end at once (so the reply's place in the budget would be let go while its bytes stay in
    memory)."""
    body = reply.body
    if not isinstance(body, bytes) or len(body) <= SMALL_REPLY_BYTES:
        sending.append(reply)
        await reply.prepare(request)
        await reply.write_eof()
        return reply
    if request.transport is not None:
        request.transport.set_write_buffer_limits(high=_CHUNK_BYTES)
    stream = web.StreamResponse(status=reply.status, headers=reply.headers)
    stream.content_length = len(body)
    sending.append(stream)
    await stream.prepare(request)
    for start in range(0, len(body), _CHUNK_BYTES):
        await stream.write(body[start:start + _CHUNK_BYTES])
        await request.writer.drain()
    await stream.write_eof()
    return stream


_CHUNK_BYTES = 64 << 10


async def _body(request: web.BaseRequest, length: int) -> dict[str, Any]:
    try:
        body = json.loads(await request.content.readexactly(length))
    except asyncio.IncompleteReadError:
        raise _Answer(400, "the body ended before its Content-Length") from None
    except ValueError as exc:
        raise _Answer(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _Answer(400, "the body must be a JSON object")
    return body


def _headers_checked(request: web.BaseRequest) -> tuple[str, str, int]:
    """The operation, the bearer token and the body's length, from the request's headers alone."""
    if request.method != "POST":
        raise _Answer(405, "only POST")
    if not request.path.startswith(PATH_PREFIX):
        raise _Answer(404, f"unknown path {request.path}")
    header = request.headers.get("Authorization", "")
    token = header[len("Bearer "):].strip() if header.startswith("Bearer ") else ""
    if not token:
        raise _Answer(401, "no bearer token: workers present their projected ServiceAccount token")
    try:
        length = int(request.headers.get("Content-Length", ""))
    except ValueError:
        raise _Answer(411, "a Content-Length is required") from None
    if not 0 < length <= MAX_BODY_BYTES:
        raise _Answer(413 if length > 0 else 400, f"the body must be 1 to {MAX_BODY_BYTES} bytes")
    return request.path[len(PATH_PREFIX):], token, length


def _result_reply(operation: str, result: Any) -> web.Response:
    data = json.dumps({"result": result}).encode()
    if len(data) > MAX_REPLY_BYTES:
        log_line(log, logging.ERROR, "ledger endpoint: reply over its limit", operation=operation, size=len(data))
        return _json(500, {"message": f"the reply is {len(data)} bytes, over {MAX_REPLY_BYTES}"})
    return web.Response(status=200, body=data, content_type="application/json")


def _json(status: int, payload: dict[str, Any], *, close: bool = False,
          headers: dict[str, str] | None = None) -> web.Response:
    reply = web.Response(status=status, body=json.dumps(payload).encode(), content_type="application/json",
                         headers=headers)
    if close:
        reply.force_close()  # whatever the caller sent after this is not read
    return reply


def serve(endpoint: LedgerEndpoint, port: int, tls: LedgerTls | None, *,
          limits: EndpointLimits | None = None) -> LedgerServer:
    """Serve on `port`, over TLS unless `tls` is None (allowed only by RETEX_LEDGER_INSECURE)."""
    return LedgerServer(endpoint, port, tls, limits or EndpointLimits())
