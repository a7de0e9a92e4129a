"""exec steps against real subprocesses: environment, output bounding, exit-code classification,
timeouts that kill the whole process group, the drain, and the verify convention."""

import dataclasses
import json
import os
import sys
import threading
import time

import pytest

from retex.api.models import SecretKeySelector
from retex.worker.outcomes import Abandoned, Failed, Found, NotFound, Succeeded, Unknown, VerifyFailed
from retex.worker.processes import TetherLost
from retex.worker.steps import exec_step
from retex.worker.supervision import step_environment
from tests.unit.worker_steps_helpers import call, drain_after, step, supervision

PY = sys.executable


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan killed here may wait for a reaper that never comes)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def run(script: str, sup=None, **step_fields):
    s = step(exec={"command": [PY, "-c", script]}, **step_fields)
    return exec_step.run(s.exec, s, call(), sup or supervision())


def verify(script: str):
    s = step(exec={"command": ["true"]}, verify={"exec": {"command": [PY, "-c", script]}})
    return exec_step.verify(s.verify.exec, s, call(), supervision())


def test_success_stores_exit_code_and_output_tails():
    outcome = run("import sys; print('charged'); print('note', file=sys.stderr)")
    assert outcome == Succeeded({"exitCode": 0, "stdout": "charged\n", "stderr": "note\n"})


def test_step_gets_key_task_step_attempt_payload_and_earlier_results():
    script = (
        "import json, os; e = os.environ; print(json.dumps({k: e[k] for k in "
        "['RETEX_IDEMPOTENCY_KEY', 'RETEX_TASK_UID', 'RETEX_STEP', 'RETEX_ATTEMPT', 'GREETING']} | "
        "{'payload': json.load(open(e['RETEX_PAYLOAD_FILE'])), 'results': json.load(open(e['RETEX_RESULTS_FILE']))}))"
    )
    s = step(exec={"command": [PY, "-c", script], "env": [{"name": "GREETING", "value": "hi"}]})
    outcome = exec_step.run(s.exec, s, call(), supervision())
    seen = json.loads(outcome.result["stdout"])
    assert seen == {"RETEX_IDEMPOTENCY_KEY": "uid-1:charge:abcd1234", "RETEX_TASK_UID": "uid-1",
                    "RETEX_STEP": "charge", "RETEX_ATTEMPT": "2", "GREETING": "hi",
                    "payload": {"amount": 42}, "results": {"reserve": {"id": "r-1"}}}


def test_the_worker_plumbing_and_failpoint_never_reach_step_code():
    env = step_environment({"PATH": os.environ["PATH"], "RETEX_LEDGER_URL": "http://retex-ledger:8081",
                            "RETEX_LEDGER_TOKEN_FILE": "/var/run/secrets/retex/ledger-token",
                            "RETEX_FAILPOINT": "after-effect", "KEEP": "1"})
    outcome = run("import os, json; print(json.dumps(sorted(os.environ)))", sup=supervision(env=env))
    names = json.loads(outcome.result["stdout"])
    assert not {"RETEX_LEDGER_URL", "RETEX_LEDGER_TOKEN_FILE", "RETEX_FAILPOINT"} & set(names) and "KEEP" in names


def test_a_step_gets_the_secret_keys_it_names_under_its_own_names_and_no_other_secret(monkeypatch):
    mine = SecretKeySelector(name="shop-api", key="token")
    other = SecretKeySelector(name="billing", key="key")
    # As the Job puts them on the worker container (env from secretKeyRef, resolved by the kubelet).
    monkeypatch.setenv(mine.env_name, "value-of-mine")
    monkeypatch.setenv(other.env_name, "value-of-other")
    script = "import os, json; print(json.dumps(dict(os.environ)))"
    s = step(exec={"command": [PY, "-c", script], "env": [
        {"name": "API_TOKEN", "valueFrom": {"secretKeyRef": {"name": "shop-api", "key": "token"}}}]})
    seen = json.loads(exec_step.run(s.exec, s, call(), supervision()).result["stdout"])
    assert seen["API_TOKEN"] == "value-of-mine"
    assert "value-of-other" not in seen.values() and not [k for k in seen if k.startswith("RETEX_SECRET_")]


def test_a_secret_the_worker_was_not_given_fails_the_step_without_running_it():
    s = step(exec={"command": ["true"], "env": [
        {"name": "API_TOKEN", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}]})
    outcome = exec_step.run(s.exec, s, call(), supervision())
    assert isinstance(outcome, Failed) and not outcome.retryable and "Secret absent key k" in outcome.error


def test_output_is_bounded_to_its_last_kibibytes():
    outcome = run("import sys\nfor i in range(20000): print(f'line {i:05d} ' + 'x' * 20)\nprint('THE END')")
    stdout = outcome.result["stdout"]
    assert outcome.result["stdoutTruncated"] is True
    assert stdout.endswith("THE END\n") and "line 00000" not in stdout
    assert len(json.dumps(stdout).encode()) <= exec_step.STDOUT_TAIL_BYTES


