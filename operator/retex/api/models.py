"""The Task resource (retex.dev/v1alpha1) as pydantic models: the one source of the API.

Attribute docstrings become the CRD's field descriptions (`kubectl explain task.spec.steps`), the
`Field` constraints become its OpenAPI bounds, and `CEL` rules attached to a model are emitted as
`x-kubernetes-validations` next to it. Every rule that can be checked without the previous object
is also checked here, in Python, with the same message, so the operator and the CLI refuse what
the API server refuses. Transition rules (those comparing with `oldSelf`) exist only in the CRD.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from retex.machine import StepState, TaskPhase

API_VERSION: Final = "retex.dev/v1alpha1"  # a literal: the model's apiVersion is typed by it
GROUP, VERSION = API_VERSION.split("/")
KIND: Final = "Task"
PLURAL = "tasks"
SINGULAR = "task"
SHORT_NAME = "rtask"
CATEGORY = "retex"

MAX_STEPS = 64
# CEL can compare free-form JSON but not measure it, so the operator enforces this through the model.
PAYLOAD_MAX_BYTES = 64 * 1024
# The whole spec, for the same reason: http bodies and python args are free-form JSON too, and every
# byte goes to the ledger and to each attempt's worker. The API server's own limit is megabytes.
SPEC_MAX_BYTES = 256 * 1024
# The API server's limit on an object's annotations together: UTF-8 bytes of every key and value.
ANNOTATIONS_MAX_BYTES = 256 * 1024
# Room kept for the operator's own annotations (kopf's progress records and its diff base, which
# holds spec.cancel and the requeue annotation only): a Task must leave it free to be accepted.
OPERATOR_ANNOTATIONS_RESERVE_BYTES = 8 * 1024
STEP_RESULT_MAX_CHARS = 1024
ERROR_MAX_CHARS = 4096
CONDITION_MESSAGE_MAX_CHARS = 32768

DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# ASCII classes only, so Go's RE2 (API server) and Rust's regex (pydantic) agree on every string.
# The authority is a host (a name or a bracketed IPv6 literal) and an optional port 1-65535; it may
# not contain '@': credentials in a URL would be stored in the Task.
URL_PATTERN = (
    r"^https?://([-A-Za-z0-9._~%!$&'()*+,;=]+|\[[0-9A-Fa-f:.]+\])"
    r"(:(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3}))?"
    r"([/?#][!-~]*)?$"
)
HEADER_NAME_PATTERN = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$"
# CR or LF in a header value would inject headers (or a second request); NUL is refused by servers.
HEADER_VALUE_PATTERN = r"^[^\r\n\x00]*$"
CALLABLE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
KEY_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.:/]*[A-Za-z0-9])?$"
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
# metav1.Condition's type: an optional DNS-subdomain prefix and a qualified name.
CONDITION_TYPE_PATTERN = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                          r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$")
# Unanchored and case-insensitive, like CEL's `matches` with (?i).
SECRET_ENV_NAME_PATTERN = r"(?i)(PASSWORD|PASSWD|SECRET|TOKEN|API_?KEY|PRIVATE_?KEY|CREDENTIAL)"
SECRET_HEADER_PATTERN = r"(?i)^(authorization|proxy-authorization|cookie)$"

MSG_ONE_KIND = "exactly one of exec, http or python must be set"
MSG_UNIQUE_STEP_NAMES = "step names must be unique"
MSG_CANCEL_IRREVERSIBLE = "cancel cannot be undone: once true it stays true"
MSG_EXIT_CODES_EXCLUSIVE = "set retryableExitCodes or permanentExitCodes, not both"
MSG_STATUSES_EXCLUSIVE = "set retryableStatuses or permanentStatuses, not both"
MSG_EXIT_CODES_EXEC_ONLY = "retryableExitCodes and permanentExitCodes apply to exec steps only"
MSG_STATUSES_HTTP_ONLY = "retryableStatuses and permanentStatuses apply to http steps only"
MSG_SECRET_ENV_NAME = (
    "env names that look like credentials (PASSWORD, PASSWD, SECRET, TOKEN, API_KEY, PRIVATE_KEY, "
    "CREDENTIAL) take their value from a Secret (valueFrom.secretKeyRef), never a plain value: a Task "
    "is readable by anyone who can get tasks"
)
MSG_SECRET_HEADER = (
    "Authorization, Proxy-Authorization and Cookie headers are refused in headers: a Task is readable "
    "by anyone who can get tasks; put them in headersFrom with valueFrom.secretKeyRef"
)
MSG_ENV_VALUE_OR_FROM = "set value or valueFrom, not both"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
# The worker container's env var that carries one Secret key (the Job maps it by secretKeyRef).
SECRET_ENV_PREFIX = "RETEX_SECRET_"
MSG_HEADER_NAME = "header names must be HTTP tokens (letters, digits and !#$%&'*+.^_`|~-)"
MSG_HEADER_VALUE = "header values must not contain CR, LF or NUL"
MSG_BACKOFF_ORDER = "maxSeconds must be at least initialSeconds"
MSG_LEDGER_VERSION_MONOTONIC = "status.ledgerVersion never goes backwards"
MSG_PAYLOAD_TOO_LARGE = f"payload must be at most {PAYLOAD_MAX_BYTES} bytes as compact JSON"
MSG_SPEC_TOO_LARGE = (
    f"the spec must be at most {SPEC_MAX_BYTES} bytes as compact JSON, http bodies, python args and the "
    "payload included: pass large data by reference (a URL or object-store key)"
)
MSG_ANNOTATIONS_TOO_LARGE = (
    "the Task's annotations take {size} bytes (kubectl apply's last-applied-configuration holds a copy "
    "of the whole Task); at most {room} are allowed, so that the operator's own "
    f"{OPERATOR_ANNOTATIONS_RESERVE_BYTES} bytes fit within the API server's {ANNOTATIONS_MAX_BYTES}: "
    "use a smaller payload (pass large data by reference) or kubectl create/replace instead of apply"
)

# Lease timing (docs/worker.md): the worker renews every retry period, gives its lease up as lost
# at the renew deadline R (counted from the start of its last successful renewal) and has its
# running step dead within LEASE_KILL_SECONDS (K) after; the operator judges the lease expired
# only after DURATION (D) without an observed renewal. R + K < D is what makes a replaced
# attempt's step dead before its successor starts.
LEASE_KILL_SECONDS = 1
DEFAULT_LEASE_DURATION_SECONDS = 15
MSG_RENEW_DEADLINE = (
    f"renewDeadlineSeconds + {LEASE_KILL_SECONDS} s (the worker's time to kill its step) must be below "
    "durationSeconds: the step must be dead before the operator can judge the lease expired"
)


def default_renew_deadline_seconds(duration_seconds: float) -> float:
    """client-go's proportions: a 15 s lease gives up at 10 s."""
    return duration_seconds * 2 / 3


