"""The mutant patches of `make mutants` must keep applying: a refactor that moves a mechanism
breaks its patch, and this catches it in `make test` instead of in the slow mutant run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.mutants.run import MUTANTS, PATCHES, REPO, applies, patch_of


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_every_mutant_patch_applies_to_the_tree_as_one_small_hunk_per_file(mutant):
    patch = patch_of(mutant)
    check = applies(REPO, patch)
    assert check.returncode == 0, f"{patch.name} no longer applies: {check.stderr}"
    text = patch.read_text()
    assert text.count("\n+++ ") == text.count("\n@@ "), "one hunk per file"
    assert "MUTANT" in text


def test_every_patch_belongs_to_a_mutant_and_names_tests_that_exist():
    assert {p.stem for p in PATCHES.glob("*.patch")} == {m.name for m in MUTANTS}
    for mutant in MUTANTS:
        assert mutant.tests
    ids = {t for m in MUTANTS for t in m.tests}
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                               cwd=REPO, capture_output=True, text=True)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
