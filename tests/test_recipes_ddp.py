"""Every recipe under DDP with 2 gloo CPU processes (``--trainer.strategy=ddp``: Lightning starts
the second process by re-running the command), shortened to 2 steps of a 1-layer TinyGPT:

- it exits 0 (rank 0 used to die in ``trainer.log_dir``'s broadcast after rank 1 had returned);
- the results are written once, by rank 0 (the Markdown table is printed exactly once);
- the results record the steps that ran (``trainer.global_step``);
- every file lands under the run directory (``runs/`` in the working directory, a tmp path);
- no epoch-level value is logged unsynced (Lightning's ``sync_dist=True`` warning: ``val/loss``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
TINY = [f"--trainer.max_steps={STEPS}", f"--trainer.val_check_interval={STEPS}", "--trainer.limit_val_batches=1",
        "--trainer.enable_model_summary=false", "--trainer.enable_progress_bar=false", "--data.max_bytes=100000",
        "--data.batch_size=2", "--data.max_val_windows=2", "--model.d_model=16", "--model.n_layers=1"]
DDP = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp"]


def run_recipe(name: str, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "recipes" / f"{name}.py"), "--config", str(ROOT / "configs" / f"{name}.yaml"),
           *TINY, *DDP, *overrides]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, check=False, cwd=cwd, capture_output=True, text=True, env=env, timeout=900)


def check(proc: subprocess.CompletedProcess, name: str, cwd: Path) -> Path:
    """Exit 0, the table printed once, every file under cwd/runs; returns the results.json path."""
    assert proc.returncode == 0, proc.stderr[-4000:]
    # val/loss is the rank average and logged as one (sync_dist=True): Lightning has nothing to warn
    assert "sync_dist=True" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stdout.count(f"# {name}\n") == 1, proc.stdout[-3000:]  # rank 0 alone wrote the results
    assert {p.name for p in cwd.iterdir()} == {"runs"}  # nothing in the working directory itself
    found = list((cwd / "runs").rglob("results.json"))
    assert len(found) == 1, found
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fire_train", "clex_train"])
def test_sweep_recipes_under_ddp(name, tmp_path):
    proc = run_recipe(name, tmp_path, "--extend.lengths=[1,2]", "--extend.eval_tokens=256")
    res = check(proc, name, tmp_path)
    assert res.parent == tmp_path / "runs" / name / "version_0"  # the logger's run directory
    r = json.loads(res.read_text())["results"]
    assert (r["steps"], r["max_steps"], r["completed"], r["stop_reason"]) == (STEPS, STEPS, True, None)
    assert sorted(k for k in r if k.startswith("ppl_")) == ["ppl_128", "ppl_64"]


@pytest.mark.slow
def test_yarn_extend_under_ddp(tmp_path):
    proc = run_recipe("yarn_extend", tmp_path, "--extend.finetune_steps=1", "--extend.eval_tokens=512",
                      "--extend.factor=2")
    res = check(proc, "yarn_extend", tmp_path)
    r = json.loads(res.read_text())["results"]
    assert (r["pretrain_steps"], r["finetune_steps"]) == (STEPS, 1)
    # both runs reached their steps, so there is a verdict: 1 step is 50% of 2 (> 5%)
    assert r["target_met"] is False and "more than 5%" in r["target"]
    assert (res.parent / "pretrained.ckpt").is_file()


@pytest.mark.slow
def test_longrope_extend_under_ddp(tmp_path):
    proc = run_recipe("longrope_extend", tmp_path, "--extend.factor=2", "--extend.population=3", "--extend.parents=2",
                      "--extend.iterations=1", "--extend.search_windows=1", "--extend.finetune_steps=1",
                      "--extend.eval_tokens=256")
    res = check(proc, "longrope_extend", tmp_path)
    r = json.loads(res.read_text())["results"]
    assert (r["pretrain_steps"], r["finetune_steps"], r["pretrain_stop_reason"]) == (STEPS, 1, None)


@pytest.mark.slow
def test_compare_encodings_under_ddp(tmp_path):
    proc = run_recipe("compare_encodings", tmp_path, "--compare.encodings=[rope,alibi]", "--compare.visualize=false",
                      "--compare.lm_eval_tasks=[]", "--compare.multiples=[1,2]", "--compare.max_windows=1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    # val/loss is the rank average and logged as one (sync_dist=True): Lightning has nothing to warn
    assert "sync_dist=True" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stdout.count("# compare_encodings\n") == 1, proc.stdout[-3000:]
    assert {p.name for p in tmp_path.iterdir()} == {"runs"}
    saved = json.loads((tmp_path / "runs" / "compare_encodings" / "results.json").read_text())
    assert saved["steps"] == {"rope": STEPS, "alibi": STEPS} and saved["stopped"] == {}
    assert set(saved["ppl"]) == {"rope", "alibi"} and set(saved["ppl"]["rope"]) == {"64", "128"}
