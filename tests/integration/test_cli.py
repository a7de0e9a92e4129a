"""The `retex` CLI end to end: the installed console script against a real, migrated ledger."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, timedelta
from pathlib import Path

import psycopg
import pytest

from retex.ledger import Ledger
from retex.machine import StepState, TaskPhase
from tests.integration.ledger_helpers import admitted, run_all_steps

BIN = Path(sys.executable).parent  # the venv's bin: retex and kubectl-retex live next to python


def retex(dsn: str | None, *args: str, user: str = "alice", script: str = "retex") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RETEX_DATABASE_URL"} | {"USER": user, "RETEX_DATABASE_INSECURE": "1"}
    if dsn is not None:
        env["RETEX_DATABASE_URL"] = dsn
    done = subprocess.run([str(BIN / script), *args], env=env, capture_output=True, text=True, timeout=60)
    if os.environ.get("RETEX_CLI_TRANSCRIPT"):  # docs/cli.md's examples come from here
        with open(os.environ["RETEX_CLI_TRANSCRIPT"], "a") as out:
            out.write(f"$ retex {' '.join(args)}\n{done.stdout}{done.stderr}[exit {done.returncode}]\n\n")
    return done


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return done.stdout


def refused(done: subprocess.CompletedProcess, code: int = 1) -> str:
    """The clear-error contract: the exit code, one line on stderr, no traceback, nothing on stdout."""
    assert done.returncode == code, (done.stdout, done.stderr)
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("retex"), done.stderr
    return done.stderr


def dead_lettered_after_a_lost_attempt(ledger: Ledger, name: str = "order-1042") -> str:
    """charge done by attempt 1, attempt 1 lost (lease expired), ship fails on attempt 2 with the
    budget spent: dead-lettered."""
    uid = admitted(ledger, namespace="shop", name=name, max_attempts=1)
    ledger.claim_attempt(uid, 1, pod=f"{name}-1-abcde", node="node-a")
    ledger.begin_step(uid, 1, 0, actor="worker")
    ledger.commit_step(uid, 1, 0, {"charge": "ch_1", "amount": 4200}, actor="worker")
    ledger.replace_attempt(uid, 1, cause="lease-expired")
    ledger.claim_attempt(uid, 2, pod=f"{name}-2-fghij", node="node-b")
    ledger.begin_step(uid, 2, 1, actor="worker")
    ledger.fail_step(uid, 2, 1, "HTTP 503 from shipping: try later", retryable=True, actor="worker")
    assert ledger.get(uid).dead_lettered
    return uid


def flagged(ledger: Ledger, name: str) -> str:
    uid = admitted(ledger, namespace="shop", name=name)
    ledger.begin_step(uid, 1, 0, actor="worker")
    ledger.flag_step(uid, 1, 0, "charge started by attempt 1, not idempotent, no verify", actor="worker")
    return uid


def test_history_shows_admission_attempts_steps_and_errors(ledger, dsn):
    uid = dead_lettered_after_a_lost_attempt(ledger)
    text = ok(retex(dsn, "history", "order-1042", "-n", "shop"))
    assert f"Task shop/order-1042  uid {uid}" in text
    assert "Failed (RetriesExhausted), dead-lettered" in text
    for expected in ("admit", "start-attempt", "replace-attempt", "step-commit", "step-fail", "lease-expired",
                     "order-1042-1-abcde", "node-b", "HTTP 503 from shipping", '"charge":"ch_1"', "Running → Failed"):
        assert expected in text, expected
    as_json = json.loads(ok(retex(dsn, "history", "order-1042", "-n", "shop", "-o", "json")))
    assert as_json["task"]["uid"] == uid and as_json["task"]["phase"] == "Failed"
    assert [(a["cause"], a["outcome"], a["node"]) for a in as_json["attempts"]] == [
        ("first", "lost", "node-a"), ("lease-expired", "failed", "node-b")]
    assert [(s["name"], s["state"]) for s in as_json["steps"]] == [("charge", "done"), ("ship", "failed"),
                                                                   ("email", "pending")]
    events = [(h["actor"], h["event"], h["step"]) for h in as_json["history"]]
    assert events[0] == ("operator", "admit", None)
    assert ("worker", "step-commit", "charge") in events and ("worker", "step-fail", "ship") in events
    # the options may come before the command too (kubectl passes them as typed)
    assert ok(retex(dsn, "-n", "shop", "history", "order-1042")) == text
    # a uid works where a name does
    assert f"uid {uid}" in ok(retex(dsn, "history", uid))


def test_requeue_gives_a_dead_letter_a_fresh_attempt_recorded_with_the_cli_actor(ledger, dsn):
    uid = dead_lettered_after_a_lost_attempt(ledger)
    out = ok(retex(dsn, "requeue", "order-1042", "-n", "shop", user="alice"))
    assert out.startswith("requeued shop/order-1042: Running; epoch 3, failures 0/1")
    task = ledger.get(uid)
    assert (task.phase, task.epoch, task.failures, task.dead_lettered) == (TaskPhase.RUNNING, 3, 0, False)
    assert ledger.attempts(uid)[-1].cause == "requeue"
    assert [(h.actor, h.event, h.from_state, h.to_state) for h in ledger.history(uid)][-3:] == [
        ("cli:alice", "requeue", "Failed", "Pending"), ("cli:alice", "enqueue", "Pending", "Queued"),
        ("cli:alice", "start-attempt", "Queued", "Running")]
    assert "requeue" in ok(retex(dsn, "history", "order-1042", "-n", "shop"))
    assert ok(retex(dsn, "dead-letters", "-n", "shop")).strip() == "No dead-lettered tasks."


def test_resolve_mark_done_with_a_result_resumes_the_task(ledger, dsn):
    uid = flagged(ledger, "order-7")
    before = ok(retex(dsn, "history", "order-7", "-n", "shop"))
    assert "NeedsAttention (AmbiguousStep)" in before and "charge   needs-attention" in before
    out = ok(retex(dsn, "resolve", "order-7", "-n", "shop", "--step", "charge", "--mark-done",
                   "--result", '{"charge": "ch_9", "found_by": "support"}', user="bob"))
    assert out.startswith("step 'charge' marked done; shop/order-7: Running; epoch 2")
    task = ledger.get(uid)
    assert (task.phase, task.epoch) == (TaskPhase.RUNNING, 2)
    assert (task.steps[0].state, task.steps[0].result) == (StepState.DONE, {"charge": "ch_9", "found_by": "support"})
    assert ("cli:bob", "step-resolve-done") in [(h.actor, h.event) for h in ledger.history(uid)]
    after = ok(retex(dsn, "history", "order-7", "-n", "shop"))
    assert "step-resolve-done" in after and '{"charge":"ch_9","found_by":"support"}' in after
    assert ledger.attempts(uid)[-1].cause == "requeue"


def begun_earlier(dsn: str, uid: str, seconds: float) -> None:
    """The clock moves on: the task's step runs began `seconds` earlier than the ledger says."""
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE retex.steps SET started_at = started_at - make_interval(secs => %s) WHERE task_uid = %s",
                     (seconds, uid))


