"""Python step functions for the worker tests (imported by the step's child interpreter)."""

import os
import time

from retex.worker import PermanentError, RetryableError, StepContext


def charge(ctx: StepContext, amount: int) -> dict:
    return {"key": ctx.idempotency_key, "task": ctx.task_uid, "step": ctx.step, "attempt": ctx.attempt,
            "amount": amount, "payload": ctx.payload, "results": ctx.results}


def declined(ctx: StepContext) -> None:
    raise PermanentError("card declined")


def busy(ctx: StepContext) -> None:
    raise RetryableError("gateway busy")


def broken(ctx: StepContext) -> None:
    raise KeyError("missing")


def crash(ctx: StepContext) -> None:
    os._exit(3)


def hang(ctx: StepContext) -> None:
    time.sleep(600)


def stop_when_cancelled(ctx: StepContext) -> dict:
    ctx.cancelled.wait(600)
    return {"cancelled": ctx.cancelled.is_set()}


def give_up_when_cancelled(ctx: StepContext) -> None:
    ctx.cancelled.wait(600)
    raise RetryableError("cancelled")


def not_json(ctx: StepContext) -> object:
    return {"tags": {"a"}}


def found(ctx: StepContext) -> dict:
    return {"found": ctx.idempotency_key}


def not_found(ctx: StepContext) -> None:
    return None


def spawn_and_hang(ctx: StepContext) -> None:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.environ["PIDS"], "w") as pids:
        pids.write(f"{os.getpid()} {child.pid}")
    time.sleep(600)


def not_a_number(ctx: StepContext) -> dict:
    return {"ratio": float("nan"), "ceiling": float("inf"), "label": "a\x00b"}


def unexpected_after_effect(ctx: StepContext) -> None:
    with open(os.environ["COUNTS"], "a") as counts:
        counts.write(ctx.idempotency_key + "\n")
    raise KeyError("the effect happened, then a bug")


RATE = 0.25  # a name a Task could point its callable at by mistake
