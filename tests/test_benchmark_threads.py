"""`benchmarks/threads.py` counts the operators a step may split across the intra-op threads:
those over at least ATen's grain size of elements, views and allocations left out."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.threads import GRAIN_SIZE, main, parallel_ops


def test_operators_over_the_grain_size_are_counted_by_name_and_views_are_not():
    big, small = torch.randn(2 * GRAIN_SIZE), torch.randn(GRAIN_SIZE - 1)

    def step():
        big.add_(1.0)
        big.view(2, -1).transpose(0, 1).mul(2.0)  # two views, then one large operator
        small.add_(1.0)
        small.mul(2.0).sum()  # two operators under the grain size
        big[GRAIN_SIZE:] += 1.0  # add_, then a copy_ of the view onto itself, which does no pass: not counted
        return torch.cat((big, small))  # large: its output holds both

    large, n_small = parallel_ops(step)
    assert dict(large) == {"add_": 2, "mul": 1, "cat": 1}
    assert n_small == 3


def test_the_table_has_a_row_per_encoding_and_nope_counts_its_few_operators(tmp_path):
    out = tmp_path / "threads.md"
    text = main(["--encodings", "alibi", "--length", "64", "--d-model", "32", "--n-heads", "2", "--reps", "1",
                 "--out", str(out)])
    assert out.read_text() == text
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| encoding")}
    assert set(rows) == {"nope", "alibi"}
    assert float(rows["nope"][0]) == 1.0
    # at N = 64 nothing in nope's step reaches the grain size
    assert int(rows["nope"][1]) == 0
