"""docs/benchmarks.md's results table, from the results files `make bench` writes.

    python -m e2e.benchpage          # rewrite the table's rows of the results files
    python -m e2e.benchpage --check  # exit 1 when the table and the files disagree

The table sits between two markers in the page. Each figure of each results file (docs/benchmarks/
results-<cluster>.json) is one row naming its file; a row naming no results file is a figure from
another run, which the page says the source of, and is kept as written, after the rows of its
measure. `tests/unit/test_bench_page.py` fails when the rows and the files disagree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from e2e.bench import CHARTS, REPO

PAGE = REPO / "docs" / "benchmarks.md"
RESULTS_FILES = (CHARTS / "results-rig.json", CHARTS / "results-kind.json")
START, END = "<!-- results table: start -->", "<!-- results table: end -->"
HEADER = ["| measure | cluster, from | retex | baseline | ratio | target | met? |",
          "|---|---|---|---|---|---|---|"]


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _met(figure: dict[str, Any]) -> str:
    if figure["target"].startswith("reported"):
        return "reported"
    return {None: "not judged", True: "**PASS**", False: "FALL SHORT"}[figure["met"]]


def source(results: dict[str, Any], path: Path) -> str:
    """A results file's cell: its cluster and a link to it."""
    return f"{results['cluster']['type']}, [{path.name}](benchmarks/{path.name})"


def row(figure: dict[str, Any], from_cell: str) -> str:
    unit = figure["unit"]
    retex = f"{_number(figure['retex'])} {unit}"
    if "retex_own_per_task" in figure.get("detail", {}):  # what the target judges: retex's side less the Job's
        retex += f" (retex's own {_number(figure['detail']['retex_own_per_task'])})"
    cells = [figure["measure"], from_cell, retex,
             f"{_number(figure['baseline'])} {unit} ({figure['baseline_name']})", f"{figure['ratio']:.2f}",
             figure["target"], _met(figure)]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def file_rows(paths: tuple[Path, ...] = RESULTS_FILES) -> list[tuple[str, str]]:
    """(measure, row) for every figure of every results file, in each file's order."""
    rows = []
    for path in paths:
        results = json.loads(path.read_text())
        rows += [(figure["measure"], row(figure, source(results, path))) for figure in results["figures"]]
    return rows


def _table_lines(page: str) -> tuple[int, int, list[str]]:
    lines = page.split("\n")
    start, end = lines.index(START), lines.index(END)
    return start, end, [line for line in lines[start + 1:end] if line.startswith("| ") and line not in HEADER]


def _is_file_row(line: str, paths: tuple[Path, ...]) -> bool:
    return any(f"]({'benchmarks/' + path.name})" in line.split(" | ")[1] for path in paths)


def table(page: str, paths: tuple[Path, ...] = RESULTS_FILES) -> list[str]:
    """The table's lines as they should be: the files' rows grouped by measure (in the first file's
    order), each measure's rows from other runs after them, then other runs' rows of measures the
    files do not have."""
    _, _, current = _table_lines(page)
    others = [line for line in current if not _is_file_row(line, paths)]
    rows = file_rows(paths)
    measures = list(dict.fromkeys(measure for measure, _ in rows))
    lines = list(HEADER)
    for measure in measures:
        lines += [line for m, line in rows if m == measure]
        lines += [line for line in others if line.split(" | ")[0] == f"| {measure}"]
    lines += [line for line in others if line.split(" | ")[0][2:] not in measures]
    return lines


def regenerated(page: str, paths: tuple[Path, ...] = RESULTS_FILES) -> str:
    start, end, _ = _table_lines(page)
    lines = page.split("\n")
    return "\n".join([*lines[:start + 1], *table(page, paths), *lines[end:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.benchpage", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only say whether the table agrees with the files")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    new = regenerated(page)
    if args.check:
        if new != page:
            print(f"{PAGE.relative_to(REPO)}: the results table disagrees with "
                  f"{', '.join(p.name for p in RESULTS_FILES)}: run python -m e2e.benchpage", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
