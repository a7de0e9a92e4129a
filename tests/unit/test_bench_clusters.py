"""`make bench` on the rig or on kind, without a cluster: the markers pods send over HTTP (a pod on
kind sees no file of this host), where each cluster's results go, a measure the cluster cannot run
reported as not measured with its reason, no start on another cluster without RETEX_POD_HOST, the
gates that start checkpoint tasks together, charts named for their measures, and the operator given back its
deployed settings after a measure restarted it with one of its own."""

import subprocess
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from e2e import bench
from e2e.rig import external
from e2e.rig.external import RigUnavailable


def test_a_marker_command_records_when_it_started_on_this_hosts_clock_then_runs_the_rest(tmp_path):
    markers = bench.Markers("127.0.0.1")
    try:
        before = time.time()
        subprocess.run(markers.command("task-1", f"touch {tmp_path / 'then'}"), check=True, timeout=30)
        subprocess.run(markers.command("task-1"), check=True, timeout=30)
        after = time.time()
        starts = markers.starts("task-1")
        assert len(starts) == 2 and before <= starts[0] <= starts[1] <= after, (before, starts, after)
        assert (tmp_path / "then").exists()
        assert markers.starts("task-2") == []
    finally:
        markers.close()


def test_a_gate_command_waits_until_the_bench_opens_its_gate_and_shows_it_is_waiting():
    markers = bench.Markers("127.0.0.1")
    try:
        waiting = subprocess.Popen(markers.gate_command("task-1"))
        other = subprocess.Popen(markers.gate_command("task-2"))
        bench.wait_for("both at their gates", lambda: markers.waiting() == {"task-1", "task-2"}, timeout=30)
        markers.open_gates({"task-1"})
        assert waiting.wait(timeout=30) == 0
        time.sleep(0.5)
        assert other.poll() is None, "a gate not opened still holds"
        markers.open_gates({"task-2"})
        assert other.wait(timeout=30) == 0
    finally:
        for process in (waiting, other):
            process.kill()
        markers.close()


def test_a_marker_without_a_time_is_refused_and_not_recorded():
    markers = bench.Markers("127.0.0.1")
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{markers.url}/task-1/now", timeout=5)
        assert refused.value.code == 400 and markers.starts("task-1") == []
    finally:
        markers.close()


def test_each_clusters_results_go_beside_the_charts_and_kinds_charts_into_a_folder_of_their_own():
    assert bench.default_outputs("rig") == (bench.CHARTS / "results-rig.json", bench.CHARTS) == (bench.RESULTS, bench.CHARTS)
    results, charts = bench.default_outputs("kind")
    assert results == bench.CHARTS / "results-kind.json" and charts == bench.CHARTS / "kind"


def test_a_measure_needing_a_nemesis_the_cluster_lacks_is_reported_not_measured_with_why(monkeypatch):
    def needs_the_rig(system, sizes):
        system.rig.kill_pod("ns", "pod")

    def fails(system, sizes):
        raise RuntimeError("a real failure")

    class Cluster:
        cluster_type = "external"

        def kill_pod(self, namespace, name):
            raise RigUnavailable("kill_pod needs the local rig")

    figure = bench.Figure(measure="m", unit="s", retex=1, baseline=1, baseline_name="b", ratio=1, target="t", met=True)
    monkeypatch.setitem(bench.MEASURES, "needs-rig", needs_the_rig)
    monkeypatch.setitem(bench.MEASURES, "fine", lambda system, sizes: [figure])
    monkeypatch.setitem(bench.MEASURES, "fails", fails)
    system = SimpleNamespace(rig=Cluster())
    assert bench.measure("needs-rig", system, bench.Sizes.quick()) == (
        [], {"measure": "needs-rig", "reason": "kill_pod needs the local rig"})
    assert bench.measure("fine", system, bench.Sizes.quick()) == ([figure], None)
    with pytest.raises(RuntimeError, match="a real failure"):  # only a missing nemesis is not measured
        bench.measure("fails", system, bench.Sizes.quick())


def test_the_bench_on_another_cluster_refuses_to_start_without_where_its_pods_reach_this_host(monkeypatch, capsys):
    monkeypatch.setenv("RETEX_KUBECONFIG", "/tmp/kc")
    monkeypatch.delenv("RETEX_POD_HOST", raising=False)
    monkeypatch.setattr(external, "KindCluster", lambda path: pytest.fail("no cluster is contacted"))
    monkeypatch.setattr(external, "ExternalCluster", lambda path: pytest.fail("no cluster is contacted"))
    with pytest.raises(SystemExit) as refused:
        bench.main(["--quick"])
    assert refused.value.code == 2 and "RETEX_POD_HOST" in capsys.readouterr().err