def cel(rule: str, message: str) -> dict[str, str]:
    """One CEL rule for the CRD's `x-kubernetes-validations`."""
    return {"rule": rule, "message": message}


def validations(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


class ApiModel(BaseModel):
    """camelCase on the wire, snake_case in Python, unknown fields refused.

    A field's docstring (the string under it) is its description in the CRD: retex.api.crd reads
    them when it generates the CRD, not every process at import (`use_attribute_docstrings`).
    Validators are built on a model's first use, not at import (`defer_build`): a worker validates
    one TaskSpec and never builds the status models, nor a validator of its own for each nested one."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
        defer_build=True,
    )

    def to_json(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase keys, unset optional fields omitted."""
        return self.model_dump(mode="json", exclude_none=True)


def defaulted(model: type[BaseModel]) -> Any:
    """A nested object that is always present: the API server fills in {} and then the defaults
    inside it, so `kubectl get -o yaml` shows them."""
    return Field(default_factory=model, json_schema_extra={"default": {}})


def _truncate(limit: int) -> BeforeValidator:
    def truncate(value: Any) -> Any:
        if isinstance(value, str) and len(value) > limit:
            return value[: limit - 1] + "…"
        return value

    return BeforeValidator(truncate)


DnsLabel = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN)]
Key = Annotated[str, Field(min_length=1, max_length=253, pattern=KEY_PATTERN)]
# Any JSON value, kept as written: the API server neither validates nor prunes inside it.
FreeJson = Annotated[JsonValue, WithJsonSchema({"x-kubernetes-preserve-unknown-fields": True})]
FreeJsonObject = Annotated[
    dict[str, JsonValue], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})
]
Quantity = Annotated[
    int | Annotated[str, Field(pattern=QUANTITY_PATTERN)],
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
ExitCode = Annotated[int, Field(ge=0, le=255)]
HttpStatus = Annotated[int, Field(ge=100, le=599)]


# --- spec -----------------------------------------------------------------------------------


class SecretKeySelector(ApiModel):
    """One key of a Secret in the Task's namespace. Its value never enters the Task nor the ledger:
    the Job hands it to the worker container (env from secretKeyRef), the worker to the step."""

    name: Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)]
    """The Secret's name."""
    key: Annotated[str, Field(min_length=1, max_length=253, pattern=SECRET_KEY_PATTERN)]
    """The key in the Secret's data."""

    @property
    def env_name(self) -> str:
        """The worker container's variable that holds this key (a hash: Secret names have dots)."""
        digest = hashlib.sha256(f"{self.name}/{self.key}".encode()).hexdigest()[:16].upper()
        return f"{SECRET_ENV_PREFIX}{digest}"


