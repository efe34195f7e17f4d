"""One config route: `PosEncCallback` in ``trainer.callbacks`` with the short form (an encoding
name plus its arguments in ``config``), through a real LightningCLI parse from YAML and from the
command line; every config in configs/ injects its encoding that way; ``posenc train`` is a
LightningCLI whose ``--help`` gives every option a default and ``--print_config`` works."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from posenc_lightning import PosEncCallback
from posenc_lightning.recipes import make_cli
from tests.helpers import run_posenc as _posenc

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--model.d_model=16", "--model.n_layers=1", "--model.n_heads=2"]


def _injected(cli):
    """Run the callbacks' setup (as fit does first) and return the encoding in the model."""
    for cb in cli.trainer.callbacks:
        if isinstance(cb, PosEncCallback):
            cb.setup(cli.trainer, cli.model, "fit")
    return cli.model.blocks[0].attn.posenc


def _recipe(name: str):
    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def test_short_form_from_yaml(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": "posenc_lightning.PosEncCallback",
         "init_args": {"encoding": "fire", "backend": "eager", "config": {"init_L": 64}}}]},
        "model": {"encoding": None}}))
    cli = make_cli(_recipe("fire_train").SweepOptions, ["--config", str(cfg), *TINY, f"--extend.results_dir={tmp_path}"])
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, PosEncCallback)]
    assert (cb.encoding, cb.backend, cb.cfg) == ("fire", "eager", {"init_L": 64})
    enc = _injected(cli)
    assert enc.name == "fire" and enc.config()["init_L"] == 64


def test_short_form_from_the_command_line(tmp_path):
    cli = make_cli(_recipe("fire_train").SweepOptions, [
        *TINY, "--model.encoding=null", "--trainer.callbacks+=posenc_lightning.PosEncCallback",
        "--trainer.callbacks.encoding=alibi", "--trainer.callbacks.config={slope_scale: 0.5}",
        f"--extend.results_dir={tmp_path}"])
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, PosEncCallback)]
    assert (cb.encoding, cb.cfg) == ("alibi", {"slope_scale": 0.5})
    enc = _injected(cli)
    assert enc.name == "alibi" and enc.config()["slope_scale"] == 0.5


def test_config_and_keywords_are_one_set_of_arguments():
    assert PosEncCallback("fire", config={"init_L": 64}, mlp_width=16).cfg == {"init_L": 64, "mlp_width": 16}
    assert PosEncCallback("fire", init_L=64).cfg == {"init_L": 64}
    with pytest.raises(ValueError, match=r"\['init_L'\] given both in config=.*and as keywords"):
        PosEncCallback("fire", config={"init_L": 64}, init_L=32)


@pytest.mark.parametrize("name,encoding,cfg", [
    ("fire_train", "fire", {}), ("clex_train", "clex", {"max_scale": 4.0, "original_max_position_embeddings": 64}),
    ("yarn_extend", "rope", {"theta": 10000.0}), ("longrope_extend", "rope", {"theta": 10000.0}),
    ("drope_extend", "rope", {"theta": 10000.0})])
def test_every_training_config_injects_through_posenc_callback(name, encoding, cfg, tmp_path):
    raw = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    assert raw["model"]["encoding"] is None  # the callback is the one route
    mod = _recipe(name)
    options = next(v for k, v in vars(mod).items() if k.endswith("Options"))
    cli = make_cli(options, ["--config", str(ROOT / "configs" / f"{name}.yaml"), *TINY, f"--extend.results_dir={tmp_path}"])
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, PosEncCallback)]
    assert (cb.encoding, cb.cfg) == (encoding, cfg)
    assert _injected(cli).name == encoding


def test_compare_config_names_encodings_for_posenc_callback():
    raw = yaml.safe_load((ROOT / "configs" / "compare_encodings.yaml").read_text())
    assert "encoding" not in raw["model"]  # compare_encodings injects PosEncCallback(name, config=encoding_cfg[name])
    src = (ROOT / "recipes" / "compare_encodings.py").read_text()
    assert "PosEncCallback(name, config=enc_cfg)" in src


def test_posenc_train_help_gives_every_option_a_default_and_the_backend_choices():
    code, text = _posenc("train", "--help")
    assert code == 0 and text.startswith("usage: posenc train")
    blocks = re.split(r"\n  (?=--)", text.split("\noptions:", 1)[1])
    opts = {b.split()[0]: " ".join(b.split()) for b in blocks if b.startswith("--")}
    documented = [o for o in opts if not o.endswith((".help", "CONFIG")) and o not in ("--print_config", "--config")
                  and not re.fullmatch(r"--(trainer|model|data|posenc|optimizer|lr_scheduler)", o)]
    assert len(documented) > 60
    missing = [o for o in documented if "default:" not in opts[o]]
    assert missing == []
    assert "auto``, ``eager``, ``sdpa``, ``flex``, ``triton`` or ``blockwise``" in opts["--posenc.backend"]
    assert "default: rope" in opts["--posenc.encoding"] and "default: 300" in opts["--trainer.max_steps"]
    assert "default: 128" in opts["--model.d_model"] and "default: 4000000" in opts["--data.max_bytes"]


def test_posenc_train_print_config():
    code, text = _posenc("train", "--posenc.encoding=fire", "--posenc.config={init_L: 64}", "--print_config")
    assert code == 0
    cfg = yaml.safe_load(text)
    assert cfg["posenc"]["encoding"] == "fire" and cfg["posenc"]["config"] == {"init_L": 64}
    assert cfg["trainer"]["max_steps"] == 300 and cfg["data"]["seq_len"] == 128
    assert "max_seq_len" not in cfg["model"]  # linked: the model's length follows --data.seq_len


def test_posenc_train_encoding_shorthand():
    for args in (["--encoding", "alibi"], ["--encoding=alibi"]):
        code, text = _posenc("train", *args, "--print_config")
        assert code == 0 and yaml.safe_load(text)["posenc"]["encoding"] == "alibi"


def test_every_config_injects_through_posenc_callback():
    """One route: each YAML in configs/ names PosEncCallback in trainer.callbacks (the sweeps,
    compare_encodings and compare_tasks and the configs of those recipes, build one PosEncCallback
    per encoding from their list, said in their YAML)."""
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        if path.stem in ("compare_encodings", "compare_tasks") or path.read_text().startswith("# recipes/compare_"):
            assert "PosEncCallback" in path.read_text()
            continue
        paths = [c.get("class_path") for c in (raw.get("trainer", {}).get("callbacks") or [])]
        assert "posenc_lightning.PosEncCallback" in paths, path.name
