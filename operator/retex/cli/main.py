"""`retex` (and `kubectl retex`): history, requeue, resolve, recover and dead-letters.

Two modes. By default the CLI acts as the Kubernetes user of the kubeconfig (its current
namespace unless -n): requeue, resolve and recover are annotations on the Task, patched with the user's own
credentials and naming the user the API server authenticated (SelfSubjectReview; the policy
`retex-requested-by` refuses any other name); the operator acts on them and records that name in
the ledger's history. History and dead letters come from Task status and Events. With
--database-url (or RETEX_DATABASE_URL), for administrators, it works on the ledger directly.

Exit codes: 0 done; 1 refused (unknown task or step, illegal transition, bad input, no right to do
it); 2 nothing to talk to (no DSN or kubeconfig, Postgres or the API server unreachable, no retex
schema there). Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

import psycopg

from retex.api import LEDGER_BEHIND
from retex.cli import render
from retex.kube import humans
from retex.ledger import (
    Ledger,
    LedgerError,
    LedgerUnavailable,
    NotFrozen,
    StepInFlight,
    StepNotFound,
    TaskNotFound,
    TaskRecord,
)
from retex.ledger.tls import unverified_tls_refusal
from retex.logs import JsonLines
from retex.machine import IllegalTransition

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


class Refused(Exception):
    """Exit 1: the request was understood and refused."""


class Unreachable(Exception):
    """Exit 2: no ledger to talk to."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # usage errors are refusals too: exit 1, one line
        self.exit(1, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    logging.getLogger().addHandler(logging.NullHandler())  # no stray warnings from retries
    args = _parser().parse_args(argv)
    if args.verbose:  # the retries' lines as the operator and the worker write them, fields and all
        handler = logging.StreamHandler()
        handler.setFormatter(JsonLines())
        logging.basicConfig(level=logging.INFO, handlers=[handler])
    try:
        code: int = args.command(args)
        return code
    except Refused as exc:
        return _fail(1, str(exc))
    except (Unreachable, LedgerUnavailable, humans.NoCluster) as exc:
        return _fail(2, str(exc))
    except (humans.NotAllowed, humans.RefusedByServer, humans.TaskMissing) as exc:
        return _fail(1, str(exc))
    except TaskNotFound as exc:
        return _fail(1, str(exc))
    except LedgerError as exc:
        return _fail(1, str(exc))
    except psycopg.Error as exc:
        return _fail(2, f"ledger error: {_one_line(exc)}")
    except KeyboardInterrupt:
        return 130


# -- commands -------------------------------------------------------------------------------


def cmd_history(args: argparse.Namespace) -> int:
    if not _direct(args):
        api, namespace = _cluster(args)
        shown = humans.get_task(api, namespace, args.task)
        events = humans.task_events(api, namespace, shown["metadata"]["uid"])
        print(render.dumps({"task": shown, "events": events}) if args.output == "json"
              else render.task_status_text(shown, events))
        return 0
    with _ledger(args) as ledger:
        task = _task(ledger, args)
        attempts, history = ledger.attempts(task.uid), ledger.history(task.uid)
    if args.output == "json":
        print(render.dumps(render.history_json(task, attempts, history)))
    else:
        print(render.history_text(task, attempts, history))
    return 0


def cmd_requeue(args: argparse.Namespace) -> int:
    if not _direct(args):
        api, namespace = _cluster(args)
        user = humans.whoami(api)
        phase = (humans.get_task(api, namespace, args.task).get("status") or {}).get("phase")
        if phase not in ("Failed", "NeedsAttention"):
            raise Refused(f"cannot requeue {namespace}/{args.task}: it is {phase or 'not admitted yet'}; only Failed "
                          "and NeedsAttention tasks can be requeued")
        humans.request_requeue(api, namespace, args.task, user)
        return _requested(args, "requeue", namespace, user)
    with _ledger(args) as ledger:
        task = _task(ledger, args)
        try:
            task = ledger.requeue(task.uid, actor=actor())
        except IllegalTransition as exc:
            raise Refused(f"cannot requeue {render.ref(task)}: {_why(task, exc)}") from None
    return _done(args, f"requeued {render.summary(task)}", task)


def cmd_resolve(args: argparse.Namespace) -> int:
    if args.result is not None and not args.mark_done:
        raise Refused("--result goes with --mark-done (a re-run produces its own result)")
    result = None
    if args.result is not None:
        try:
            result = json.loads(args.result)
        except json.JSONDecodeError as exc:
            raise Refused(f"--result is not valid JSON: {exc}") from None
    if not _direct(args):
        api, namespace = _cluster(args)
        user = humans.whoami(api)
        humans.get_task(api, namespace, args.task)  # a missing Task is said before anything is written
        humans.request_resolve(api, namespace, args.task, user, step=args.step, mark_done=args.mark_done,
                               result=result)
        return _requested(args, f"resolve of step {args.step!r}", namespace, user)
    with _ledger(args) as ledger:
        task = _task(ledger, args)
        try:
            task = ledger.resolve_step(task.uid, args.step, mark_done=args.mark_done, result=result, actor=actor())
        except IllegalTransition as exc:
            raise Refused(f"cannot resolve step {args.step!r} of {render.ref(task)}: {_why(task, exc)}") from None
        except StepInFlight as exc:
            raise Refused(f"cannot re-run step {args.step!r} of {render.ref(task)} yet: {exc.why}") from None
    how = "marked done" if args.mark_done else "set to re-run"
    return _done(args, f"step {args.step!r} {how}; {render.summary(task)}", task)


def cmd_recover(args: argparse.Namespace) -> int:
    mode = "from-status" if args.from_status else "afresh"
    if not _direct(args):
        api, namespace = _cluster(args)
        user = humans.whoami(api)
        phase = (humans.get_task(api, namespace, args.task).get("status") or {}).get("phase")
        if phase != LEDGER_BEHIND:
            raise Refused(f"cannot recover {namespace}/{args.task}: it is {phase or 'not admitted yet'}; only a task "
                          f"frozen {LEDGER_BEHIND} is recovered")
        humans.request_recover(api, namespace, args.task, user, mode=mode)
        return _requested(args, f"recovery {mode}", namespace, user)
    with _ledger(args) as ledger:
        task = _task(ledger, args)
        try:
            task = ledger.recover(task.uid, from_status=args.from_status, actor=actor())
        except NotFrozen as exc:
            raise Refused(f"cannot recover {render.ref(task)}: {exc}") from None
    return _done(args, f"recovered {mode}: {render.summary(task)}", task)


def cmd_dead_letters(args: argparse.Namespace) -> int:
    if not _direct(args):
        api, namespace = _cluster(args)
        shown = humans.list_tasks(api, None if args.all_namespaces else namespace, "retex.dev/dead-letter=true")
        print(render.dumps(shown) if args.output == "json" else render.tasks_text(shown))
        return 0
    with _ledger(args) as ledger:
        tasks = ledger.dead_letters(None if args.all_namespaces else _ledger_namespace(args))
    if args.output == "json":
        print(render.dumps([{k: v for k, v in render.task_json(t).items() if k != "steps"} for t in tasks]))
    else:
        print(render.dead_letters_text(tasks))
    return 0


# -- pieces ---------------------------------------------------------------------------------


def actor() -> str:
    """`cli:<user>`: who acted, as recorded in the ledger history."""
    user = os.environ.get("USER")
    if not user:
        try:
            user = getpass.getuser()
        except (OSError, KeyError):
            user = "unknown"
    return f"cli:{user}"


def _direct(args: argparse.Namespace) -> bool:
    """The administrators' mode: a DSN given, the ledger used directly."""
    return bool(args.database_url or os.environ.get("RETEX_DATABASE_URL"))


def _ledger_namespace(args: argparse.Namespace) -> str:
    """On the ledger too: -n, else the kubeconfig context's namespace, else "default"."""
    return str(args.namespace or humans.context_namespace(args.kubeconfig, args.context))


def _cluster(args: argparse.Namespace) -> tuple[ApiClient, str]:
    """The user's API client and the namespace to act in (-n, else the kubeconfig context's)."""
    found = humans.session(args.kubeconfig, args.context)
    return found.api, args.namespace or found.namespace


def _requested(args: argparse.Namespace, what: str, namespace: str, user: str) -> int:
    if args.output == "json":
        print(render.dumps({"namespace": namespace, "task": args.task, "requested": what, "requestedBy": user}))
    else:
        print(f"{what} of {namespace}/{args.task} requested as {user}; the operator records it in the task's "
              f"history (retex history {args.task} -n {namespace})")
    return 0


class _ledger:
    """Open the ledger for one command: a quick probe first, so an unreachable database is a
    one-line error in seconds rather than the ledger's long retry window."""

    def __init__(self, args: argparse.Namespace):
        dsn = args.database_url or os.environ.get("RETEX_DATABASE_URL")
        if not dsn:
            raise Unreachable("no ledger: set RETEX_DATABASE_URL or pass --database-url")
        self.dsn: str = dsn
        self.timeout: float = args.timeout
        insecure = unverified_tls_refusal(self.dsn, os.environ)
        if insecure:
            raise Unreachable(insecure)

    def __enter__(self) -> Ledger:
        try:
            with psycopg.connect(self.dsn, connect_timeout=max(1, round(self.timeout))) as conn:
                schema = conn.execute("SELECT to_regclass('retex.tasks')").fetchone()
        except psycopg.Error as exc:
            raise Unreachable(f"cannot reach the ledger: {_one_line(exc)}") from None
        if schema is None or schema[0] is None:
            raise Unreachable("no retex ledger in that database (table retex.tasks is missing)")
        self.ledger = Ledger(self.dsn, max_connections=2, retry_for_seconds=self.timeout)
        return self.ledger.open(migrate_schema=False)

    def __exit__(self, *exc: object) -> None:
        self.ledger.close()


def _task(ledger: Ledger, args: argparse.Namespace) -> TaskRecord:
    args.namespace = _ledger_namespace(args)
    task = ledger.find(args.namespace, args.task)
    if task is None and _UID.match(args.task):
        try:
            task = ledger.get(args.task)
        except TaskNotFound:
            pass
    if task is None:
        raise Refused(f"task {args.namespace}/{args.task} not found in the ledger")
    return task


def _why(task: TaskRecord, exc: IllegalTransition) -> str:
    if exc.event.startswith("requeue before resolving"):
        steps = exc.event.removeprefix("requeue before resolving step(s) ")
        return (f"step(s) {steps} await a decision; first run "
                f"`retex resolve {task.name} -n {task.namespace} --step <step> --mark-done | --rerun`")
    if exc.event == "requeue":
        return f"it is {exc.state}; only Failed and NeedsAttention tasks can be requeued"
    if isinstance(exc, StepNotFound):
        return f"no such step (steps: {', '.join(s.name for s in task.steps)})"
    if exc.event.startswith("resolve-"):
        return f"the step is {exc.state}; only a step that needs attention can be resolved"
    return str(exc)


def _done(args: argparse.Namespace, message: str, task: TaskRecord) -> int:
    print(render.dumps(render.task_json(task)) if args.output == "json" else message)
    return 0


def _fail(code: int, message: str) -> int:
    print(f"retex: {_one_line(message)}", file=sys.stderr)
    return code


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def _parser() -> argparse.ArgumentParser:
    plugin = os.path.basename(sys.argv[0]).startswith("kubectl-")
    parser = _Parser(prog="kubectl retex" if plugin else "retex",
                     description="Inspect and act on retex tasks: as your Kubernetes user (kubeconfig), or on "
                                 "the ledger directly with --database-url (administrators).",
                     epilog="Exit codes: 0 done, 1 refused (unknown task, illegal transition, bad input), "
                            "2 ledger unreachable.")
    _common_options(parser)
    parser.set_defaults(namespace=None, output="table", database_url=None, timeout=10.0, verbose=False,
                        kubeconfig=None, context=None)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    def command(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        _common_options(sub)
        sub.set_defaults(command=fn)
        return sub

    history = command("history", cmd_history, "the task's transitions, steps and attempts")
    history.add_argument("task", help="the Task's name (or its uid)")

    requeue = command("requeue", cmd_requeue, "a fresh attempt and budget for a Failed or NeedsAttention task")
    requeue.add_argument("task", help="the Task's name (or its uid)")

    resolve = command("resolve", cmd_resolve, "decide an ambiguous step: it happened (--mark-done) or not (--rerun)")
    resolve.add_argument("task", help="the Task's name (or its uid)")
    resolve.add_argument("--step", required=True, help="the step's name")
    how = resolve.add_mutually_exclusive_group(required=True)
    how.add_argument("--mark-done", action="store_true", help="the effect happened: record the step done")
    how.add_argument("--rerun", action="store_true", help="the effect did not happen: run the step again")
    resolve.add_argument("--result", metavar="JSON", help="with --mark-done: the step's result, as JSON")

    recover = command("recover", cmd_recover, "let a task frozen LedgerBehind run again (the ledger was restored or "
                      "lost commits): rebuilt from what its status showed (--from-status) or as the ledger has it (--afresh)")
    recover.add_argument("task", help="the Task's name (or its uid)")
    whence = recover.add_mutually_exclusive_group(required=True)
    whence.add_argument("--from-status", action="store_true",
                        help="steps its status showed done stay done (their result the summary shown); one shown "
                             "started is verified or flagged, as after a crash; a task shown ended stays ended")
    whence.add_argument("--afresh", action="store_true",
                        help="the ledger's own steps stand: a step it does not hold as done runs again")

    dead = command("dead-letters", cmd_dead_letters, "Failed tasks that ran out of retries or disruptions")
    dead.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    return parser


def _common_options(parser: argparse.ArgumentParser) -> None:
    """Accepted before or after the command (kubectl passes `-n` wherever it was typed). Each
    parser gets its own actions, defaulting to SUPPRESS, so a value given after the command is
    not overwritten and one given before it is not reset; the top-level parser's set_defaults
    supplies the defaults."""
    parser.add_argument("-n", "--namespace", default=argparse.SUPPRESS,
                        help="the task's namespace (default: the kubeconfig context's, else default)")
    parser.add_argument("-o", "--output", choices=["table", "json"], default=argparse.SUPPRESS,
                        help="output format (default: table)")
    parser.add_argument("--database-url", default=argparse.SUPPRESS,
                        help="administrators: work on the ledger directly with this Postgres DSN (default: "
                             "$RETEX_DATABASE_URL; without either, the CLI acts as your Kubernetes user)")
    parser.add_argument("--kubeconfig", default=argparse.SUPPRESS, help="the kubeconfig (default: $KUBECONFIG, "
                        "~/.kube/config)")
    parser.add_argument("--context", default=argparse.SUPPRESS, help="the kubeconfig context (default: current)")
    parser.add_argument("--timeout", type=float, default=argparse.SUPPRESS,
                        help="seconds to keep trying an unreachable ledger (default: 10)")
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log retries")


if __name__ == "__main__":
    sys.exit(main())