class ValueSource(ApiModel):
    """Where a value comes from instead of the Task: a Secret's key."""

    secret_key_ref: SecretKeySelector
    """A key of a Secret in the Task's namespace (a missing Secret keeps the worker pod from
    starting: the attempt fails at the start deadline, saying so)."""


class EnvVar(ApiModel):
    """An environment variable for the command: a plain value stored in the Task, or valueFrom a
    Secret's key (never stored in the Task nor the ledger)."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(f"has(self.valueFrom) || !self.name.matches('{SECRET_ENV_NAME_PATTERN}')", MSG_SECRET_ENV_NAME),
            cel("!has(self.valueFrom) || !has(self.value) || self.value == ''", MSG_ENV_VALUE_OR_FROM),
        )
    )

    name: Annotated[str, Field(min_length=1, max_length=128, pattern=ENV_NAME_PATTERN)]
    """Variable name. Names that look like credentials (containing PASSWORD, SECRET, TOKEN, API_KEY,
    PRIVATE_KEY, CREDENTIAL) must take their value from valueFrom."""
    value: Annotated[str, Field(max_length=4096)] = ""
    """Variable value, plain text."""
    value_from: ValueSource | None = None
    """The value from a Secret's key (valueFrom.secretKeyRef), instead of value."""

    @model_validator(mode="after")
    def _secrets_only_from_secrets(self) -> EnvVar:
        if self.value_from is not None and self.value:
            raise ValueError(MSG_ENV_VALUE_OR_FROM)
        if self.value_from is None and re.search(SECRET_ENV_NAME_PATTERN, self.name):
            raise ValueError(MSG_SECRET_ENV_NAME)
        return self


class HeaderFrom(ApiModel):
    """A request header whose value comes from a Secret's key (e.g. Authorization)."""

    name: Annotated[str, Field(min_length=1, max_length=256, pattern=HEADER_NAME_PATTERN)]
    """Header name."""
    value_from: ValueSource
    """valueFrom.secretKeyRef: the Secret's key holding the header's value."""


class ExecAction(ApiModel):
    """Run a command in the worker container. Exit code 0 is success."""

    command: Annotated[list[Annotated[str, Field(max_length=4096)]], Field(min_length=1, max_length=64)]
    """The executable and its leading arguments (not run through a shell)."""
    args: Annotated[list[Annotated[str, Field(max_length=4096)]], Field(max_length=256)] | None = None
    """Arguments appended to command."""
    env: (
        Annotated[
            list[EnvVar],
            Field(max_length=64, json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}),
        ]
        | None
    ) = None
    """Extra environment variables, unique by name. The worker also sets RETEX_IDEMPOTENCY_KEY,
    RETEX_TASK_UID, RETEX_STEP, RETEX_ATTEMPT, RETEX_PAYLOAD_FILE and RETEX_RESULTS_FILE."""


class HttpAction(ApiModel):
    """Send one HTTP request. A 2xx response is success; the worker adds an Idempotency-Key header."""

    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"]
    """HTTP method."""
    url: Annotated[str, Field(max_length=2048, pattern=URL_PATTERN)]
    """http or https URL, without user:password@ in it."""
    headers: (
        Annotated[
            dict[str, Annotated[str, Field(max_length=4096), WithJsonSchema(
                {"type": "string", "maxLength": 4096, "pattern": HEADER_VALUE_PATTERN})]],
            Field(
                max_length=64,
                json_schema_extra=validations(
                    cel(f'self.all(h, h.matches("{HEADER_NAME_PATTERN}"))', MSG_HEADER_NAME),
                    cel(f"self.all(h, !h.matches('{SECRET_HEADER_PATTERN}'))", MSG_SECRET_HEADER),
                ),
            ),
        ]
        | None
    ) = None
    """Request headers, plain text, without CR, LF or NUL in values. Authorization,
    Proxy-Authorization and Cookie are refused here: use headersFrom."""
    headers_from: (
        Annotated[
            list[HeaderFrom],
            Field(max_length=16, json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}),
        ]
        | None
    ) = None
    """Request headers whose values come from Secrets (valueFrom.secretKeyRef), unique by name:
    credentials such as Authorization. A value with CR, LF or NUL is never sent (the step fails)."""
    body: FreeJson = None
    """Request body: any JSON value, sent as JSON (a string as is). Without one, POST, PUT and PATCH
    send {idempotencyKey, taskUid, step, attempt, payload, results}."""

    @field_validator("headers")
    @classmethod
    def _header_names(cls, headers: dict[str, str] | None) -> dict[str, str] | None:
        for name in headers or {}:
            if not re.search(HEADER_NAME_PATTERN, name):
                raise ValueError(MSG_HEADER_NAME)
            if re.search(SECRET_HEADER_PATTERN, name):
                raise ValueError(MSG_SECRET_HEADER)
        for value in (headers or {}).values():
            if not re.search(HEADER_VALUE_PATTERN, value):
                raise ValueError(MSG_HEADER_VALUE)
        return headers


