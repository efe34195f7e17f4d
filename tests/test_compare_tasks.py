"""recipes/compare_tasks.py end to end at tiny settings: results.json / results.md / heatmaps /
TensorBoard scalars agree with each other, a finished cell is not retrained on rerun (and is when
its settings change), `posenc report` reads the run; the papers' expectations are judged as
stated."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from posenc_lightning.eval.task_report import EXPECTATIONS, Expectation, seed_verdict, task_table, verdict
from tests.helpers import recipe_module

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", str(ROOT / "configs" / "compare_tasks.yaml"), "--trainer.max_steps=3",
        "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1", "--model.d_model=16", "--model.n_layers=1", "--model.n_heads=2",
        "--data.train_len=24", "--data.batch_size=4", "--tasks.tasks=[copy,mqar]", "--tasks.encodings=[nope,yarn]",
        "--tasks.multiples=[1,2]", "--tasks.test_examples=3", "--tasks.task_cfg={mqar: {n_pairs: 3}}",
        "--tasks.seeds=[0,1]",
        ("--tasks.task_settings={mqar: {model: {d_model: 8, qkv_init_std: 0.08}, data: {train_len: 16}, "
         "trainer: {max_steps: 2}, source: Zoology}}"),
        "--tasks.encoding_cfg={yarn: {factor: 1.0, original_max_position_embeddings: 24}}"]


def _recipe():
    return recipe_module("compare_tasks")


@pytest.mark.slow
def test_compare_tasks_writes_results_and_skips_finished_cells(tmp_path, capsys):
    recipe = _recipe()
    out = tmp_path / "run"
    args = [*TINY, f"--tasks.results_dir={out}"]
    r = recipe.main(args)
    saved = json.loads((out / "results.json").read_text())
    assert saved["train_len"] == 24 and saved["multiples"] == [1, 2] and set(saved["tasks"]) == {"copy", "mqar"}
    for task in ("copy", "mqar"):
        em = saved["tasks"][task]["exact_match"]
        steps = 2 if task == "mqar" else 3  # mqar's task_settings entry overrides max_steps
        lengths = {"16", "32"} if task == "mqar" else {"24", "48"}  # and gives it its own L
        assert set(em) == {"nope", "yarn"} and saved["tasks"][task]["steps"] == {"nope": steps, "yarn": steps}
        for name, row in em.items():
            assert set(row) == lengths and all(0.0 <= v <= 1.0 for v in row.values())
            assert row == {str(n): v for n, v in r["tasks"][task]["exact_match"][name].items()}
            seeds = saved["tasks"][task]["by_seed"][name]
            assert set(seeds) == {"0", "1"}
            for n in row:  # the row is the seeds' mean
                assert row[n] == pytest.approx((seeds["0"][n] + seeds["1"][n]) / 2)
            for s in (0, 1):
                cell = json.loads((out / "cells" / task / name / f"seed{s}.json").read_text())
                assert cell["exact_match"] == seeds[str(s)] and cell["signature"]["seed"] == s
                # qkv_init_std is signed only where set: cells finished before it existed keep theirs
                assert cell["signature"]["model"].get("qkv_init_std", "unset") == (0.08 if task == "mqar" else "unset")
                if name == "yarn":  # YaRN's original length follows the task's L
                    assert cell["signature"]["encoding_cfg"]["original_max_position_embeddings"] == int(min(lengths))
        assert (out / f"heatmap_{task}.png").stat().st_size > 5_000
    assert saved["tasks"]["mqar"]["config"] == {"n_pairs": 3, "n_keys": 32, "n_values": 32}
    assert saved["tasks"]["mqar"]["train_len"] == 16 and saved["tasks"]["copy"]["train_len"] == 24
    assert saved["tasks"]["mqar"]["model"]["d_model"] == 8 and saved["tasks"]["copy"]["model"]["d_model"] == 16
    assert saved["tasks"]["mqar"]["source"] == "Zoology"
    md = (out / "results.md").read_text()
    assert "NoPE beats RoPE" not in md  # rope is not in this grid: an ordering it cannot judge is not listed
    assert "| mqar | attention solves MQAR at the training length" in md  # a threshold judges any grid
    assert "| nope | none |" in md and "| yarn | rotate |" in md and "2x (48)" in md

    from posenc_lightning.eval.compare import scalar_series

    series = scalar_series(out / "tb")
    tb = series["copy/yarn_seed1"]["task_eval/exact_match/48"][-1]
    assert tb == (3, pytest.approx(saved["tasks"]["copy"]["by_seed"]["yarn"]["1"]["48"], abs=1e-6))
    assert "train/loss" in series["mqar/nope_seed0"]

    stamps = {p: p.stat().st_mtime_ns for p in (out / "cells").rglob("*.json")}
    capsys.readouterr()
    again = recipe.main(args)
    log = capsys.readouterr().out
    assert log.count("finished before, not retrained") == 8 and ": training" not in log
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert json.loads((out / "results.json").read_text())["tasks"] == saved["tasks"]
    assert again["tasks"]["copy"]["exact_match"] == r["tasks"]["copy"]["exact_match"]

    recipe.main([*args, "--tasks.tasks=[copy]", "--tasks.encodings=[nope]", "--tasks.multiples=[1,2,4]"])
    log = capsys.readouterr().out
    assert "1/2 copy/nope seed 0: training" in log  # another evaluation grid: the cell is run again
    assert set(json.loads((out / "cells" / "copy" / "nope" / "seed1.json").read_text())["exact_match"]) == {"24", "48", "96"}

    from posenc_lightning.cli import main as cli_main

    assert cli_main(["report", str(out), "--out", str(tmp_path / "rep")]) == 0
    rep = (tmp_path / "rep" / "report.md").read_text()
    assert "## Recipe results: ." in rep and "| nope | none |" in rep and "task_eval/exact_match/48" in rep


def test_a_task_can_train_at_its_own_length(tmp_path):
    """``task_settings.<task>.data.train_len`` gives one task its own L: its data, the encodings'
    length arguments (written for the shared L) and its report's columns and verdicts follow it;
    the other tasks keep the shared L."""
    recipe = _recipe()
    opts = recipe.TasksOptions(task_settings={"addition": {"data": {"train_len": 16}, "trainer": {"max_steps": 9}}})
    shared = ({"d_model": 64}, {"train_len": 32, "batch_size": 32}, {"max_steps": 5})
    assert recipe.task_settings(opts, "addition", *shared)[1:3] == ({"train_len": 16, "batch_size": 32}, {"max_steps": 9})
    assert recipe.task_settings(opts, "copy", *shared)[1:3] == ({"train_len": 32, "batch_size": 32}, {"max_steps": 5})
    yarn = {"factor": 1.0, "original_max_position_embeddings": 32, "max_position_embeddings": 512, "max_seq_len": 32}
    assert recipe.scaled_lengths(yarn, 32, 16) == {"factor": 1.0, "original_max_position_embeddings": 16,
                                                   "max_position_embeddings": 256, "max_seq_len": 16}
    assert recipe.scaled_lengths(yarn, 32, 32) == yarn and recipe.scaled_lengths({"max_scale": 16.0}, 32, 16) == {"max_scale": 16.0}

    from posenc_lightning.eval.task_report import render_tasks

    def row(at_l: float, beyond: float, n: int) -> dict[int, float]:
        return {n: at_l, 2 * n: beyond}

    results = {"train_len": 32, "multiples": [1, 2], "tasks": {
        "addition": {"train_len": 16, "min_train_len": 6, "exact_match": {"nope": row(0.95, 0.5, 16), "rope": row(0.92, 0.0, 16)},
                     "token_accuracy": {}, "by_seed": {}},
        "copy": {"min_train_len": 8, "exact_match": {"nope": row(1.0, 0.1, 32), "rope": row(1.0, 0.3, 32)},
                 "token_accuracy": {}, "by_seed": {}}}}
    md = render_tasks(results, tmp_path, heatmaps=False)
    addition, copy = md.split("## addition")[1].split("## copy")
    assert "training lengths 6..16 (its own L=16)" in addition and "| 1x (16) | 2x (32) |" in addition
    assert "training lengths 8..32;" in copy and "| 1x (32) | 2x (64) |" in copy
    verdicts = {c["task"]: (c["verdict"], c["measured"]) for c in results["expectations"]}
    assert verdicts["addition"] == ("held", "nope 50% vs rope 0% beyond L (at L: 95% vs 92%)")
    assert verdicts["copy"] == ("not held", "nope 10% vs rope 30% beyond L (at L: 100% vs 100%)")


def test_bad_grid_names_the_known_ones():
    recipe = _recipe()
    with pytest.raises(ValueError, match=r"--tasks.tasks: unknown \['copyy'\]; known tasks: \['addition'"):
        recipe.grid(recipe.TasksOptions(tasks=["copyy"]))
    with pytest.raises(ValueError, match=r"--tasks.encodings: unknown \['ropee'\]; known: \["):
        recipe.grid(recipe.TasksOptions(encodings=["ropee"]))
    tasks, names = recipe.grid(recipe.TasksOptions(full=True, exclude=["nope"]))
    from posenc_lightning.data.tasks import TASKS
    from posenc_lightning.encodings import available_encodings

    assert tasks == sorted(TASKS) and names == [n for n in available_encodings() if n != "nope"]


def test_verdicts_follow_the_stated_rule():
    e = Expectation("copy", "NoPE beats RoPE", "paper", "nope", "rope")
    L = 32
    held = {"nope": {32: 1.0, 64: 0.5, 128: 0.25}, "rope": {32: 1.0, 64: 0.1, 128: 0.0}}
    assert verdict(e, held, L) == ("held", "nope 38% vs rope 5% beyond L (at L: 100% vs 100%)")
    flipped = {"nope": held["rope"], "rope": held["nope"]}
    assert verdict(e, flipped, L)[0] == "not held"
    tie = {"nope": {32: 0.9, 64: 0.0}, "rope": {32: 0.9, 64: 0.0}}
    assert verdict(e, tie, L)[0] == "not held"  # a tie is not a win
    unlearned = {"nope": {32: 0.2, 64: 0.1}, "rope": {32: 0.3, 64: 0.0}}
    v, why = verdict(e, unlearned, L)
    assert v == "no verdict" and "not learned at this scale" in why
    weak_baseline = {"nope": {32: 1.0, 64: 0.9}, "rope": {32: 0.85, 64: 0.0}}
    v, why = verdict(e, weak_baseline, L)  # rope below 90% at L: nope's lead beyond L proves nothing
    assert v == "no verdict" and "the baseline rope is below 90% at L" in why
    weak_winner = {"nope": {32: 0.1, 64: 0.0}, "rope": {32: 0.95, 64: 0.2}}
    assert verdict(e, weak_winner, L)[0] == "not held"  # the claimed encoding failed to learn: a verdict
    failing = {"nope": {32: 1.0, 64: math.nan, 128: 0.5}, "rope": {32: 1.0, 64: 0.2, 128: 0.2}}
    assert verdict(e, failing, L)[0] == "held"  # a length that cannot run is left out of the mean
    mq = next(x for x in EXPECTATIONS if x.task == "mqar")
    assert verdict(mq, {"rope": {32: 0.95}, "alibi": {32: 0.97}}, L)[0] == "held"
    v, why = verdict(mq, {"rope": {32: 0.95}, "nope": {32: 0.4}}, L)
    assert v == "not held" and why.endswith("below: nope")
    v, why = verdict(mq, {"rope": {32: 0.5}, "alibi": {32: 0.97}}, L)  # the setting is too small to test the claim
    assert v == "no verdict" and why.endswith("the baseline rope is below 90% at L: not learned at this scale")
    glitch = next(x for x in EXPECTATIONS if x.glitches)
    assert verdict(glitch, {"fox": {32: 1.0, 64: 0.99}, "sba": {32: 0.9, 64: 1.0, 128: 0.98}}, L)[0] == "held"
    v, why = verdict(glitch, {"fox": {32: 0.9, 64: 1.0, 128: 1.0}, "sba": {32: 1.0, 64: 0.5}}, L)
    assert v == "not held" and why.endswith(": fox")
    assert {x.task for x in EXPECTATIONS} == {"copy", "reverse", "addition", "flip_flop", "selective_copy",
                                             "counting", "mqar", "passkey"}
    # the layer schedules', PaTH's and DroPE's orderings name registered encodings or grid entries
    from posenc_lightning.encodings import available_encodings
    from posenc_lightning.encodings.presets import available_presets

    named = {n for x in EXPECTATIONS for n in (x.winner, x.loser) if n is not None}
    two_phase = set(_recipe().TasksOptions().two_phase)  # grid entries by name: drope
    assert {"rnope_swa", "irope", "path", "drope"} <= named <= set(available_encodings() + available_presets()) | two_phase


def test_seeds_must_agree_for_a_verdict():
    e = Expectation("copy", "NoPE beats RoPE", "paper", "nope", "rope")
    L = 32
    good = {"nope": {32: 1.0, 64: 0.6}, "rope": {32: 1.0, 64: 0.1}}
    bad = {"nope": {32: 1.0, 64: 0.0}, "rope": {32: 1.0, 64: 0.1}}
    both = {k: {0: good[k], 1: {32: 0.95, 64: 0.4} if k == "nope" else good[k]} for k in good}
    v, why = seed_verdict(e, both, L)
    assert v == "held" and why.startswith("seed 0: nope 60% vs rope 10%") and "seed 1: nope 40%" in why
    split = {k: {0: good[k], 1: bad[k]} for k in good}
    v, why = seed_verdict(e, split, L)
    assert v == "no verdict" and why.startswith("the seeds disagree (seed 0 held, seed 1 not held)")
    unlearned = {k: {0: good[k], 1: {32: 0.5, 64: 0.0}} for k in good}
    v, why = seed_verdict(e, unlearned, L)  # seed 1's baseline did not learn the task: no common verdict
    assert v == "no verdict" and "seed 1 no verdict" in why
    assert seed_verdict(e, {k: {3: good[k]} for k in good}, L) == verdict(e, good, L)
    table = task_table({"nope": {32: 0.975, 64: 0.5}}, L, {"nope": "none"}, None,
                       {"nope": {0: {32: 1.0, 64: 0.5}, 1: {32: 0.95, 64: 0.5}}})
    assert table.splitlines()[-1] == "| nope | none | 98 (95-100) | 50 | 50 |"
