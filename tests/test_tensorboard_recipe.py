"""A TensorBoard run of the default recipe (compare_encodings) holds the scalars, images and text,
`posenc report` renders the same table from it, and `tensorboard --logdir` serves the tags."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("matplotlib")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import compare_encodings
    finally:
        sys.path.remove(str(ROOT / "recipes"))
    out = tmp_path_factory.mktemp("compare")
    ppl = compare_encodings.main([
        "--config", str(ROOT / "configs" / "compare_encodings.yaml"),
        "--compare.encodings=[rope,alibi,learned]", "--trainer.max_steps=3", "--trainer.val_check_interval=3",
        "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1", "--data.max_bytes=300000", "--data.batch_size=4",
        "--compare.multiples=[1,2]", "--compare.max_windows=1", "--compare.lm_eval_lengths=[256]",
        "--compare.lm_eval_limit=1", f"--compare.results_dir={out}"])
    return out, ppl


def _accumulate(d: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(d), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc.Tags()


def test_event_files_hold_scalars_images_and_text(run_dir):
    out, ppl = run_dir
    for enc in ("rope", "alibi", "learned"):
        tags = _accumulate(out / enc)
        for s in ("train/loss", "val/loss", "val/ppl", "length_eval/ppl/64", "length_eval/ppl/128",
                  "lm_eval/passkey_loglikelihood/256"):
            assert s in tags["scalars"], (enc, s)
        assert "posenc/attention/layer0_head0_N64" in tags["images"], enc
        assert "length_eval/ppl_vs_length" in tags["images"]
        text = {t.split("/text_summary")[0] for t in tags["tensors"]}
        assert {"length_eval/table", "lm_eval/results"} <= text, (enc, text)
    assert "posenc/bias_vs_distance/N64" in _accumulate(out / "alibi")["images"]
    assert "posenc/rotary_spectrum" in _accumulate(out / "rope")["images"]
    assert "posenc/params/table" in _accumulate(out / "learned")["histograms"]
    # the learned table (64 rows) cannot run at 2L: reported as a failure, not a crash
    assert ppl["learned"][64] == ppl["learned"][64] and ppl["learned"][128] != ppl["learned"][128]
    md = (out / "results.md").read_text()
    assert "| learned |" in md and "fails (beyond table)" in md
    assert (out / "ppl_vs_length.png").stat().st_size > 1000
    summary = _accumulate(out / "summary")  # the heatmap and the table in TensorBoard too
    assert "compare/ppl_vs_length" in summary["images"]
    assert "compare/results/text_summary" in summary["tensors"]


def test_posenc_report_renders_the_same_numbers(run_dir, tmp_path):
    out, ppl = run_dir
    from posenc_lightning.cli import main

    recipe_files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert main(["report", str(out), "--out", str(tmp_path)]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == recipe_files  # the recipe's untouched
    got = json.loads((tmp_path / "report.json").read_text())["ppl"]
    for enc, by_len in ppl.items():
        for n, v in by_len.items():
            if not math.isnan(v):
                assert got[enc][str(n)] == pytest.approx(v, rel=1e-6)
            else:
                assert got[enc][str(n)] != got[enc][str(n)]  # NaN: fails
    assert (tmp_path / "report_ppl_vs_length.png").is_file()
    assert "fails" in (tmp_path / "report.md").read_text() and "| learned |" in (tmp_path / "report.md").read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read().decode())


def test_tensorboard_serves_the_tags(run_dir):
    out, _ = run_dir
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(out), "--host", "127.0.0.1",
                             "--port", str(port), "--reload_interval", "1", "--load_fast", "false"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}/data/plugin"
        deadline = time.monotonic() + 90
        scalars = images = text = {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                scalars = _get(f"{base}/scalars/tags")
                images = _get(f"{base}/images/tags")
                text = _get(f"{base}/text/tags")
                if all(r in scalars for r in ("rope", "alibi")) and "alibi" in images and "rope" in text:
                    break
            except OSError:
                pass
            time.sleep(1)
        assert "length_eval/ppl/128" in scalars["alibi"] and "train/loss" in scalars["rope"]
        assert "posenc/bias_vs_distance/N64" in images["alibi"]
        assert "lm_eval/results" in text["rope"] or "lm_eval/results/text_summary" in text["rope"]
    finally:
        proc.kill()
        proc.wait(timeout=10)