def test_each_chart_is_named_for_its_measure_so_a_partial_run_replaces_only_its_own(tmp_path):
    def figure(measure):
        return {"measure": measure, "unit": "s", "retex": 1.0, "baseline": 2.0, "baseline_name": "bare Job",
                "ratio": 0.5, "target": "≤ 3 s", "met": True}

    full = [figure("checkpoint, 1 task(s) of 63 no-op steps"), figure("recovery from a worker SIGKILLed mid-step, p95")]
    bench.charts({"figures": full}, tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert sorted(before) == ["checkpoint-1-task-s-of-63-no-op-steps.png", "recovery-from-a-worker-sigkilled-mid-step-p95.png"]
    time.sleep(0.01)
    new = [figure("recovery from a lost node (agent and pods SIGKILLed), p95"),
           figure("recovery from a worker SIGKILLed mid-step, p95")]
    bench.charts({"figures": new}, tmp_path)
    after = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert sorted(after) == sorted([*before, "recovery-from-a-lost-node-agent-and-pods-sigkilled-p95.png"])
    assert after["checkpoint-1-task-s-of-63-no-op-steps.png"] == before["checkpoint-1-task-s-of-63-no-op-steps.png"]


def test_a_measure_that_restarts_the_operator_with_a_setting_gives_it_back_its_deployed_settings_after():
    class Operator:
        def __init__(self):
            self.calls = []

        def stop(self):
            self.calls.append("stop")

        def start(self, **env):
            self.calls.append(env)

        def wait_leading(self):
            self.calls.append("leading")

    system = object.__new__(bench.BenchSystem)  # only its operator: no cluster
    system.operator = Operator()
    with system.operator_with(RETEX_MAX_RUNNING="10"):
        during = list(system.operator.calls)
    limited = {**bench.DEPLOYED_OPERATOR_ENV, "RETEX_MAX_RUNNING": "10"}
    assert during == ["stop", limited, "leading"], "the deployed election and resync kept, the limit added"
    assert system.operator.calls[3:] == ["stop", bench.DEPLOYED_OPERATOR_ENV, "leading"], "and as deployed after"


def metrics_page(counts):
    """An API server's /metrics with apiserver_request_total samples: {(resource, verb): n}."""
    lines = ["# TYPE apiserver_request_total counter"]
    for (resource, verb), n in counts.items():
        lines.append(f'apiserver_request_total{{resource="{resource}",subresource="",verb="{verb}",code="201"}} {n}')
    return "\n".join(lines) + "\n"


def quiet_system(pages, terminating=()):
    """A BenchSystem as `_quiet_api_writes` sees it: each read of /metrics the next page (the last
    one again once they run out), namespaces Terminating while `terminating` says so, read by read."""
    reads = iter(pages)
    last = {}

    def kubectl(*args, **_):
        last["page"] = next(reads, last.get("page"))
        return SimpleNamespace(stdout=last["page"])

    phases = iter(terminating)

    def list_namespace():
        phase = "Terminating" if next(phases, False) else "Active"
        return SimpleNamespace(items=[SimpleNamespace(metadata=SimpleNamespace(name="old"), status=SimpleNamespace(phase=phase))])

    return SimpleNamespace(rig=SimpleNamespace(kubectl=kubectl), core=SimpleNamespace(list_namespace=list_namespace))


@pytest.fixture
def fake_clock(monkeypatch):
    """The bench's sleeps advance a clock of its own instead of waiting."""
    now = [0.0]
    monkeypatch.setattr(bench.time, "sleep", lambda seconds: now.__setitem__(0, now[0] + seconds))
    monkeypatch.setattr(bench.time, "monotonic", lambda: now[0])


def test_a_writes_window_opens_only_once_writes_have_stopped_leases_and_nodes_aside(fake_clock):
    pages = [metrics_page({("pods", "DELETE"): 1, ("leases", "PUT"): 1}),
             metrics_page({("pods", "DELETE"): 5, ("leases", "PUT"): 2}),  # someone's clean-up still going
             metrics_page({("pods", "DELETE"): 9, ("leases", "PUT"): 3})]
    pages += [metrics_page({("pods", "DELETE"): 9, ("leases", "PUT"): n}) for n in range(4, 100)]  # renewals only
    quiet = bench._quiet_api_writes(quiet_system(pages), 120)
    assert quiet.writes == {"pods/ DELETE": 9, "leases/ PUT": 4}
    assert quiet.waited == 3 * bench.QUIET_SECONDS


def test_a_namespace_being_deleted_keeps_the_window_closed_though_no_write_came_yet(fake_clock):
    pages = [metrics_page({("pods", "DELETE"): 1})] * 3 + [metrics_page({("pods", "DELETE"): 4})]
    seen = bench._quiet_api_writes(quiet_system(pages, terminating=[True, True]), 120)
    # Terminating at the first two looks, its pods' deletes at the third; quiet at the fourth.
    assert seen.writes == {"pods/ DELETE": 4} and seen.waited == 4 * bench.QUIET_SECONDS


def test_writes_that_never_stop_are_reported_as_such_not_waited_on_for_ever(fake_clock):
    pages = [metrics_page({("events", "POST"): n}) for n in range(1000)]
    assert bench._quiet_api_writes(quiet_system(pages), 120).waited is None


def test_writes_runs_before_the_measures_whose_jobs_would_be_deleted_in_its_windows():
    assert bench.in_run_order(["scale", "checkpoint", "writes"]) == ["writes", "checkpoint", "scale"]
    assert bench.in_run_order([])[0] == "writes" and set(bench.in_run_order([])) == set(bench.MEASURES)


def test_a_figure_whose_conditions_did_not_hold_is_printed_and_charted_as_not_judged(tmp_path):
    assert [bench.verdict(met) for met in (True, False, None)] == ["PASS", "FALL SHORT", "NOT JUDGED"]
    void = {"measure": "API server writes", "unit": "writes", "retex": 124.0, "baseline": 31.0, "baseline_name": "bare Job",
            "ratio": 4.0, "target": "≤ 12", "met": None}
    assert [p.name for p in bench.charts({"figures": [void]}, tmp_path)] == ["api-server-writes.png"]
