"""`benchmarks/run.py` times every encoding on one seeded input: the work of a step depends on its
input (blockwise normalizers stop where a row's weights run out, CoPE's bands end where its counts
clamp), so two runs with one seed measure the same work, whatever the global RNG did before."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import bench_inputs
from benchmarks.run import main

CPU = torch.device("cpu")


def test_one_seed_draws_one_input_whatever_the_global_rng_did():
    torch.manual_seed(123)
    x1, ids1 = bench_inputs(48, 16, 5, CPU)
    torch.randn(1000)  # the global RNG moves on; the inputs do not follow it
    x2, ids2 = bench_inputs(48, 16, 5, CPU)
    assert torch.equal(x1, x2) and torch.equal(ids1, ids2)
    assert x1.shape == (1, 48, 16) and ids1.shape == (1, 49)
    assert int(ids1.min()) >= 0 and int(ids1.max()) < 256
    x3, _ = bench_inputs(48, 16, 6, CPU)
    assert not torch.equal(x1, x3)


def test_the_default_seed_is_the_input_threads_py_and_checkouts_py_time():
    g = torch.Generator().manual_seed(0)
    assert torch.equal(bench_inputs(32, 8, 0, CPU)[0], torch.randn(1, 32, 8, generator=g))


def test_the_record_names_its_input_seed(tmp_path):
    out = tmp_path / "run.md"
    main(["--lengths", "32", "--d-model", "16", "--n-heads", "2", "--reps", "1", "--no-gpt", "--no-memory",
          "--encodings", "alibi", "--seed", "3", "--out", str(out)])
    text = out.read_text()
    assert "--seed 3" in text and "input seed 3" in text
    rows = {line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")}
    assert {"nope", "alibi"} <= rows
