"""docs/benchmarks.md's results table agrees with the results files `make bench` writes: each
figure of each file is a row naming its file, a row from another run is kept as written, and a
figure changed in a file makes the check fail until the table is regenerated."""

import json
import shutil

from e2e import benchpage


def test_the_pages_results_table_agrees_with_the_results_files():
    page = benchpage.PAGE.read_text()
    assert benchpage.regenerated(page) == page, "run python -m e2e.benchpage"
    for path in benchpage.RESULTS_FILES:
        for figure in json.loads(path.read_text())["figures"]:
            assert f"| {figure['measure']} | " in page and f"]({'benchmarks/' + path.name})" in page


def test_a_figure_changed_in_a_results_file_puts_the_table_out_of_date_until_regenerated(tmp_path):
    paths = tuple(tmp_path / path.name for path in benchpage.RESULTS_FILES)
    for original, copy in zip(benchpage.RESULTS_FILES, paths, strict=True):
        shutil.copy(original, copy)
    page = benchpage.regenerated(benchpage.PAGE.read_text(), paths)
    assert benchpage.regenerated(page, paths) == page
    results = json.loads(paths[0].read_text())
    results["figures"][0]["retex"] *= 2
    paths[0].write_text(json.dumps(results))
    assert benchpage.regenerated(page, paths) != page
    assert benchpage.regenerated(benchpage.regenerated(page, paths), paths) == benchpage.regenerated(page, paths)


def test_a_row_from_another_run_is_kept_after_its_measures_rows_and_a_files_stale_row_is_dropped(tmp_path):
    figure = {"measure": "m", "unit": "s", "retex": 1.0, "baseline": 2.0, "baseline_name": "b", "ratio": 0.5,
              "target": "≤ 3 s", "met": True}
    path = tmp_path / "results-rig.json"
    path.write_text(json.dumps({"cluster": {"type": "rig"}, "figures": [figure]}))
    other = "| m | kind, a run of `m` alone | 0.9 s | 2 s (b) | 0.45 | ≤ 3 s | **PASS** |"
    stale = "| gone | rig, [results-rig.json](benchmarks/results-rig.json) | 1 s | 1 s (b) | 1.00 | ≤ 3 s | **PASS** |"
    page = "\n".join(["# page", benchpage.START, *benchpage.HEADER, other, stale, benchpage.END, "after"])
    fresh = "| m | rig, [results-rig.json](benchmarks/results-rig.json) | 1 s | 2 s (b) | 0.50 | ≤ 3 s | **PASS** |"
    assert benchpage.table(page, (path,)) == [*benchpage.HEADER, fresh, other]
    assert benchpage.regenerated(page, (path,)).endswith(f"{fresh}\n{other}\n{benchpage.END}\nafter")
