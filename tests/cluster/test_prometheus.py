"""The dashboard and the alert rules against a real Prometheus (Debian's `prometheus` package): it
scrapes the operator every second while tasks succeed, retry, dead-letter and lose a frozen worker,
then every query of the Grafana dashboard must return series and every alert rule must load and
evaluate. A dashboard query naming a metric the operator does not export returns nothing: fails."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from e2e.postgres import free_port
from e2e.system import wait_for
from tests.cluster.gates import exit_until_open, sleep_until_open
from tests.cluster.test_operator import apply, phase_is, sh, status
from tests.unit.test_alert_rules import RULES_FILE, rules
from tests.unit.test_dashboard import DASHBOARD

pytestmark = pytest.mark.prometheus


class Prometheus:
    """A prometheus process of its own (temp dir, free port), scraping the operator every second
    and evaluating the shipped alert rules every second."""

    def __init__(self, workdir: Path, metrics_port: int):
        binary = shutil.which("prometheus")
        assert binary, "prometheus is missing: apt-get install prometheus (as .ci/run does)"
        self.port = free_port()
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(RULES_FILE)],
                  "scrape_configs": [{"job_name": "retex-operator",
                                      "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def get(self, path: str, **params: str):
        url = f"http://127.0.0.1:{self.port}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.load(answer)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


@pytest.fixture
def prometheus(retex, tmp_path):
    server = Prometheus(tmp_path, retex.operator.metrics_port)
    try:
        wait_for(server.ready, timeout=30, what="prometheus ready")
        yield server
    finally:
        server.stop()
        print(f"--- prometheus log tail ---\n{server.log_tail()}")


def dashboard_queries() -> list[str]:
    return [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel["targets"]]


def value(prometheus: Prometheus, expr: str) -> float:
    result = prometheus.query(expr)
    return float(result[0]["value"][1]) if result else float("nan")


def test_every_dashboard_query_and_alert_rule_works_against_a_real_prometheus(retex, prometheus, gates):
    # Scraped before anything happens: an increase() needs the counters' values from before.
    wait_for(lambda: value(prometheus, "max(retex_tasks_submitted_total)") == 0, timeout=60,
             what="Prometheus scraping the operator")
    print("==> tasks: one succeeds, one retries then succeeds, one is dead-lettered, one loses a frozen worker")
    # Gates served where the pods reach this host, not files: a pod on kind sees none of this host's.
    fixed, thawed = gates(opened_now=False), gates(opened_now=False)
    apply(retex, "ok", [sh("a", "echo a"), sh("b", "echo b")])
    # Its retry waits 3 s: time for the test to open the gate the first try found closed.
    apply(retex, "flaky", [{"name": "only", "exec": {"command": exit_until_open(fixed, 7)}, "retryableExitCodes": [7]}],
          retry={"maxAttempts": 3, "backoff": {"initialSeconds": 3, "maxSeconds": 3}})
    apply(retex, "doomed", [sh("only", "exit 7", retryableExitCodes=[7])],
          retry={"maxAttempts": 2, "backoff": {"initialSeconds": 0.1, "maxSeconds": 0.2}})
    apply(retex, "frozen", [{"name": "slow", "exec": {"command": sleep_until_open(thawed)}, "idempotent": True}],
          lease={"durationSeconds": 5})
    wait_for(fixed.last_asked, timeout=60, what="flaky's first try")
    fixed.open()
    wait_for(lambda: (status(retex, "frozen").get("lease") or {}).get("holder"), timeout=60, what="frozen's lease taken")
    wait_for(thawed.last_asked, timeout=60, what="frozen's step running")
    pod = status(retex, "frozen")["lease"]["holder"].rsplit(":", 1)[0]
    # Frozen, not killed: a death the kubelet reports is replaced before the lease expires
    # (docs/operator.md); a hung worker is a silent loss, found by the lease's expiry.
    retex.rig.pause_pod(retex.namespace, pod)
    thawed.open()  # the next attempt's step ends at once
    for name, phase in (("ok", "Succeeded"), ("flaky", "Succeeded"), ("doomed", "Failed"), ("frozen", "Succeeded")):
        wait_for(lambda n=name, p=phase: phase_is(retex, n, p), timeout=120, what=f"{name} {phase}")
    assert retex.ledger.find(retex.namespace, "doomed").dead_lettered
    assert status(retex, "frozen")["attempt"] >= 2, "the frozen worker's attempt was replaced"

    print("==> Prometheus has scraped what happened")
    wait_for(lambda: value(prometheus, 'max(retex_tasks_finished_total{outcome="succeeded"})') == 3
             and value(prometheus, "max(retex_tasks_dead_lettered_total)") == 1
             and value(prometheus, 'max(retex_attempts_started_total{cause="retry"})') >= 2,
             timeout=60, what="the run's figures in Prometheus")
    # SIGSTOP leaves the Lease held but unrenewed: the reaper replaces the attempt once it expires.
    assert value(prometheus, "max(retex_lease_expiries_total)") == 1, "the frozen worker's lease expiry"

    print("==> every dashboard query returns series")
    queries = dashboard_queries()
    empty = [expr for expr in queries if not prometheus.query(expr)]
    assert not empty, f"{len(empty)} of {len(queries)} dashboard queries returned no series: {empty}"

    print("==> the alert rules load (promtool, prometheus) and evaluate; the dead letter fires")
    checked = subprocess.run(["promtool", "check", "rules", str(RULES_FILE)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    shipped = {rule["alert"] for group in rules()["groups"] for rule in group["rules"]}

    def evaluated():
        loaded = {rule["name"]: rule for group in prometheus.get("/api/v1/rules")["groups"] for rule in group["rules"]}
        return (loaded if set(loaded) == shipped and all(r["health"] == "ok" for r in loaded.values())
                and loaded["RetexTasksDeadLettered"]["state"] == "firing" else None)

    loaded = wait_for(evaluated, timeout=30, what="every shipped rule loaded and evaluated, RetexTasksDeadLettered firing")
    quiet = {name: rule["state"] for name, rule in loaded.items() if name != "RetexTasksDeadLettered"}
    assert set(quiet.values()) == {"inactive"}, quiet
