"""The Grafana dashboard only queries metrics the operator exports."""

import json
import re
from pathlib import Path

from retex.ledger import Histogram, LedgerFigures
from retex.operator.dispatch import Promoter, Relay
from retex.operator.events import EventPoster
from retex.operator.loop import Loop
from retex.operator.metrics import BUCKETS, LOOPS, REGISTRY, LedgerCollector
from retex.operator.mirror import StatusMirror, StatusResync
from retex.operator.reaper import Reaper

DASHBOARD = Path(__file__).resolve().parents[2] / "manifests" / "monitoring" / "grafana-dashboard.json"


class FakeLedger:
    """Only the figures, so the collector can render every family it exports."""

    def ping(self, *, timeout):
        pass

    def figures(self):
        empty = Histogram(count=0, total=0.0, cumulative=[0] * len(BUCKETS))
        return LedgerFigures(tasks_by_phase={}, dead_lettered=0, frozen=0, outbox_lag_seconds=0.0,
                             deadline_overrun_seconds=0.0, submitted=0,
                             finished_by_phase={}, dead_lettered_ever=0, attempts_by_cause={},
                             step_seconds=empty, task_seconds=empty, first_step_seconds=empty)


def exported_sample_names() -> set[str]:
    names = set()
    for collector in (LedgerCollector(FakeLedger()), REGISTRY):
        for family in collector.collect():
            names |= {sample.name for sample in family.samples} | {family.name}
    for family in REGISTRY.collect():  # labelled counters have no samples until first used
        names |= {f"{family.name}_total", f"{family.name}_bucket", family.name}
    return names


def test_every_metric_the_dashboard_queries_is_exported():
    queried = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            queried |= set(re.findall(r"\b(retex_[a-z_]+)", target["expr"]))
    assert queried, "the dashboard queries no retex metric"
    assert queried <= exported_sample_names(), queried - exported_sample_names()


def test_histogram_buckets_span_ten_milliseconds_to_hours():
    assert BUCKETS[0] == 0.01 and BUCKETS[-1] >= 6 * 3600


def test_every_loop_exports_zero_errors_before_its_first_so_rates_over_them_are_never_empty():
    operator_loops = {loop for loop in Loop.__subclasses__() if loop.__module__.startswith("retex.")}  # not tests' own
    assert operator_loops == {Relay, Promoter, Reaper, StatusMirror, StatusResync, EventPoster}
    assert {loop.name for loop in operator_loops} <= set(LOOPS)
    samples = {(sample.name, sample.labels.get("loop")) for family in REGISTRY.collect() for sample in family.samples}
    for loop in LOOPS:
        for counter in ("retex_reconcile_errors_total", "retex_postgres_errors_total", "retex_api_errors_total"):
            assert (counter, loop) in samples, (counter, loop)