def test_resolve_rerun_puts_the_step_back_to_pending_and_resumes(ledger, dsn):
    uid = flagged(ledger, "order-8")
    begun_earlier(dsn, uid, 3600)  # its run is long past its deadline
    out = ok(retex(dsn, "resolve", "order-8", "-n", "shop", "--step", "charge", "--rerun", user="bob"))
    assert out.startswith("step 'charge' set to re-run; shop/order-8: Running; epoch 2")
    task = ledger.get(uid)
    assert (task.phase, task.steps[0].state, task.steps[0].result) == (TaskPhase.RUNNING, StepState.PENDING, None)
    assert ("cli:bob", "step-resolve-rerun", "needs-attention", "pending") in [
        (h.actor, h.event, h.from_state, h.to_state) for h in ledger.history(uid)]


def test_a_rerun_before_the_steps_deadline_is_refused_saying_when_it_may_be_asked(ledger, dsn):
    uid = flagged(ledger, "order-9")  # an exec step of 300 s (the default) begun just now
    message = refused(retex(dsn, "resolve", "order-9", "-n", "shop", "--step", "charge", "--rerun", user="bob"))
    rerun_from = (ledger.get(uid).steps[0].started_at + timedelta(seconds=305)).astimezone(UTC)
    assert message.startswith("retex: cannot re-run step 'charge' of shop/order-9 yet: its latest run may still land "
                              f"its effect until {rerun_from:%Y-%m-%dT%H:%M:%SZ} ("), message
    assert ledger.get(uid).steps[0].state == StepState.NEEDS_ATTENTION
    ok(retex(dsn, "resolve", "order-9", "-n", "shop", "--step", "charge", "--mark-done", user="bob"))  # no wait