class PythonAction(ApiModel):
    """Call a Python function installed in the worker image."""

    callable: Annotated[str, Field(max_length=512, pattern=CALLABLE_PATTERN)]
    """The function as module.path:function, called as function(context, **args); context holds
    the payload, the idempotency key and earlier steps' results. Raising
    retex.worker.PermanentError fails the task; any other exception is retried."""
    args: FreeJsonObject | None = None
    """Keyword arguments for the function: a free-form JSON object."""


_ONE_KIND_RULE = cel(
    "(has(self.exec) ? 1 : 0) + (has(self.http) ? 1 : 0) + (has(self.python) ? 1 : 0) == 1", MSG_ONE_KIND
)


class Action(ApiModel):
    """Exactly one of exec, http or python."""

    model_config = ConfigDict(json_schema_extra=validations(_ONE_KIND_RULE))

    exec: ExecAction | None = None
    http: HttpAction | None = None
    python: PythonAction | None = None

    @model_validator(mode="after")
    def _exactly_one_kind(self) -> Action:
        if sum(kind is not None for kind in (self.exec, self.http, self.python)) != 1:
            raise ValueError(MSG_ONE_KIND)
        return self


class Step(Action):
    """One step: exactly one action (exec, http or python). Steps run in order; a committed step
    never runs again, and a resumed task continues after the last committed step."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            _ONE_KIND_RULE,
            cel("!(has(self.retryableExitCodes) && has(self.permanentExitCodes))", MSG_EXIT_CODES_EXCLUSIVE),
            cel("!(has(self.retryableStatuses) && has(self.permanentStatuses))", MSG_STATUSES_EXCLUSIVE),
            cel("has(self.exec) || !(has(self.retryableExitCodes) || has(self.permanentExitCodes))", MSG_EXIT_CODES_EXEC_ONLY),
            cel("has(self.http) || !(has(self.retryableStatuses) || has(self.permanentStatuses))", MSG_STATUSES_HTTP_ONLY),
        )
    )

    name: DnsLabel
    """Step name, unique in the task: a DNS label (lowercase letters, digits, '-'; at most 63). It is
    part of the step's idempotency key."""
    verify: Action | None = None
    """A read-only check, run when the step's outcome is unknown (its worker died, or the run gave
    no answer). Found (exec exit 0, http 2xx, python returns a value): the effect happened; the step
    is committed with that result without running again. Not found (exec exit 44, given to it as
    RETEX_NOT_FOUND_EXIT_CODE; http 404; python returns None): it did not; the step runs again.
    Anything else, after a few tries: the task stops in NeedsAttention."""
    idempotent: bool = False
    """True if running the step twice has the same effect as once. An interrupted step with no
    verify is re-run only if idempotent; otherwise the task stops in NeedsAttention for a human."""
    timeout_seconds: Annotated[int, Field(ge=1, le=86400)] = 300
    """Seconds one run of the step may take. Then it is stopped and its outcome is unknown: resolved
    like an interrupted step (verify, an idempotent re-run, or NeedsAttention). A verify of a step
    that may still be in flight runs only after its begin + timeoutSeconds + 5 s."""
    retryable_exit_codes: Annotated[list[ExitCode], Field(max_length=256)] | None = None
    """exec only: the only exit codes that are retried; any other non-zero code fails the task. By
    default every non-zero code is retried. For a step that is not idempotent, a code named in
    neither list is an unknown outcome (the effect may have happened): verify, else NeedsAttention."""
    permanent_exit_codes: Annotated[list[ExitCode], Field(max_length=256)] | None = None
    """exec only: exit codes that fail the task at once; any other non-zero code is retried (for a
    step that is not idempotent: unknown, as for retryableExitCodes)."""
    retryable_statuses: Annotated[list[HttpStatus], Field(max_length=256)] | None = None
    """http only: the only non-2xx statuses that are retried; any other fails the task. By default
    408, 425, 429 and 5xx are retried, other statuses fail the task. For a step that is not
    idempotent, a 408, 425, 429 or 5xx named in neither list is an unknown outcome (a gateway may
    answer 504 after the upstream acted): verify, else NeedsAttention."""
    permanent_statuses: Annotated[list[HttpStatus], Field(max_length=256)] | None = None
    """http only: statuses that fail the task at once; any other non-2xx status is retried (for a
    step that is not idempotent, a 408, 425, 429 or 5xx not listed is unknown)."""

    @model_validator(mode="after")
    def _classification_fits_kind(self) -> Step:
        if self.retryable_exit_codes is not None and self.permanent_exit_codes is not None:
            raise ValueError(MSG_EXIT_CODES_EXCLUSIVE)
        if self.retryable_statuses is not None and self.permanent_statuses is not None:
            raise ValueError(MSG_STATUSES_EXCLUSIVE)
        if self.exec is None and (self.retryable_exit_codes is not None or self.permanent_exit_codes is not None):
            raise ValueError(MSG_EXIT_CODES_EXEC_ONLY)
        if self.http is None and (self.retryable_statuses is not None or self.permanent_statuses is not None):
            raise ValueError(MSG_STATUSES_HTTP_ONLY)
        return self


