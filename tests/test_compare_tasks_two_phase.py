"""compare_tasks' two-phase entries (``--tasks.two_phase``; default ``drope``: RoPE, then NoPE
recalibrated, `posenc_lightning.recipes.drope.DROPE`): the first phase is the one-phase RoPE cell
itself, RoPE is in the model during it and gone after, the recalibration runs its fraction of the
steps on examples the first phase has not seen, the cell's signature carries the recalibration's
settings (a changed setting retrains the cell, the same ones do not), and the DroPE orderings are
judged on passkey."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posenc_lightning.data.tasks import TaskDataModule
from posenc_lightning.eval.task_report import render_tasks
from posenc_lightning.recipes.drope import DROPE
from posenc_lightning.recipes.phases import TwoPhase
from tests.helpers import recipe_module

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", str(ROOT / "configs" / "compare_tasks.yaml"), "--trainer.max_steps=4",
        "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1", "--model.d_model=16",
        "--model.n_layers=1", "--model.n_heads=2", "--data.train_len=24", "--data.batch_size=4",
        "--tasks.tasks=[copy]", "--tasks.task_settings={}", "--tasks.encodings=[rope,drope]",
        "--tasks.multiples=[1,2]", "--tasks.test_examples=3", "--tasks.seeds=[0]"]


def _recipe():
    return recipe_module("compare_tasks")


def _cell(out: Path, name: str) -> dict:
    return json.loads((out / "cells" / "copy" / name / "seed0.json").read_text())


def test_drope_cell_trains_rope_then_nope_and_resumes_by_its_settings(tmp_path, capsys):
    recipe = _recipe()
    out = tmp_path / "run"
    args = [*TINY, f"--tasks.results_dir={out}"]
    recipe.main(args)
    rope, drope = _cell(out, "rope"), _cell(out, "drope")
    first, then = drope["phases"]
    # the encoding each phase left in the model (read from the model after its fit)
    assert first["encoding"] == "rope" and then["encoding"] == "nope"
    # 4 steps of RoPE, then max(1, round(4 x 0.1)) = 1 step of NoPE
    assert (first["steps"], then["steps"], drope["steps"]) == (4, 1, 5) and rope["steps"] == 4
    # the first phase is the one-phase RoPE cell, step for step (same seed, data and settings)
    assert first["final_loss"] == rope["final_loss"] and first["final_loss"] != then["final_loss"]
    assert "phases" not in rope and "two_phase" not in rope["signature"]
    assert drope["signature"]["two_phase"] == {"first": "rope", "then": "nope", "fraction": DROPE.fraction,
                                               "lr": DROPE.lr}
    assert drope["signature"]["encoding"] == "drope" and drope["signature"]["scale_with_length"] is False
    assert set(drope["exact_match"]) == {"24", "48"}
    saved = json.loads((out / "results.json").read_text())
    assert saved["tasks"]["copy"]["steps"] == {"rope": 4, "drope": 5}
    assert "| drope | other |" in (out / "results.md").read_text()

    capsys.readouterr()
    recipe.main(args)  # the same settings: neither cell is trained again
    log = capsys.readouterr().out
    assert log.count("finished before, not retrained") == 2 and ": training" not in log

    half = "--tasks.two_phase={drope: {first: rope, then: nope, fraction: 0.5, lr: 0.002}}"
    recipe.main([*args, half])  # another recalibration: only the drope cell runs again
    log = capsys.readouterr().out
    assert "1/2 copy/rope seed 0: finished before" in log and "2/2 copy/drope seed 0: training" in log
    drope = _cell(out, "drope")
    assert [p["steps"] for p in drope["phases"]] == [4, 2]
    assert drope["signature"]["two_phase"] == {"first": "rope", "then": "nope", "fraction": 0.5, "lr": 0.002}


def test_the_second_phase_draws_fresh_examples_and_the_same_tests():
    dm = TaskDataModule(task="copy", train_len=24, batch_size=4, test_examples=3, seed=3)
    later = dm.continued(8)  # two batches of 4 drawn
    first = [b for _, b in zip(range(3), dm.train_dataloader())]
    again = next(iter(later.train_dataloader()))
    assert all(torch.equal(a, b) for a, b in zip(again, first[2]))  # examples 8..11, not 0..3
    assert not torch.equal(again[0], first[0][0])
    assert later.continued(4).first_example == 12 and dm.first_example == 0
    for a, b in zip(next(iter(dm.length_dataloader(48))), next(iter(later.length_dataloader(48)))):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="seen=-1 must be >= 0"):
        dm.continued(-1)


def test_two_phase_entries_are_checked_by_the_grid():
    recipe = _recipe()
    assert recipe.grid(recipe.TasksOptions(tasks=["copy"], encodings=["rope", "drope"]))[1] == ["rope", "drope"]
    with pytest.raises(ValueError, match=r"--tasks.two_phase.drop: unknown encodings \['ropee'\]"):
        recipe.grid(recipe.TasksOptions(encodings=["drop"], two_phase={"drop": {**DROPE.config(), "first": "ropee"}}))
    with pytest.raises(ValueError, match=r"--tasks.two_phase.drop: .*'steps'.*; its fields: first, then"):
        recipe.grid(recipe.TasksOptions(encodings=["drop"], two_phase={"drop": {"first": "rope", "steps": 3}}))
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\], got 0.0"):
        TwoPhase("rope", "nope", 0.0, 1e-3)
    assert TwoPhase(**DROPE.config()) == DROPE and DROPE.steps(750) == 75 and DROPE.steps(4) == 1


def test_drope_orderings_are_judged_on_passkey(tmp_path):
    L = 32
    rows = {"rope": {32: 1.0, 64: 0.3, 128: 0.0}, "yarn": {32: 1.0, 64: 0.9, 128: 0.7},
            "drope": {32: 1.0, 64: 0.8, 128: 0.5}}
    results = {"train_len": L, "multiples": [1, 2, 4], "tasks": {"passkey": {
        "exact_match": rows, "token_accuracy": rows, "by_seed": {k: {0: v} for k, v in rows.items()}}}}
    render_tasks(results, tmp_path, heatmaps=False)
    got = {c["claim"]: (c["verdict"], c["measured"]) for c in results["expectations"] if "DroPE" in c["claim"]}
    assert len(got) == 2
    beats_rope = next(v for k, v in got.items() if k.endswith("beats RoPE beyond the training length"))
    beats_yarn = next(v for k, v in got.items() if "beats YaRN" in k)
    assert beats_rope == ("held", "drope 65% vs rope 15% beyond L (at L: 100% vs 100%)")
    assert beats_yarn == ("not held", "drope 65% vs yarn 80% beyond L (at L: 100% vs 100%)")
    assert "Gelberg et al. 2025" in (tmp_path / "results.md").read_text()
