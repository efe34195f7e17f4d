"""A TinyGPT built with a layer schedule exports the config keys transformers reads
(`models.hf_schedule.schedule_config`): the transformers config built from them has the fields
that model type's own conventions give (SmolLM3's ``no_rope_layer_interval``, Gemma 3's
``sliding_window_pattern``), a tiny transformers model built from it puts rope and windows in the
same layers as the schedule, its rotary frequencies equal the encoding's, and a schedule no key
expresses is refused with the reason."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from posenc_lightning import LayerSchedule, inject
from posenc_lightning.encodings.presets import build_preset
from posenc_lightning.models import TinyGPT
from posenc_lightning.models.hf_schedule import ScheduleExportError, schedule_config

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
        "vocab_size": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _tiny(schedule, n_layers: int, d_model: int = 32) -> TinyGPT:
    m = TinyGPT(d_model=d_model, n_layers=n_layers, n_heads=2, max_seq_len=64, encoding=None)
    inject(m, schedule)
    return m


def test_smollm3_rnope_swa_matches_smollm3s_own_interval_convention():
    m = _tiny(build_preset("rnope_swa", window=16, theta=5e4), n_layers=8)
    keys = schedule_config(m, "smollm3")
    cfg = transformers.SmolLM3Config(num_hidden_layers=8, **TINY, **keys)
    # SmolLM3's own default: layer i is NoPE iff (i + 1) % no_rope_layer_interval == 0
    own = transformers.SmolLM3Config(num_hidden_layers=8, no_rope_layer_interval=4, **TINY)
    assert cfg.no_rope_layers == own.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0]
    assert cfg.layer_types == ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"]
    assert (cfg.sliding_window, cfg.use_sliding_window) == (16, True)
    assert cfg.rope_parameters["rope_theta"] == 5e4 and cfg.rope_parameters["rope_type"] == "default"
    cfg = transformers.SmolLM3Config.from_dict(cfg.to_dict())  # what config.json round-trips to
    hf = transformers.SmolLM3ForCausalLM(cfg)
    for block, layer in zip(m.blocks, hf.model.layers):
        assert bool(layer.self_attn.use_rope) == (block.attn.posenc.name == "rope")
        assert layer.self_attn.sliding_window == block.attn.posenc_window
    # the rotary table transformers builds equals the encoding's frequencies
    inv = m.blocks[0].attn.posenc.frequencies()[0]
    torch.testing.assert_close(hf.model.rotary_emb.inv_freq.double(), inv.double(), rtol=1e-6, atol=0)


def test_gemma3_local_global_matches_gemma3s_own_pattern():
    m = _tiny(build_preset("gemma3_local_global", window=16, local_theta=1e4, global_theta=1e6), n_layers=12)
    keys = schedule_config(m, "gemma3_text")
    cfg = transformers.Gemma3TextConfig(num_hidden_layers=12, head_dim=16, **TINY, **keys)
    own = transformers.Gemma3TextConfig(num_hidden_layers=12, sliding_window_pattern=6, **TINY)
    assert cfg.layer_types == own.layer_types
    assert [cfg.layer_types[i] for i in (4, 5, 11)] == ["sliding_attention", "full_attention", "full_attention"]
    assert cfg.sliding_window == 16
    assert cfg.rope_parameters == {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig.from_dict(cfg.to_dict()))
    for block, layer in zip(m.blocks, hf.model.layers):
        assert layer.self_attn.sliding_window == block.attn.posenc_window
    for t, i in (("sliding_attention", 0), ("full_attention", 5)):
        inv = m.blocks[i].attn.posenc.frequencies()[0]
        torch.testing.assert_close(getattr(hf.model.rotary_emb, f"{t}_inv_freq").double(), inv.double(),
                                   rtol=1e-6, atol=0)


@pytest.mark.parametrize("model_type,name,config", [
    ("llama", "rope", {"theta": 2e4}),
    ("llama", "yarn", {"factor": 4.0, "original_max_position_embeddings": 64}),
    ("llama", "pi", {"factor": 2.0, "original_max_position_embeddings": 64}),
    ("phi3", "rope", {"theta": 2e4, "partial_rotary_factor": 0.5}),
])
def test_uniform_law_and_partial_rotary(model_type, name, config):
    m = _tiny(LayerSchedule.uniform(name, **config), n_layers=3, d_model=64)  # head_dim 32
    keys = schedule_config(m, model_type)
    cls = transformers.AutoConfig.for_model(model_type).__class__
    cfg = cls(num_hidden_layers=3, **{**TINY, "hidden_size": 64}, **keys)
    assert cfg.rope_parameters["rope_type"] == {"rope": "default", "yarn": "yarn", "pi": "linear"}[name]
    assert cfg.rope_parameters.get("partial_rotary_factor", 1.0) == config.get("partial_rotary_factor", 1.0)
    hf = transformers.AutoModelForCausalLM.from_config(cls.from_dict(cfg.to_dict()))
    enc = m.blocks[0].attn.posenc
    inv, scale = enc.frequencies(enc.original_max_position_embeddings if name != "rope" else None)
    torch.testing.assert_close(hf.model.rotary_emb.inv_freq.double(), inv.double(), rtol=1e-6, atol=0)
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(scale, rel=1e-6)


LOCAL_GLOBAL = LayerSchedule([{"layers": "every 2", "encoding": "rope"}, {"layers": "rest", "encoding": "rope", "window": 8}])


@pytest.mark.parametrize("schedule,n,model_type,match", [
    (build_preset("smollm3_nope"), 4, "llama", r"layers \[3\] are NoPE; a llama config rotates every layer"),
    (build_preset("smollm3_nope"), 4, "gemma3_text", r"layers \[3\] are NoPE.*export to smollm3"),
    (LayerSchedule.uniform("rope", window=8), 2, "llama", r"layers \[0, 1\] have a sliding window; a llama config"),
    (LOCAL_GLOBAL, 4, "phi3", r"layers \[0, 2\] of 4 have a sliding window; a phi3 config's sliding_window is every"),
    (LayerSchedule.uniform("yarn", factor=2.0, original_max_position_embeddings=8), 2, "phi3",
     r"layer 0: yarn is rope_type 'yarn'; a phi3 config accepts only \('default', 'longrope'\)"),
    (LayerSchedule.uniform("rope", partial_rotary_factor=0.5), 2, "smollm3",
     r"layer 0: partial_rotary_factor=0.5: a smollm3 model rotates every channel.*\('phi3',\)"),
    (build_preset("irope", chunk=8), 4, "smollm3", r"layer 0: chunked attention \(chunk=8\) has no key"),
    (build_preset("p_rope", p=0.5), 2, "llama", r"layer 0: rope .* is no transformers rope law"),
    (LayerSchedule([{"layers": 0, "encoding": "alibi"}, {"layers": "rest", "encoding": "rope"}]), 2, "smollm3",
     r"layer 0: alibi acts at stages \['bias'\]"),
    (LayerSchedule([{"layers": 0, "encoding": "rope", "window": 8}, {"layers": "rest", "encoding": "rope",
                                                                      "window": 16}]), 2, "smollm3",
     r"layers 0 and 1 have different sliding_window \(8 vs 16\)"),
    (LayerSchedule([{"layers": 0, "encoding": "rope", "config": {"theta": 1e4}},
                    {"layers": "rest", "encoding": "rope", "config": {"theta": 1e5}}]), 2, "smollm3",
     r"layers 0 and 1 have different rope_parameters"),
    (LOCAL_GLOBAL, 4, "llama", r"layers \[0, 2\] have a sliding window"),
])
def test_refusals_say_why(schedule, n, model_type, match):
    with pytest.raises(ScheduleExportError, match=match):
        schedule_config(_tiny(schedule, n), model_type)


def test_gemma3_same_type_different_laws_and_unknown_model_type_are_refused():
    s = LayerSchedule([{"layers": 0, "encoding": "rope", "config": {"theta": 1e4}, "window": 8},
                       {"layers": "rest", "encoding": "rope", "config": {"theta": 2e4}, "window": 8}])
    with pytest.raises(ScheduleExportError, match="rope_parameters of its sliding_attention layers"):
        schedule_config(_tiny(s, 2), "gemma3_text")
    with pytest.raises(ValueError, match=r"model_type='gpt2' is not one of \('llama', 'smollm3', 'gemma3_text', 'phi3', 'llama4_text'\)"):
        schedule_config(_tiny(build_preset("smollm3_nope"), 4), "gpt2")


def test_llama4_irope_round_trips_through_transformers_own_reading():
    """iRoPE exported to ``llama4_text`` keys: the tiny transformers model built from them has NoPE
    layers, chunks, temperature and rope law where the schedule has them, read back by the adapter
    (`model_schedule`) as the same layers; with the schedule's weights the model equals TinyGPT's
    layers' encodings: the same name, config and chunk per layer."""
    from posenc_lightning.adapters.hf import model_schedule

    m = _tiny(build_preset("irope", chunk=8, theta=5e4, floor_scale=4.0, attn_scale=0.2), n_layers=8)
    keys = schedule_config(m, "llama4_text")
    assert keys["no_rope_layers"] == [1, 1, 1, 0, 1, 1, 1, 0]
    assert keys["layer_types"] == (["chunked_attention"] * 3 + ["full_attention"]) * 2
    assert (keys["attention_chunk_size"], keys["attn_temperature_tuning"]) == (8, True)
    assert (keys["floor_scale"], keys["attn_scale"]) == (4.0, 0.2)
    cfg = transformers.Llama4TextConfig(num_hidden_layers=8, head_dim=16, max_position_embeddings=64,
                                        num_local_experts=2, intermediate_size_mlp=64, **TINY, **keys)
    cfg = transformers.Llama4TextConfig.from_dict(cfg.to_dict())  # what config.json round-trips to
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    back = model_schedule(hf).resolve(8, cfg.layer_types)
    for block, spec in zip(m.blocks, back):
        enc = block.attn.posenc
        assert (spec.encoding, spec.chunk) == (enc.name, block.attn.posenc_chunk)
        if enc.name == "rope":
            assert (spec.config["theta"], spec.config["layout"]) == (5e4, "interleaved")
        else:
            assert spec.config == {"floor_scale": 4.0, "attn_scale": 0.2}


@pytest.mark.parametrize("schedule,match", [
    (LayerSchedule([{"layers": "every 4", "encoding": "nope"}, {"layers": "rest", "encoding": "rope", "chunk": 8}]),
     "rotates half pairs"),
    (LayerSchedule([{"layers": "every 4", "encoding": "nope"},
                    {"layers": "rest", "encoding": "rope", "config": {"layout": "interleaved"}, "window": 8}]),
     "sliding window"),
    (LayerSchedule([{"layers": [3], "encoding": "nope"}, {"layers": [7], "encoding": "log_temperature"},
                    {"layers": "rest", "encoding": "rope", "config": {"layout": "interleaved"}}]),
     "attn_temperature_tuning is every NoPE layer's"),
    (LayerSchedule([{"layers": "every 4", "encoding": "nope", "chunk": 8},
                    {"layers": "rest", "encoding": "rope", "config": {"layout": "interleaved"}}]),
     "chunked NoPE layers"),
])
def test_llama4_refuses_what_its_config_cannot_say(schedule, match):
    m = _tiny(schedule, n_layers=8)
    with pytest.raises(ScheduleExportError, match=match):
        schedule_config(m, "llama4_text")