class Backoff(ApiModel):
    """Exponential backoff between attempts: initialSeconds * factor^(n-1), capped at maxSeconds."""

    # has(): the API server also checks the rule against the CRD's `default: {}`, before defaulting.
    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!has(self.initialSeconds) || !has(self.maxSeconds) || self.maxSeconds >= self.initialSeconds",
                MSG_BACKOFF_ORDER,
            )
        )
    )

    initial_seconds: Annotated[float, Field(ge=0.1, le=3600)] = 1
    """Delay before the first retry (before jitter)."""
    max_seconds: Annotated[float, Field(ge=0.1, le=86400)] = 300
    """Cap on the delay."""
    factor: Annotated[float, Field(ge=1, le=10)] = 2
    """Growth per retry."""

    @model_validator(mode="after")
    def _max_not_below_initial(self) -> Backoff:
        if self.max_seconds < self.initial_seconds:
            raise ValueError(MSG_BACKOFF_ORDER)
        return self


class RetryPolicy(ApiModel):
    """How failed attempts are retried. Disruptions (eviction, preemption, node loss, a lost lease)
    are not failures and have their own budget."""

    max_attempts: Annotated[int, Field(ge=1, le=100)] = 3
    """Attempts that may end in a retryable failure, the first included; then the task fails."""
    max_disruptions: Annotated[int, Field(ge=0, le=1000)] = 10
    """Attempts that may be lost to disruptions; then the task fails."""
    backoff: Backoff = defaulted(Backoff)
    """Delay between a failed attempt and the next."""
    jitter: Literal["Full", "None"] = "Full"
    """Full: wait a random time between 0 and the backoff delay (spreads retries). None: wait exactly."""



