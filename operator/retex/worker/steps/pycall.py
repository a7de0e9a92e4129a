"""The child interpreter of a python step: `python -m retex.worker.steps.pycall REQUEST RESPONSE`.

A child process, not a thread, so that a timeout or the drain can really stop the call (a thread
cannot be killed, and one still running could perform its effect after the worker moved on).
Reads the request JSON, imports `module:function`, calls `function(context, **args)` and writes
{"outcome": "ok" | "permanent" | "retryable" | "unexpected", "result" | "error"} atomically: no response file
means the call ended without answering (killed, crashed).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from retex.worker.context import PermanentError, RetryableError, StepContext
from retex.worker.tether import kill_group_at, tie_to

ERROR_TAIL_CHARS = 2048


def _resolve(target: str) -> Callable[..., object]:
    module_name, _, function_name = target.partition(":")
    found = getattr(importlib.import_module(module_name), function_name)
    if not callable(found):
        raise TypeError(f"{target} is {type(found).__name__}, which is not callable")
    function: Callable[..., object] = found
    return function


def _answer(request: dict[str, Any]) -> dict[str, Any]:
    context = StepContext(idempotency_key=request["idempotencyKey"], task_uid=request["taskUid"],
                          step=request["step"], attempt=request["attempt"], payload=request["payload"],
                          results=request["results"])
    # Before the import: importing the user's module runs its code and may take long.
    tie_to(request["workerPid"], on_sigterm=context.cancelled.set)
    kill_group_at(request["deadline"])
    try:
        function = _resolve(request["callable"])
    except (ImportError, AttributeError) as exc:  # the image lacks it: no retry will change that
        return {"outcome": "permanent", "error": f"cannot import {request['callable']}: {exc}"}
    except TypeError as exc:  # nothing was called, and the image will not change either
        return {"outcome": "permanent", "error": str(exc)}
    try:
        result = function(context, **request["args"])
    except PermanentError as exc:
        return {"outcome": "permanent", "error": f"{type(exc).__name__}: {exc}"}
    except RetryableError:  # declared by the step: nothing happened, try again later
        return {"outcome": "retryable", "error": f"RetryableError: {traceback.format_exc()[-ERROR_TAIL_CHARS:]}"}
    except Exception:  # undeclared: the effect may have happened before it raised
        return {"outcome": "unexpected", "error": f"unexpected: {traceback.format_exc()[-ERROR_TAIL_CHARS:]}"}
    return {"outcome": "ok", "result": result}


def main(argv: list[str]) -> int:
    request_path, response_path = argv
    with open(request_path) as request_file:
        answer = _answer(json.load(request_file))
    partial = f"{response_path}.partial"
    with open(partial, "w") as response_file:
        json.dump(answer, response_file, default=repr)  # a non-JSON result is kept as its repr
    os.replace(partial, response_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
