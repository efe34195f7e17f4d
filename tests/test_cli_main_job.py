"""The README's main job (``posenc train``) and ``posenc list``, run as a user would."""

import os
import subprocess
import sys
from pathlib import Path

import yaml

from posenc_lightning import available_encodings


def run(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-m", "posenc_lightning.cli", *args], check=False, cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=env)


def test_posenc_list_shows_every_encoding_with_family(tmp_path):
    out = run("list", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == len(available_encodings())
    assert any(line.split()[:2] == ["alibi", "bias"] for line in lines)
    assert any(line.split()[:2] == ["rope", "rotate"] for line in lines)


def test_posenc_train_prints_perplexity_and_writes_tensorboard(tmp_path):
    out = run("train", "--posenc.encoding=alibi", "--trainer.max_steps=20", "--trainer.val_check_interval=10",
              "--data.seq_len=64", "--data.batch_size=4", "--model.d_model=32", "--model.n_layers=1",
              "--data.max_bytes=300000", "--trainer.enable_progress_bar=false", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("encoding=alibi")][-1]
    ppl = float(line.split("val_ppl=")[1].split()[0])
    assert 1.0 < ppl < 256.0  # better than uniform over bytes
    assert line.split()[1] == "steps=20"
    events = list(Path(tmp_path, "runs", "alibi", "version_0").glob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert {"train/loss", "val/ppl"} <= set(acc.Tags()["scalars"])
    assert "Tip:" not in out.stdout + out.stderr  # Lightning's litlogger / litmodels advertising is off
    # hparams.yaml names the encoding used once: the model's (built bare for the callback) records it
    hparams = yaml.safe_load((events[0].parent / "hparams.yaml").read_text())
    assert hparams["encoding"] == "alibi" and "posenc/encoding" not in hparams
    assert [k for k, v in hparams.items() if v == "alibi"] == ["encoding"]