class LeasePolicy(ApiModel):
    """The worker's liveness lease (a coordination.k8s.io Lease it renews)."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!has(self.renewDeadlineSeconds) || self.renewDeadlineSeconds + "
                f"{LEASE_KILL_SECONDS} < (has(self.durationSeconds) ? self.durationSeconds : "
                f"{DEFAULT_LEASE_DURATION_SECONDS})",
                MSG_RENEW_DEADLINE,
            )
        )
    )

    duration_seconds: Annotated[int, Field(ge=5, le=600)] = DEFAULT_LEASE_DURATION_SECONDS
    """An attempt whose lease the operator has not seen renewed for this long is treated as lost and
    replaced by a new attempt. Shorter detects loss sooner; longer tolerates slow API servers."""
    renew_deadline_seconds: Annotated[int, Field(ge=2, le=598)] | None = None
    """How long the worker keeps retrying a failing renewal before it treats the lease as lost: it
    then kills the running step (which stays unrecorded for the next attempt to resolve) and exits.
    Default: two thirds of durationSeconds. Must leave 1 s (the time to kill the step) below
    durationSeconds."""

    @model_validator(mode="after")
    def _renew_deadline_inside_duration(self) -> LeasePolicy:
        if self.renew_deadline_seconds is not None and \
                self.renew_deadline_seconds + LEASE_KILL_SECONDS >= self.duration_seconds:
            raise ValueError(MSG_RENEW_DEADLINE)
        return self


class ResourceRequirements(ApiModel):
    """Compute resources of the worker container, as in a Pod."""

    requests: Annotated[dict[str, Quantity], Field(max_length=16)] | None = None
    """Minimum resources, e.g. cpu: 100m, memory: 128Mi."""
    limits: Annotated[dict[str, Quantity], Field(max_length=16)] | None = None
    """Maximum resources."""


class Toleration(ApiModel):
    """A Pod toleration (core/v1 Toleration)."""

    key: Annotated[str, Field(max_length=316)] | None = None
    """Taint key; empty with operator Exists matches every taint."""
    operator: Literal["Exists", "Equal"] | None = None
    """Exists or Equal (the Pod API's default)."""
    value: Annotated[str, Field(max_length=63)] | None = None
    """Taint value for operator Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches all effects."""
    toleration_seconds: int | None = None
    """For NoExecute: how long the pod stays bound after the taint appears."""


class WorkerSpec(ApiModel):
    """The worker Pod that runs the steps: image, service account, resources and placement."""

    image: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    """Worker container image; defaults to the operator's configured worker image."""
    service_account_name: Annotated[str, Field(max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)] | None = None
    """Service account of the worker Pod: the way to give steps credentials. Defaults to the
    operator's worker service account; another one needs the retex-worker Role (get and update
    Leases) bound to it too."""
    resources: ResourceRequirements | None = None
    node_selector: Annotated[dict[str, Annotated[str, Field(max_length=63)]], Field(max_length=32)] | None = None
    """Labels a node must have to run the worker."""
    tolerations: Annotated[list[Toleration], Field(max_length=32)] | None = None
    """Taints the worker Pod tolerates."""


MUTABLE_SPEC_FIELDS = frozenset({"cancel"})


def immutable_message(field: str) -> str:
    return f"{field} cannot change once the task is created (only cancel can)"


def _spec_immutable_but_cancel(schema: dict[str, Any]) -> None:
    """One transition rule per spec field but cancel: the operator runs the spec it admitted into
    the ledger, so an edit would be accepted and silently ignored. The rules sit on the spec, not
    on the fields, because a field's own transition rule does not run when it is added or removed."""
    schema["x-kubernetes-validations"] = [
        {
            **cel(
                f"has(self.{name}) == has(oldSelf.{name}) && (!has(self.{name}) || self.{name} == oldSelf.{name})",
                immutable_message(name),
            ),
            "fieldPath": f".{name}",
        }
        for name in schema["properties"]
        if name not in MUTABLE_SPEC_FIELDS
    ]


class TaskSpec(ApiModel):
    """What to run: an ordered list of steps, and how to retry, time and place them. Only cancel
    can change once the task is created."""

    model_config = ConfigDict(json_schema_extra=_spec_immutable_but_cancel)

    steps: Annotated[
        list[Step],
        Field(
            min_length=1,
            max_length=MAX_STEPS,
            json_schema_extra={
                "x-kubernetes-list-type": "atomic",
                **validations(cel("self.all(s, self.exists_one(t, t.name == s.name))", MSG_UNIQUE_STEP_NAMES)),
            },
        ),
    ]
    """The steps, run in order (1 to 64, names unique)."""
    payload: FreeJsonObject | None = None
    """Input data for the steps: a free-form JSON object, at most 64 KiB as compact JSON (checked by
    the operator when it accepts the task; the whole spec, http bodies and python args included, at
    most 256 KiB). Pass large data by reference (a URL or object-store key)."""
    retry: RetryPolicy = defaulted(RetryPolicy)
    lease: LeasePolicy = defaulted(LeasePolicy)
    timeout_seconds: Annotated[int, Field(ge=1, le=604800)] | None = None
    """Wall-clock limit for the whole task, from its first start and across attempts; then it fails
    with reason Timeout and its worker is fenced out. Unset: no limit beyond the step timeouts."""
    not_before: AwareDatetime | None = None
    """Do not start before this time (RFC 3339, e.g. 2026-12-24T18:00:00Z)."""
    concurrency_key: Key | None = None
    """Tasks in a namespace with the same key run one at a time, oldest first (per-entity order): a
    task waits in Queued while another with the key is Running, Retrying or NeedsAttention."""
    priority: Annotated[int, Field(ge=-1000, le=1000)] = 0
    """Among its namespace's queued tasks that may run, higher priority starts first, then older (a
    concurrency key's order is by creation only). Run slots go to the namespaces in turn, whatever
    their tasks' priorities. The namespace's TaskPolicy may cap it (maxPriority)."""
    idempotency_key: Key | None = None
    """Submission de-duplication: a second task in the namespace with the same key is not run."""
    cancel: Annotated[bool, Field(json_schema_extra=validations(cel("self || !oldSelf", MSG_CANCEL_IRREVERSIBLE)))] = False
    """Set to true to cancel: a waiting task is cancelled at once, a running one at its next step
    boundary (the step in progress finishes). Cannot be set back to false."""
    worker: WorkerSpec | None = None

    @field_validator("steps")
    @classmethod
    def _unique_step_names(cls, steps: list[Step]) -> list[Step]:
        names = [step.name for step in steps]
        if len(set(names)) != len(names):
            raise ValueError(MSG_UNIQUE_STEP_NAMES)
        return steps

    @field_validator("payload")
    @classmethod
    def _payload_size(cls, payload: dict[str, Any] | None) -> dict[str, Any] | None:
        if payload is not None and payload_bytes(payload) > PAYLOAD_MAX_BYTES:
            raise ValueError(MSG_PAYLOAD_TOO_LARGE)
        return payload

    @model_validator(mode="after")
    def _spec_size(self) -> TaskSpec:
        if payload_bytes(self.as_admitted()) > SPEC_MAX_BYTES:
            raise ValueError(MSG_SPEC_TOO_LARGE)
        return self

    def as_admitted(self) -> dict[str, Any]:
        """The spec as the ledger keeps it, and as the relay compares it with the live Task: JSON
        without nulls, without `cancel` (the one field that may change after creation)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"cancel"})

    def secret_refs(self) -> list[SecretKeySelector]:
        """Every Secret key the steps (and their verify checks) name, once each, in spec order."""
        refs: dict[tuple[str, str], SecretKeySelector] = {}
        for step in self.steps:
            for action in (step, step.verify):
                if action is None:
                    continue
                sources = [var.value_from for var in (action.exec.env or []) if var.value_from] if action.exec else []
                sources += [header.value_from for header in (action.http.headers_from or [])] if action.http else []
                for source in sources:
                    ref = source.secret_key_ref
                    refs.setdefault((ref.name, ref.key), ref)
        return list(refs.values())


def annotations_bytes(annotations: dict[str, str] | None) -> int:
    """The size the API server's annotation limit counts: UTF-8 bytes of every key and value."""
    return sum(len(key.encode()) + len(value.encode()) for key, value in (annotations or {}).items())


def payload_bytes(payload: Any) -> int:
    """The size the payload limit counts: UTF-8 bytes of compact JSON."""
    return len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode())