def test_dead_letters_lists_exactly_the_dead_lettered_tasks(ledger, dsn):
    dead_lettered_after_a_lost_attempt(ledger, "order-1")
    disrupted = admitted(ledger, namespace="other", name="sync-9", max_disruptions=0)
    ledger.replace_attempt(disrupted, 1, cause="disruption")  # over the cap: dead-lettered
    permanent = admitted(ledger, namespace="shop", name="order-2")
    ledger.begin_step(permanent, 1, 0, actor="worker")
    ledger.fail_step(permanent, 1, 0, "HTTP 400", retryable=False, actor="worker")  # Failed, not dead-lettered
    succeeded = admitted(ledger, namespace="shop", name="order-3")
    run_all_steps(ledger, succeeded, 1)
    ledger.complete_task(succeeded, 1, actor="worker")
    flagged(ledger, "order-4")  # NeedsAttention, not a dead letter
    admitted(ledger, namespace="shop", name="order-5")  # Running

    text = ok(retex(dsn, "dead-letters", "-n", "shop"))
    assert "order-1" in text and "RetriesExhausted" in text and "HTTP 503 from shipping" in text
    assert not any(other in text for other in ("order-2", "order-3", "order-4", "order-5", "sync-9"))
    table = ok(retex(dsn, "dead-letters", "--all-namespaces"))
    assert "sync-9" in table and "DisruptionBudgetExhausted" in table and "order-1 " in table
    every = json.loads(ok(retex(dsn, "dead-letters", "-A", "-o", "json")))
    assert sorted((t["namespace"], t["name"], t["reason"]) for t in every) == [
        ("other", "sync-9", "DisruptionBudgetExhausted"), ("shop", "order-1", "RetriesExhausted")]
    assert ok(retex(dsn, "dead-letters")).strip() == "No dead-lettered tasks."  # namespace `default`


def test_dead_letters_reader_of_the_ledger(ledger):
    dead = dead_lettered_after_a_lost_attempt(ledger, "order-1")
    admitted(ledger, namespace="shop", name="order-2")
    assert [t.uid for t in ledger.dead_letters("shop")] == [dead]
    assert [t.uid for t in ledger.dead_letters()] == [dead]
    assert ledger.dead_letters("other") == []
    assert ledger.dead_lettered_uids() == {dead}  # what the status mirror's resync checks labels against


def test_errors_are_one_clear_line_with_their_exit_code(ledger, dsn):
    done = admitted(ledger, namespace="shop", name="order-done")
    run_all_steps(ledger, done, 1)
    ledger.complete_task(done, 1, actor="worker")
    waiting = flagged(ledger, "order-flagged")
    dead_lettered_after_a_lost_attempt(ledger, "order-dead")
    versions = ledger.versions()

    assert "task shop/nope not found in the ledger" in refused(retex(dsn, "history", "nope", "-n", "shop"))
    assert "task default/order-done not found" in refused(retex(dsn, "requeue", "order-done"))
    assert "cannot requeue shop/order-done: it is Succeeded; only Failed and NeedsAttention" in refused(
        retex(dsn, "requeue", "order-done", "-n", "shop"))
    message = refused(retex(dsn, "requeue", "order-flagged", "-n", "shop"))
    assert "cannot requeue shop/order-flagged: step(s) charge await a decision" in message
    assert "retex resolve order-flagged -n shop --step <step> --mark-done | --rerun" in message
    assert "--result is not valid JSON" in refused(
        retex(dsn, "resolve", "order-flagged", "-n", "shop", "--step", "charge", "--mark-done", "--result", "{nope"))
    assert "no such step (steps: charge, ship, email)" in refused(
        retex(dsn, "resolve", "order-flagged", "-n", "shop", "--step", "refund", "--rerun"))
    assert "the step is pending; only a step that needs attention can be resolved" in refused(
        retex(dsn, "resolve", "order-flagged", "-n", "shop", "--step", "ship", "--rerun"))
    assert "one of the arguments --mark-done --rerun is required" in refused(
        retex(dsn, "resolve", "order-flagged", "-n", "shop", "--step", "charge"))
    assert "--result goes with --mark-done" in refused(
        retex(dsn, "resolve", "order-dead", "-n", "shop", "--step", "ship", "--rerun", "--result", "{}"))
    assert ledger.versions() == versions  # nothing refused changed anything
    assert ledger.get(waiting).phase == TaskPhase.NEEDS_ATTENTION

    unreachable = "postgresql://retex@127.0.0.1:1/retex"
    assert "cannot reach the ledger" in refused(retex(unreachable, "dead-letters"), code=2)
    assert "cannot reach the ledger" in refused(retex(dsn, "history", "x", "--database-url", unreachable), code=2)
    # Without a DSN the CLI acts as a Kubernetes user: no kubeconfig is a clear exit 2 too.
    no_kubeconfig = refused(retex(None, "dead-letters", "--kubeconfig", "/nonexistent/kubeconfig"), code=2)
    assert "no usable kubeconfig" in no_kubeconfig and "--database-url (administrators)" in no_kubeconfig


