"""Hydra users (lightning-hydra-template) build callbacks with ``hydra.utils.instantiate`` from a
``_target_`` config (issue 46): the arguments then arrive as OmegaConf ``DictConfig`` /
``ListConfig``, interpolations included. Every public callback, the CLEX / LongRoPE curricula and
`inject` take them: nothing of OmegaConf is kept (attributes, hyperparameters, checkpoints hold
plain dicts and lists), and a real Trainer run saves a checkpoint that loads with
``weights_only=True`` and an ``hparams.yaml`` of plain YAML."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml

hydra_utils = pytest.importorskip("hydra.utils")
omegaconf = pytest.importorskip("omegaconf")
OmegaConf = omegaconf.OmegaConf

from posenc_lightning import inject
from posenc_lightning.data import CorpusDataModule
from posenc_lightning.models import TinyGPT

#: one ``_target_`` config per public callback / curriculum, lists and dicts in every container argument
CONFIGS: dict[str, dict[str, Any]] = {
    "PosEncCallback": {"_target_": "posenc_lightning.PosEncCallback", "encoding": "mixture",
                       "config": {"members": ["alibi", "fire"], "member_cfgs": {"fire": {"init_L": "${len}"}}}},
    "ContextCurriculum": {"_target_": "posenc_lightning.ContextCurriculum",
                          "stages": [{"start_step": 0, "seq_len": "${len}"}, {"start_step": 2, "seq_len": 32}]},
    "LengthEvalCallback": {"_target_": "posenc_lightning.LengthEvalCallback", "lengths": ["${len}", 32]},
    "TaskEvalCallback": {"_target_": "posenc_lightning.TaskEvalCallback", "multiples": [1, 2], "base_len": "${len}"},
    "LMEvalCallback": {"_target_": "posenc_lightning.LMEvalCallback", "tasks": ["niah_single_1"],
                       "max_seq_lengths": ["${len}"], "haystack_files": ["a.txt"], "include_path": ["tasks"],
                       "metadata": {"max_seq_lengths": ["${len}"]}},
    "PosEncVisualizer": {"_target_": "posenc_lightning.PosEncVisualizer", "layers": [0], "heads": [0, 1],
                         "lengths": ["${len}"]},
    "ContextParallel": {"_target_": "posenc_lightning.ContextParallel", "size": 2},
    "CLEXCurriculum": {"_target_": "posenc_lightning.curriculum.CLEXCurriculum", "train_length": "${len}",
                       "t_max": 4.0},
    "LongRoPECurriculum": {"_target_": "posenc_lightning.curriculum.LongRoPECurriculum", "original_length": "${len}",
                           "target_length": 64, "steps_per_stage": 2, "n_hat_candidates": [0, 4]},
}


def _build(name: str) -> Any:
    cfg = OmegaConf.create({"len": 16, "obj": CONFIGS[name]})
    return hydra_utils.instantiate(cfg.obj, _convert_="none")  # DictConfig / ListConfig arguments, as Hydra's default


def _omegaconf_inside(value: Any, seen: set[int] | None = None, depth: int = 0) -> list[str]:
    """Paths to OmegaConf containers anywhere in ``value`` (attributes, dict values, list items)."""
    seen = set() if seen is None else seen
    if id(value) in seen or depth > 6:
        return []
    seen.add(id(value))
    if type(value).__module__.startswith("omegaconf"):
        return [type(value).__name__]
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        items = list(enumerate(value))
    elif hasattr(value, "__dict__") and type(value).__module__.startswith("posenc_lightning"):
        items = list(vars(value).items())
    else:
        return []
    return [f"{k}.{p}" for k, v in items for p in _omegaconf_inside(v, seen, depth + 1)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_instantiate_takes_dictconfig_and_listconfig_and_keeps_plain_values(name):
    obj = _build(name)
    assert type(obj).__name__ == name
    assert _omegaconf_inside(obj) == []


def test_interpolations_resolve():
    assert _build("LengthEvalCallback").lengths == [16, 32]
    assert _build("LMEvalCallback").metadata == {"max_seq_lengths": [16]}
    assert _build("PosEncCallback").cfg == {"members": ["alibi", "fire"], "member_cfgs": {"fire": {"init_L": 16}}}
    assert [s.seq_len for s in _build("ContextCurriculum").stages] == [16, 32]


def test_inject_takes_omegaconf_arguments():
    model = TinyGPT(d_model=32, n_layers=1, n_heads=2, max_seq_len=32, encoding=None)
    cfg = OmegaConf.create({"members": ["alibi", "fire"], "member_cfgs": {"fire": {"init_L": 16}}})
    enc = hydra_utils.instantiate({"_target_": "posenc_lightning.inject", "model": model, "encoding": "mixture",
                                   **{k: cfg[k] for k in cfg}}, _convert_="none")
    assert enc is model.blocks[0].attn.posenc and _omegaconf_inside(enc.config()) == []
    assert inject(model, "mixture", **{k: cfg[k] for k in cfg}) is enc  # the same spec: kept


def test_a_trainer_run_from_hydra_configs_writes_plain_checkpoints_and_hparams(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    callbacks = [_build("PosEncCallback"), _build("ContextCurriculum"), _build("LengthEvalCallback")]
    model = TinyGPT(d_model=32, n_layers=1, n_heads=2, max_seq_len=64, encoding=None)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=CSVLogger(tmp_path), callbacks=callbacks,
                         limit_val_batches=1, val_check_interval=3, num_sanity_val_steps=0,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(model, CorpusDataModule(seq_len=16, batch_size=2, max_bytes=100_000, max_val_windows=2))
    assert trainer.global_step == 3 and set(callbacks[2].results) == {16, 32}
    ckpt = next(tmp_path.rglob("*.ckpt"))
    saved = torch.load(ckpt, weights_only=True)  # would refuse an OmegaConf object
    assert saved["hyper_parameters"]["encoding_cfg"]["members"] == ["alibi", "fire"]
    hparams = yaml.safe_load(next(tmp_path.rglob("hparams.yaml")).read_text())  # plain YAML, no python tags
    assert hparams["encoding"] == "mixture" and hparams["encoding_cfg"]["member_cfgs"] == {"fire": {"init_L": 16}}
    back = TinyGPT.load_from_checkpoint(ckpt)
    assert back.blocks[0].attn.posenc.name == "mixture"