# --- status ---------------------------------------------------------------------------------


class ConditionType(enum.StrEnum):
    ACCEPTED = "Accepted"  # the operator validated the spec and recorded it in the ledger
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    DEAD_LETTERED = "DeadLettered"  # failed for good: retry and disruption budgets spent
    NEEDS_ATTENTION = "NeedsAttention"
    COMPLETED = "Completed"  # ended for good, whatever the outcome: Succeeded, Failed, Cancelled or Refused
    LEDGER_BEHIND = "LedgerBehind"  # frozen: the ledger holds less of the task than its status showed


# What status.phase shows: the ledger's phase, or Refused for a Task the operator did not admit
# (an invalid spec, a Job the API server would refuse, a duplicate idempotencyKey): never run.
REFUSED = "Refused"
# What status.phase shows of a frozen task: the ledger holds less of it than its status showed (the
# ledger restored from a backup, failed over with commits lost); nothing runs until a human recovers it.
LEDGER_BEHIND = "LedgerBehind"


# TaskPhase's members and REFUSED, spelled out so type checkers can read them
# (tests/unit/test_api_models.py keeps the two in step). No docstring: it would become the CRD's.
class ShownPhase(enum.StrEnum):
    PENDING = TaskPhase.PENDING.value
    SCHEDULED = TaskPhase.SCHEDULED.value
    QUEUED = TaskPhase.QUEUED.value
    RUNNING = TaskPhase.RUNNING.value
    RETRYING = TaskPhase.RETRYING.value
    SUCCEEDED = TaskPhase.SUCCEEDED.value
    FAILED = TaskPhase.FAILED.value
    CANCELLED = TaskPhase.CANCELLED.value
    NEEDS_ATTENTION = TaskPhase.NEEDS_ATTENTION.value
    REFUSED = REFUSED
    LEDGER_BEHIND = LEDGER_BEHIND


class StatusModel(ApiModel):
    # Status is written by the operator; a reader of an older version must not choke on new fields.
    model_config = ConfigDict(extra="ignore")


class Condition(StatusModel):
    """A condition in the metav1.Condition shape, so `kubectl wait --for=condition=Succeeded` works."""

    # A string, not the enum: a type added later must need no CRD upgrade, and an operator
    # must read a status that a newer one wrote.
    type: Annotated[str, Field(max_length=316, pattern=CONDITION_TYPE_PATTERN)]
    """Accepted, Running, Succeeded, Failed, DeadLettered, NeedsAttention or Completed; a client
    should ignore types it does not know."""
    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    """The metadata.generation the condition was set for."""
    last_transition_time: AwareDatetime
    """When status last changed (not when reason or message did)."""
    reason: Annotated[str, Field(min_length=1, max_length=1024, pattern=CONDITION_REASON_PATTERN)]
    """CamelCase machine-readable reason."""
    message: Annotated[str, Field(max_length=CONDITION_MESSAGE_MAX_CHARS), _truncate(CONDITION_MESSAGE_MAX_CHARS)] = ""
    """Human-readable detail."""


