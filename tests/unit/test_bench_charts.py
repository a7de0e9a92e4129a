"""`make bench`'s charts: each side's distribution with its p50 and p95 marked where a figure has
its samples, each side's recorded figures where it has none, the target as a line where it puts
retex at a value, and every label whole inside the picture at the page's width."""

import random

from matplotlib.text import Text

from e2e import bench

LONG_BASELINE = "bare Job, backoffLimit 1, on the same node: pod killed → its replacement's command started"


def sampled_figure():
    rng = random.Random(7)
    retex = [rng.lognormvariate(-0.8, 0.2) for _ in range(40)]
    jobs = [rng.lognormvariate(2.3, 0.1) for _ in range(40)]
    r, b = bench.percentile(retex, 95), bench.percentile(jobs, 95)
    return {"measure": "recovery from a worker SIGKILLed mid-step, p95, a measure whose name is long enough to wrap",
            "unit": "s", "retex": r, "baseline": b, "baseline_name": LONG_BASELINE, "ratio": r / b,
            "target": "≤ 3.0 s (an observed death)", "met": True, "detail": {},
            "retex_samples": retex, "baseline_samples": jobs, "samples_unit": "", "target_at": 3.0}


def texts_of(drawn):
    drawn.canvas.draw()
    renderer, bounds = drawn.canvas.get_renderer(), drawn.bbox
    undrawn = set()  # the labels of ticks outside an axis's view: matplotlib keeps them but draws none
    for axes in drawn.axes:
        for axis in (axes.xaxis, axes.yaxis):
            low, high = sorted(axis.get_view_interval())
            undrawn |= {id(label) for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]
                        if not low <= tick.get_loc() <= high for label in (tick.label1, tick.label2)}
    texts = [t for t in drawn.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in undrawn]
    for text in texts:  # whole: nothing of it outside the picture
        box = text.get_window_extent(renderer)
        assert bounds.x0 - 1 <= box.x0 and box.x1 <= bounds.x1 + 1, (text.get_text(), box, bounds)
        assert bounds.y0 - 1 <= box.y0 and box.y1 <= bounds.y1 + 1, (text.get_text(), box, bounds)
    return [" ".join(t.get_text().split()) for t in texts]


def test_a_figure_with_samples_is_drawn_as_both_sides_distributions_with_p50_p95_and_target(tmp_path):
    figure = sampled_figure()
    drawn = bench.draw_chart(figure)
    assert drawn.get_size_inches()[0] * bench.CHART_DPI == 800
    texts = texts_of(drawn)
    assert any(LONG_BASELINE in text for text in texts), texts  # wrapped onto lines, never cut
    assert any(figure["measure"] in text for text in texts), texts
    for side in (figure["retex_samples"], figure["baseline_samples"]):
        for q in (50, 95):
            assert f"p{q} {bench.percentile(side, q):.3g}" in texts, (q, texts)
    axes = drawn.axes[0]
    assert axes.get_xscale() == "log"  # the sides are an order of magnitude apart
    assert [line.get_xdata()[0] for line in axes.get_lines() if line.get_linestyle() == "--"] == [3.0]
    assert any("target: ≤ 3.0 s" in text for text in texts)
    [path] = bench.charts({"figures": [figure]}, tmp_path)
    assert path.name == bench.chart_name(figure["measure"]) + ".png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_a_figure_of_summaries_shows_each_sides_recorded_percentiles_and_its_target():
    figure = {**sampled_figure(), "measure": "recovery from a worker SIGKILLed mid-step, p95",
              "retex_samples": [], "baseline_samples": [], "target_at": None,
              "retex": 0.47, "baseline": 10.0, "detail": {"retex_p50": 0.45, "job_p50": 9.9}}
    texts = texts_of(bench.draw_chart(figure))
    assert {"p95 0.47", "p50 0.45", "p95 10", "p50 9.9"} <= set(texts), texts
    assert any(LONG_BASELINE in text for text in texts), texts
    assert any("target: ≤ 3.0 s" in text for text in texts), texts


def test_the_target_line_is_read_from_the_target_where_the_measure_gave_none():
    def at(target, unit="s", baseline=2.0):
        return bench.target_at({"target": target, "unit": unit, "baseline": baseline})

    assert at("ratio ≤ 1.3") == 2.6
    assert at("≥ 0.8× bare Jobs", "tasks/min", 100.0) == 80.0
    assert at("retex's own (the difference) ≤ 12", "writes", 13.0) == 25.0
    assert at("≤ lease + 5 s = 15 s (a silent loss)") == 15.0
    assert at("peak ≤ 300 MB", "MB") == 300.0
    assert at("reported") is None and at("≤ 2× (commit + spawn) per step", "steps/s") is None
    assert bench.target_at({"target": "ratio ≤ 1.3", "unit": "s", "baseline": 2.0, "target_at": 0.5}) == 0.5
