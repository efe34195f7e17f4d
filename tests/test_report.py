"""`posenc report`: writes report.* into its own directory (never over a recipe's results.*),
and reports what a run has: the recipe table, perplexity by length, every scalar series. Tested
on a recipe run (fire_train) and on the main job's run directory (`posenc train`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from posenc_lightning.cli import main
from posenc_lightning.eval.compare import scalar_series

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--trainer.max_steps=4", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
        "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--data.max_bytes=100000", "--data.batch_size=2", "--data.max_val_windows=2", "--model.d_model=16",
        "--model.n_layers=1", "--extend.lengths=[1,2]", "--extend.eval_tokens=256"]


@pytest.fixture(scope="module")
def fire_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fire")
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import fire_train
    finally:
        sys.path.pop(0)
    r = fire_train.main(["--config", str(ROOT / "configs" / "fire_train.yaml"), *TINY,
                         f"--trainer.logger.init_args.save_dir={tmp}"])
    return tmp / "fire_train" / "version_0", r


def test_report_of_a_recipe_run_keeps_its_files_and_has_its_table(fire_run):
    run, r = fire_run
    before = {p.name: p.read_bytes() for p in run.glob("results.*")}
    assert set(before) == {"results.json", "results.md"}
    assert main(["report", str(run)]) == 0
    assert {p.name: p.read_bytes() for p in run.glob("results.*")} == before  # untouched
    out = run / "report"
    text = (out / "report.md").read_text()
    assert "## Recipe results: ." in text and f"| 128 (2 L) | {r['ppl_128']:.4f} |" in text
    saved = json.loads((out / "report.json").read_text())
    series = scalar_series(run, skip=out)
    loss = series["."]["train/loss"]
    assert len(loss) == 4 and [s for s, _ in loss] == [0, 1, 2, 3]  # log_every_n_steps=1, 4 steps
    assert saved["scalars"]["."]["train/loss"] == {"steps": [0, 1, 2, 3], "values": [v for _, v in loss]}
    row = f"| . | train/loss | 4 | 0-3 | {loss[-1][1]:.4g} | {min(v for _, v in loss):.4g} |"
    assert row in text
    assert saved["recipes"] == ["results.json"]
    # a second report reads the same run (its own output is not part of the run)
    assert main(["report", str(run)]) == 0
    assert json.loads((out / "report.json").read_text())["recipes"] == ["results.json"]


def test_report_of_the_main_job_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--posenc.encoding=alibi", "--trainer.max_steps=4", "--trainer.val_check_interval=2",
                 "--trainer.log_every_n_steps=1", "--data.seq_len=32", "--data.batch_size=2", "--model.d_model=16",
                 "--model.n_layers=1", "--data.max_bytes=100000", "--data.max_val_windows=2",
                 "--trainer.enable_progress_bar=false"]) == 0
    run = tmp_path / "runs" / "alibi" / "version_0"
    out = tmp_path / "rep"
    assert main(["report", str(run), "--out", str(out)]) == 0
    saved = json.loads((out / "report.json").read_text())
    assert {"train/loss", "val/loss", "val/ppl"} <= set(saved["scalars"]["."])
    assert saved["scalars"]["."]["train/loss"]["steps"] == [0, 1, 2, 3]
    assert saved["scalars"]["."]["val/ppl"]["steps"] == [1, 3]  # validated after steps 2 and 4
    assert saved["ppl"] == {} and not (out / "report_ppl_vs_length.png").exists()
    assert sorted(p.name for p in run.iterdir() if p.is_file() and not p.name.startswith("events")) == [
        "config.yaml", "hparams.yaml"]  # the main job's own files, untouched; nothing named report*


def test_report_of_an_empty_directory_says_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="nothing to report under .*no TensorBoard event files and no results.json"):
        main(["report", str(tmp_path)])


def test_heatmap_of_the_recorded_27_encodings_labels_every_row_grouped_by_family(tmp_path):
    pytest.importorskip("matplotlib")
    from posenc_lightning.encodings.registry import describe
    from posenc_lightning.eval.plots import FAMILY_ORDER, grouped_rows, ppl_heatmap

    d = json.loads((ROOT / "benchmarks" / "results" / "compare_encodings" / "results.json").read_text())
    ppl = {k: {int(n): float("nan") if v is None else v for n, v in r.items()} for k, r in d["ppl"].items()}
    fam = {n: f for n, f, _ in describe()}
    rows = grouped_rows(ppl, fam)
    assert len(rows) == len(ppl) == 27
    order = [FAMILY_ORDER.index(f) for f, _ in rows]
    assert order == sorted(order)  # families contiguous, in FAMILY_ORDER
    for f in {f for f, _ in rows}:  # within a family: flattest first (ppl(16L) / ppl(L))
        flat = [ppl[n][1024] / ppl[n][64] for g, n in rows if g == f and ppl[n][1024] == ppl[n][1024]]
        assert flat == sorted(flat)
    fig = ppl_heatmap(ppl, str(tmp_path / "h.png"), base_len=64, families=fam)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [n for _, n in rows]  # every row named where drawn
    cells = [t.get_text() for t in ax.texts]
    assert cells.count("fails") == 4 and "15.70" in cells  # learned beyond its table; sinusoidal at 16L
    assert (tmp_path / "h.png").stat().st_size > 10_000