class StepStatus(StatusModel):
    """The committed state of one step."""

    name: DnsLabel
    """The step's name."""
    state: StepState
    """pending, started, done, failed or needs-attention."""
    attempt: Annotated[int, Field(ge=0)] | None = None
    """The task attempt that last ran the step."""
    started_at: AwareDatetime | None = None
    """When the step last began."""
    finished_at: AwareDatetime | None = None
    """When the step was committed done or failed."""
    result: Annotated[str, Field(max_length=STEP_RESULT_MAX_CHARS), _truncate(STEP_RESULT_MAX_CHARS)] | None = None
    """A short summary of the result (truncated; the full result stays in the ledger)."""
    error: Annotated[str, Field(max_length=ERROR_MAX_CHARS), _truncate(ERROR_MAX_CHARS)] | None = None
    """The last error of the step (truncated)."""


class LeaseStatus(StatusModel):
    """The current attempt's lease as the operator last saw it."""

    holder: Annotated[str, Field(max_length=253)] | None = None
    """Holder identity (the worker Pod)."""
    renewed_at: AwareDatetime | None = None
    """When the operator last observed a renewal, by its own clock."""
    duration_seconds: Annotated[int, Field(ge=1)] | None = None
    """Lease duration: the attempt is lost after this long without an observed renewal."""


class TaskStatus(StatusModel):
    """A mirror of the task's committed ledger state, written only by the operator. It never runs
    ahead of the ledger and never goes backwards (ledgerVersion is monotonic)."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!has(oldSelf.ledgerVersion) || (has(self.ledgerVersion) && self.ledgerVersion >= oldSelf.ledgerVersion)",
                MSG_LEDGER_VERSION_MONOTONIC,
            )
        )
    )

    phase: ShownPhase | None = None
    """Pending, Scheduled, Queued, Running, Retrying, Succeeded, Failed, Cancelled or NeedsAttention;
    Refused when the operator did not accept the Task (see the Accepted condition); LedgerBehind when
    the ledger holds less of the task than this status showed: frozen until a human recovers it."""
    attempt: Annotated[int, Field(ge=0)] | None = None
    """The current attempt (epoch), from 1; every lost or failed attempt is replaced by the next."""
    progress: Annotated[str, Field(max_length=16, pattern=r"^[0-9]+/[0-9]+$")] | None = None
    """completedSteps/totalSteps, e.g. 2/5 (filled in from the two counts)."""
    completed_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] | None = None
    """How many leading steps are done (the contiguous completed prefix)."""
    total_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] | None = None
    """Number of steps."""
    steps: (
        Annotated[
            list[StepStatus],
            Field(max_length=MAX_STEPS,
                  json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}),
        ]
        | None
    ) = None
    """Per-step state, in step order."""
    lease: LeaseStatus | None = None
    retries: Annotated[int, Field(ge=0)] | None = None
    """Attempts that ended in a retryable failure (counted against retry.maxAttempts)."""
    disruptions: Annotated[int, Field(ge=0)] | None = None
    """Attempts lost to disruptions (counted against retry.maxDisruptions)."""
    conditions: (
        Annotated[
            list[Condition],
            Field(max_length=16, json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}),
        ]
        | None
    ) = None
    """Accepted, Running, Succeeded, Failed, DeadLettered, NeedsAttention, Completed and LedgerBehind, one of each at most."""
    ledger_version: Annotated[int, Field(ge=0)] | None = None
    """The ledger version this status mirrors; the API server refuses a status with a lower one."""
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    """The metadata.generation of the spec the operator last acted on."""
    start_time: AwareDatetime | None = None
    """When the first attempt started."""
    completion_time: AwareDatetime | None = None
    """When the task reached Succeeded, Failed or Cancelled."""
    last_error: Annotated[str, Field(max_length=ERROR_MAX_CHARS), _truncate(ERROR_MAX_CHARS)] | None = None
    """The last error of any attempt (truncated)."""

    @model_validator(mode="after")
    def _progress_from_counts(self) -> TaskStatus:
        if self.completed_steps is None or self.total_steps is None:
            return self
        if self.completed_steps > self.total_steps:
            raise ValueError("completedSteps cannot exceed totalSteps")
        expected = f"{self.completed_steps}/{self.total_steps}"
        if self.progress is None:
            self.progress = expected
        elif self.progress != expected:
            raise ValueError(f"progress {self.progress!r} disagrees with completedSteps/totalSteps ({expected})")
        return self


class Task(ApiModel):
    """A retex Task: an ordered list of steps that retex runs to completion, resuming after any
    crash, eviction or node loss without repeating a step that was already committed."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["retex.dev/v1alpha1"] = API_VERSION
    kind: Literal["Task"] = KIND
    metadata: dict[str, JsonValue] = Field(default_factory=dict)
    """Standard object metadata, owned by the API server."""
    spec: TaskSpec
    status: TaskStatus | None = None
