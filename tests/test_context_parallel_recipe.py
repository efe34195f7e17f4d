"""A recipe end to end under context parallelism: ``posenc run fire_train --devices 2
--context-parallel 2`` (2 gloo processes sharing each sequence), shortened to 2 steps of a 1-layer
TinyGPT: it exits 0, rank 0 alone writes the results, and they record the steps that ran; and
they equal the run the guide names as its reference (`docs/guides/context-parallel.md`): the same
recipe data-parallel over ``devices / K`` ranks (here 1) with the distributed sampler
(``--trainer.strategy=ddp``), i.e. the same batches in the same order. A plain 1-process run
shuffles with another sampler, so it trains on other batches and is not expected to match."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.test_recipes_ddp import ROOT, STEPS, TINY, check


@pytest.mark.slow
def test_fire_train_recipe_under_context_parallel(tmp_path):
    cmd = [sys.executable, "-m", "posenc_lightning.cli", "run", "fire_train", "--devices", "2", "--context-parallel",
           "2", "--trainer.accelerator=cpu", *TINY, "--extend.lengths=[1,2]", "--extend.eval_tokens=256"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900)
    assert "--trainer.callbacks+=posenc_lightning.callbacks.ContextParallel --trainer.callbacks.size=2" in proc.stdout
    res = check(proc, "fire_train", tmp_path)
    r = json.loads(res.read_text())["results"]
    assert (r["steps"], r["completed"]) == (STEPS, True)
    assert sorted(k for k in r if k.startswith("ppl_")) == ["ppl_128", "ppl_64"]

    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    ref = [sys.executable, "-m", "posenc_lightning.cli", "run", "fire_train", "--devices", "1",
           "--trainer.strategy=ddp", "--trainer.accelerator=cpu", *TINY, "--extend.lengths=[1,2]",
           "--extend.eval_tokens=256"]
    proc = subprocess.run(ref, check=False, cwd=ref_dir, capture_output=True, text=True, env=env, timeout=900)
    same = json.loads(check(proc, "fire_train", ref_dir).read_text())["results"]
    for key in ("ppl_64", "ppl_128"):  # float32 sums in another order: equal to rounding
        assert r[key] == pytest.approx(same[key], rel=1e-5), (key, r[key], same[key])