def test_escaped_output_still_fits_the_bound():
    outcome = run("import sys; sys.stdout.write('\\x01' * 100000)")
    assert len(json.dumps(outcome.result["stdout"]).encode()) <= exec_step.STDOUT_TAIL_BYTES


def test_non_zero_exit_of_an_idempotent_step_is_retryable_by_default_with_stderr_in_the_error():
    outcome = run("import sys; print('card declined', file=sys.stderr); sys.exit(7)", idempotent=True)
    assert isinstance(outcome, Failed) and outcome.retryable
    assert "exit code 7" in outcome.error and "card declined" in outcome.error


def test_an_undeclared_exit_code_of_a_step_that_is_not_idempotent_is_unknown_not_a_blind_retry():
    # A traceback, `set -e`, `curl ... && jq` failing after the POST: most non-zero exits come
    # after the effect may have happened.
    outcome = run("import sys; print('charged; then', file=sys.stderr); sys.exit(1)")
    assert isinstance(outcome, Unknown) and "exit code 1" in outcome.error and "charged; then" in outcome.error
    assert isinstance(run("raise SystemExit(4)", permanentExitCodes=[3]), Unknown)
    assert isinstance(run("raise SystemExit(1)", retryableExitCodes=[75]), Unknown)


def test_listed_permanent_exit_code_fails_permanently_and_others_stay_retryable():
    assert run("raise SystemExit(3)", permanentExitCodes=[3]) == Failed("exit code 3: ", retryable=False)
    assert run("raise SystemExit(4)", permanentExitCodes=[3], idempotent=True).retryable


def test_retryable_exit_codes_list_makes_every_other_code_permanent():
    assert run("raise SystemExit(75)", retryableExitCodes=[75]).retryable
    assert not run("raise SystemExit(1)", retryableExitCodes=[75], idempotent=True).retryable


def test_missing_command_is_a_permanent_failure():
    s = step(exec={"command": ["/nonexistent/charge-card"]})
    outcome = exec_step.run(s.exec, s, call(), supervision())
    assert isinstance(outcome, Failed) and not outcome.retryable


def test_killed_by_a_signal_is_an_unknown_outcome():
    outcome = run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert outcome == Unknown("killed by signal 9")


def test_timeout_kills_the_whole_process_group_and_the_outcome_is_unknown(tmp_path):
    pids = tmp_path / "pids"
    # The step starts a grandchild that ignores SIGTERM, then hangs.
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        f"open({str(pids)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    started = time.monotonic()
    outcome = run(script, timeoutSeconds=1)
    assert isinstance(outcome, Unknown) and "timed out after 1s" in outcome.error
    assert time.monotonic() - started < 5
    grandchild = int(pids.read_text())
    deadline = time.monotonic() + 2  # SIGKILL is delivered asynchronously
    while running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not running(grandchild)


def test_a_lease_lost_during_the_sigterm_grace_kills_the_step_at_once(tmp_path):
    # A step that ignores SIGTERM gets the grace after its timeout; a lease lost meanwhile must
    # not wait that out: the next attempt may start within K of the loss.
    pids = tmp_path / "pids"
    script = ("import os, signal, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              f"open({str(pids)!r}, 'w').write(str(os.getpid()))\n"
              "time.sleep(600)\n")
    s = step(exec={"command": [PY, "-c", script]}, timeoutSeconds=1)
    begun = time.monotonic()
    lost_at = begun + 1.5  # half a second into the production grace of 2 s
    sup = dataclasses.replace(supervision(), kill_grace_seconds=2.0, held=lambda: time.monotonic() < lost_at)
    outcome = exec_step.run(s.exec, s, call(begun=begun), sup)
    assert time.monotonic() - lost_at < 0.5, outcome
    assert isinstance(outcome, Abandoned) and "lease lost" in outcome.why
    # SIGKILL is delivered, not awaited: on a loaded machine the process may take a moment to die,
    # but within K (1 s, docs/crash-matrix.md) of the loss.
    pid = int(pids.read_text())
    while running(pid) and time.monotonic() < lost_at + 1.0:
        time.sleep(0.02)
    assert not running(pid)


def test_drain_lets_a_step_finish_within_the_deadline():
    sup = supervision(drain_seconds=10)
    drain_after(sup, 0.1)
    assert run("import time; time.sleep(0.5); print('done')", sup=sup) == Succeeded(
        {"exitCode": 0, "stdout": "done\n", "stderr": ""})


def test_drain_deadline_abandons_the_step_and_kills_it():
    sup = supervision(drain_seconds=0.3)
    drain_after(sup, 0.1)
    started = time.monotonic()
    outcome = run("import time; time.sleep(60)", sup=sup)
    assert isinstance(outcome, Abandoned)
    assert time.monotonic() - started < 3


