"""Recipes: `posenc run` builds the right command; yarn_extend writes its results (JSON, Markdown,
TensorBoard) with numbers that are the perplexities it reports; clex_train runs end to end
through `posenc run` (tiny settings; the default configs are exercised by the recorded runs)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posenc_lightning.cli import recipe_command

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--trainer.max_steps=3", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1",
        "--data.max_bytes=200000", "--data.batch_size=4", "--extend.eval_tokens=1024"]


def test_posenc_run_command():
    cmd = recipe_command("yarn_extend", ["--devices", "2", "--trainer.max_steps=5"])
    assert cmd[:2] == [sys.executable, str(ROOT / "recipes" / "yarn_extend.py")]
    assert cmd[2:4] == ["--config", str(ROOT / "configs" / "yarn_extend.yaml")]
    assert cmd[4:] == ["--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.max_steps=5"]
    cmd = recipe_command("fire_train", ["--devices=2", "--trainer.strategy=ddp_spawn", "--config", "my.yaml"])
    assert cmd[2:] == ["--config", "my.yaml", "--trainer.devices=2", "--trainer.strategy=ddp_spawn"]
    with pytest.raises(SystemExit, match="known: .*clex_train.*longrope_extend.*yarn_extend"):
        recipe_command("nope_extend", [])


def test_yarn_extend_writes_results_json_markdown_and_tensorboard(tmp_path):
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import yarn_extend
    finally:
        sys.path.pop(0)
    out = tmp_path / "res"
    r = yarn_extend.main(["--config", str(ROOT / "configs" / "yarn_extend.yaml"), *TINY,
                          "--extend.finetune_steps=1", f"--extend.results_dir={out}",
                          f"--trainer.logger.init_args.save_dir={tmp_path / 'tb'}"])
    saved = json.loads((out / "results.json").read_text())
    assert saved["recipe"] == "yarn_extend" and "yarn_extend.py" in saved["command"]
    assert saved["results"] == pytest.approx(r)
    assert (r["L"], r["factor"], r["finetune_steps"]) == (64, 8.0, 1)
    for k in ("rope_ppl_L", "rope_ppl_sL", "zero_shot_ppl_sL", "finetuned_ppl_sL"):
        assert math.isfinite(r[k]) and 1.0 < r[k] < 256.0  # a byte model: between certainty and uniform
    assert r["finetuned_sL_vs_rope_L"] == pytest.approx(r["finetuned_ppl_sL"] / r["rope_ppl_L"] - 1)
    assert r["target_met"] is False  # 1 fine-tune step is 33% of 3 pre-training steps: not <= 5%
    md = (out / "results.md").read_text()
    assert f"{r['zero_shot_ppl_sL']:.4f}" in md and "| rope (pre-trained) |" in md
    assert (out / "pretrained.ckpt").is_file()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted((tmp_path / "tb").rglob("events.out.tfevents*"))
    tags = {}
    for f in events:
        ea = EventAccumulator(str(f), size_guidance={"scalars": 0, "tensors": 0})
        ea.Reload()
        for t in ea.Tags()["scalars"]:
            tags[t] = ea.Scalars(t)[-1].value
        tags.update({t: None for t in ea.Tags()["tensors"]})
    assert tags["yarn_extend/finetuned_ppl_sL"] == pytest.approx(r["finetuned_ppl_sL"], rel=1e-6)
    assert "yarn_extend/results/text_summary" in tags  # the Markdown table in the text tab


def test_clex_train_through_posenc_run(tmp_path):
    """Run from an empty working directory without a logger: everything lands in results_dir
    (this test used to leave checkpoints/epoch=0-step=3.ckpt in the repository root)."""
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    cmd = [sys.executable, "-m", "posenc_lightning.cli", "run", "clex_train", *TINY,
           f"--extend.results_dir={out}", "--trainer.logger=false"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(cwd.iterdir()) == []
    assert "Tip:" not in proc.stdout + proc.stderr  # Lightning's litlogger / litmodels advertising is off
    assert (out / "checkpoints" / "epoch=0-step=3.ckpt").is_file()
    r = json.loads((out / "results.json").read_text())["results"]
    assert r["encoding"] == "clex" and r["L"] == 64 and r["steps"] == 3
    assert all(math.isfinite(r[f"ppl_{n}"]) for n in (64, 128, 256, 512))
