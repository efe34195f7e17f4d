"""``posenc train`` and the recipes read config files in jsonargparse's ``omegaconf`` parser mode
(issue 46): a Hydra-style YAML with ``${...}`` interpolation parses, and the interpolated values
reach the objects built from it."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

pytest.importorskip("omegaconf")

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """\
data:
  seq_len: 48
  batch_size: 2
  max_bytes: 100000
model:
  d_model: 32
  n_layers: 1
  n_heads: 2
  warmup_steps: ${data.batch_size}
posenc:
  encoding: fire
  config:
    init_L: ${data.seq_len}
"""


def test_posenc_train_resolves_interpolation(tmp_path):
    from posenc_lightning.cli import main

    (tmp_path / "job.yaml").write_text(CONFIG)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as exit_:
        main(["train", "--config", str(tmp_path / "job.yaml"), "--print_config"])
    assert exit_.value.code in (0, None)
    cfg = yaml.safe_load(buf.getvalue())
    assert cfg["posenc"]["config"] == {"init_L": 48}  # ${data.seq_len}
    assert cfg["model"]["warmup_steps"] == 2  # ${data.batch_size}


def test_a_recipe_builds_its_objects_from_interpolated_values(tmp_path):
    from posenc_lightning import PosEncCallback
    from posenc_lightning.recipes import SweepOptions, make_cli

    cfg = yaml.safe_load((ROOT / "configs" / "fire_train.yaml").read_text())
    cfg.setdefault("extend", {})["results_dir"] = str(tmp_path)
    cfg["data"] = {**cfg.get("data", {}), "seq_len": 32}
    cfg["model"] = {**cfg.get("model", {}), "d_model": 32, "n_layers": 1, "n_heads": 2,
                    "max_seq_len": "${data.seq_len}"}
    cfg["trainer"]["callbacks"][0]["init_args"]["config"] = {"init_L": "${data.seq_len}"}  # a callback's argument
    path = tmp_path / "fire.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert path.read_text().count("${data.seq_len}") == 2
    cli = make_cli(SweepOptions, ["--config", str(path), "--trainer.logger=false"], "fire_train")
    assert cli.model.hparams.max_seq_len == 32 and cli.datamodule.seq_len == 32
    [posenc] = [c for c in cli.trainer.callbacks if isinstance(c, PosEncCallback)]
    assert posenc.encoding == "fire" and posenc.cfg == {"init_L": 32}
