"""A recipe end to end under context parallelism: ``posenc run fire_train --devices 2
--context-parallel 2`` (2 gloo processes sharing each sequence), shortened to 2 steps of a 1-layer
TinyGPT: it exits 0, rank 0 alone writes the results, and they record the steps that ran."""

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
