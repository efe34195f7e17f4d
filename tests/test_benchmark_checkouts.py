"""`benchmarks/checkouts.py`: two commits' paired ratios to nope, each from its own worktree."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.checkouts import ROOT, compare, markdown


def _git_ok() -> bool:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=False, capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(not _git_ok(), reason="not a git checkout")
def test_each_commit_runs_in_its_own_worktree_and_reports_a_ratio_per_round():
    results = compare(["HEAD", "HEAD"], ["alibi"], rounds=2, reps=1, n=48, d_model=32, heads=2)
    assert list(results) == ["HEAD#1", "HEAD#2"]  # a commit given twice: labelled by its place
    for rounds in results.values():
        assert len(rounds) == 2
        for r in rounds:
            assert set(r) == {"alibi"} and math.isfinite(r["alibi"]) and r["alibi"] > 0
    trees = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], check=True, capture_output=True, text=True).stdout
    assert "tree0" not in trees and "tree1" not in trees  # the worktrees are removed


def test_the_table_has_a_row_per_commit_and_every_round_in_a_cell():
    table = markdown({"abc": [{"cope": 2.5, "fire": 2.0}, {"cope": 2.25, "fire": 2.125}],
                      "def": [{"cope": 1.0, "fire": 1.5}]}, ["cope", "fire"])
    assert table.splitlines() == ["| commit | cope | fire |", "|---|---|---|",
                                  "| abc | 2.500, 2.250 | 2.000, 2.125 |", "| def | 1.000 | 1.500 |"]
