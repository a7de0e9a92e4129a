"""The benchmark harness does not rot: every measure of `make bench` runs at tiny sizes and yields
figures with a baseline and a ratio, and the charts are drawn."""

import math
from collections import Counter

from e2e.bench import MEASURES, Sizes, charts, run


def test_every_bench_measure_runs_at_tiny_sizes_and_reports_retex_beside_its_baseline(rig, postgres, tmp_path):
    results = run(rig, postgres, list(MEASURES), Sizes.quick())
    # Each measure's every figure: checkpoint of 1 and of 8 tasks, latency p50 and p95, recovery from a
    # SIGKILL and from a lost node, scale's RSS, admission and status lag.
    measured = Counter(f["measure"].split(",")[0].split(" ")[0] for f in results["figures"])
    assert measured == {"checkpoint": 2, "create": 2, "throughput": 1, "recovery": 2, "profile": 1, "ledger": 1,
                        "purge": 1, "API": 1, "scale": 3, "victim's": 1}, measured
    assert any(f["measure"].startswith("recovery from a lost node") for f in results["figures"]), "node-loss measured"
    for figure in results["figures"]:
        assert figure["retex"] > 0 and figure["baseline"] > 0, figure
        assert math.isfinite(figure["ratio"]) and figure["ratio"] > 0, figure
    assert results["machine"]["cores"] and results["settings"]["recovery_lease_seconds"]
    assert results["run"]["code"] and results["run"]["started"] <= results["run"]["finished"]
    # The rig and kind (1.37) serve MutatingAdmissionPolicy: the bench runs retex as the chart installs it there.
    assert results["settings"]["finalizer_at_create"] is True
    # The rig and kind have every nemesis the measures need: nothing may go unmeasured there.
    assert results["cluster"]["type"] == rig.cluster_type and results["not_measured"] == [], results["not_measured"]
    assert len(charts(results, tmp_path)) == len(results["figures"])