def test_a_dsn_without_verified_tls_is_refused_unless_the_insecure_flag_is_set(ledger, dsn):
    env = {k: v for k, v in os.environ.items() if k not in ("RETEX_DATABASE_INSECURE", "PGSSLMODE")}
    done = subprocess.run([str(BIN / "retex"), "dead-letters", "--database-url", dsn], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "sslmode=verify-full" in done.stderr and "RETEX_DATABASE_INSECURE=1" in done.stderr
    assert "password" not in done.stderr  # the DSN is not echoed


def test_an_unmigrated_database_is_reported_not_migrated(postgres, dsn):
    message = refused(retex(dsn, "dead-letters"), code=2)
    assert "no retex ledger in that database" in message


def test_kubectl_plugin_and_no_kopf(ledger, dsn):  # the kubernetes client is the CLI's: it acts as a user
    dead_lettered_after_a_lost_attempt(ledger)
    assert "order-1042" in ok(retex(dsn, "dead-letters", "-n", "shop", script="kubectl-retex"))
    usage = retex(dsn, script="kubectl-retex")
    assert usage.returncode == 1 and usage.stderr.startswith("kubectl retex: error: the following arguments are required: COMMAND")
    probe = ("import sys, retex.cli.main; "
             "sys.exit('kopf' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], timeout=60).returncode == 0


@pytest.mark.skipif(not os.path.exists("/usr/bin/kubectl"), reason="kubectl not installed")
def test_kubectl_finds_the_plugin_on_path(ledger, dsn):
    dead_lettered_after_a_lost_attempt(ledger)
    env = os.environ | {"PATH": f"{BIN}:{os.environ['PATH']}", "RETEX_DATABASE_URL": dsn, "USER": "carol",
                        "RETEX_DATABASE_INSECURE": "1"}
    done = subprocess.run(["kubectl", "retex", "dead-letters", "-n", "shop"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "order-1042" in done.stdout


def test_a_task_that_exhausted_its_disruption_cap_shows_the_losses_against_the_cap_not_4_of_3(ledger, dsn):
    uid = admitted(ledger, namespace="shop", name="flaky-node", max_disruptions=3)
    for epoch in range(1, 5):  # the fourth loss is one over the cap: Failed, dead-lettered
        ledger.replace_attempt(uid, epoch, cause="disruption")
    assert (ledger.get(uid).disruptions, ledger.get(uid).reason) == (4, "DisruptionBudgetExhausted")
    text = ok(retex(dsn, "history", "flaky-node", "-n", "shop"))
    assert "disruptions 4/3" not in text
    assert "disruptions 4 (cap 3 exceeded)" in text
    table = ok(retex(dsn, "dead-letters", "-n", "shop"))
    assert "4/3" not in table and "4 (cap 3 exceeded)" in table


def test_on_the_ledger_the_namespace_is_the_kubeconfig_contexts_unless_given(ledger, dsn, tmp_path):
    """As kubectl and the user mode do: `-n`, else the current context's namespace, else `default`."""
    uid = dead_lettered_after_a_lost_attempt(ledger)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "shop",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "shop", "context": {"cluster": "c", "user": "u", "namespace": "shop"}}]}))
    assert f"uid {uid}" in ok(retex(dsn, "history", "order-1042", "--kubeconfig", str(kubeconfig)))
    assert "order-1042" in ok(retex(dsn, "dead-letters", "--kubeconfig", str(kubeconfig)))
    assert "order-1042" not in ok(retex(dsn, "dead-letters", "--kubeconfig", str(tmp_path / "none")))
    # a context that is not there, or a kubeconfig that is not YAML: said, never another namespace
    assert "no context 'shopp'" in refused(retex(dsn, "history", "order-1042", "--kubeconfig", str(kubeconfig),
                                                 "--context", "shopp"), code=2)
    (tmp_path / "broken").write_text("clusters: [")
    assert "kubeconfig" in refused(retex(dsn, "history", "order-1042", "--kubeconfig", str(tmp_path / "broken")), code=2)