def test_verify_exit_zero_is_found_with_its_output_as_the_result():
    outcome = verify("import os; print('charge', os.environ['RETEX_IDEMPOTENCY_KEY'])")
    assert outcome == Found({"exitCode": 0, "stdout": "charge uid-1:charge:abcd1234\n", "stderr": "",
                             "verified": True})


def test_verify_exit_44_is_not_found_and_the_code_is_given_to_the_verify():
    assert verify("raise SystemExit(44)") == NotFound()
    assert verify("import os; raise SystemExit(int(os.environ['RETEX_NOT_FOUND_EXIT_CODE']))") == NotFound()


def test_a_crashing_verify_is_never_read_as_not_found():
    # Exit 1 is what a traceback, a `set -e` shell or a missing variable exits with.
    assert isinstance(verify("import os; os.environ['NO_SUCH_VARIABLE']"), VerifyFailed)
    assert isinstance(verify("raise SystemExit(1)"), VerifyFailed)
    assert isinstance(verify("raise SystemExit(2)"), VerifyFailed)


def test_a_package_left_in_the_working_directory_cannot_shadow_the_worker_side_of_an_exec_step(tmp_path, monkeypatch):
    # The step's tether is a Python file of the worker's own, run isolated (-I): a `retex/` that an
    # earlier step wrote into the working directory is not imported in its place.
    (tmp_path / "retex").mkdir()
    (tmp_path / "retex" / "__init__.py").write_text("raise SystemExit(97)\n")
    monkeypatch.chdir(tmp_path)
    assert run("print('charged')") == Succeeded({"exitCode": 0, "stdout": "charged\n", "stderr": ""})


def test_the_steps_environment_cannot_put_code_into_its_tether(tmp_path):
    # The tether enforces the step's own deadline; a PYTHONPATH in the step's env (a sitecustomize
    # there) reaches the step's command, never the tether: it runs with -I -S.
    (tmp_path / "sitecustomize.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    s = step(exec={"command": ["true"], "env": [{"name": "PYTHONPATH", "value": str(tmp_path)}]})
    assert exec_step.run(s.exec, s, call(), supervision()) == Succeeded({"exitCode": 0, "stdout": "", "stderr": ""})
    assert not (tmp_path / "imported").exists()


def test_a_steps_command_starts_with_default_signal_dispositions():
    # Python ignores SIGPIPE and SIGXFSZ; a command started by the tether must not inherit that
    # (a `producer | head` would spin on EPIPE instead of ending).
    s = step(exec={"command": ["sh", "-c", "grep SigIgn /proc/self/status"]})
    ignored = int(exec_step.run(s.exec, s, call(), supervision()).result["stdout"].split()[1], 16)
    assert not ignored & (1 << (13 - 1)) and not ignored & (1 << (25 - 1)), hex(ignored)


def parent_of_step() -> int:
    s = step(exec={"command": ["sh", "-c", "grep PPid /proc/$$/status"]})
    return int(exec_step.run(s.exec, s, call(), supervision()).result["stdout"].split()[1])


def test_one_tether_starts_every_exec_step_of_a_worker_not_an_interpreter_per_step():
    # An interpreter started for each step was most of a no-op step's cost (docs/benchmarks.md).
    first, second = parent_of_step(), parent_of_step()
    assert first == second != os.getpid()


def test_a_step_whose_tether_is_lost_is_killed_and_the_next_step_gets_a_new_tether(tmp_path):
    pids = tmp_path / "pids"
    script = f"import os, time; open({str(pids)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    lost = threading.Thread(target=lambda: (wait_for_file(pids), os.kill(tether_of(int(pids.read_text())), 9)))
    lost.start()
    with pytest.raises(TetherLost):  # the attempt records it as an unknown outcome
        run(script)
    lost.join()
    step_pid = int(pids.read_text())
    deadline = time.monotonic() + 2  # SIGKILL is delivered asynchronously
    while running(step_pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not running(step_pid)
    assert run("print('next')") == Succeeded({"exitCode": 0, "stdout": "next\n", "stderr": ""})


def wait_for_file(path, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)


def tether_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("PPid:")).split()[1])


def test_a_command_is_looked_up_on_the_path_of_the_steps_own_environment(tmp_path):
    (tmp_path / "hello").write_text("#!/bin/sh\necho hello from the PATH of the step\n")
    (tmp_path / "hello").chmod(0o755)
    s = step(exec={"command": ["hello"], "env": [{"name": "PATH", "value": f"{tmp_path}:/usr/bin:/bin"}]})
    outcome = exec_step.run(s.exec, s, call(), supervision())
    assert isinstance(outcome, Succeeded), outcome
    assert outcome.result["stdout"] == "hello from the PATH of the step\n"
