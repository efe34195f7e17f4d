"""Per-layer schedules in Hugging Face models (`adapters._hf_schedule`): the model's own schedule,
read from its config and injected back, gives transformers' own logits and cached greedy decoding
(the model itself is the reference); a changed schedule changes them; restore gives the model back."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hf_archs import tiny_config
from posenc_lightning import LayerSchedule, inject, injected_spec
from posenc_lightning.adapters import hf as adapter
from posenc_lightning.adapters._hf_schedule import model_schedule

warnings.filterwarnings("ignore")
IDS = torch.randint(1, 64, (2, 21), generator=torch.Generator().manual_seed(0))
PROMPT, NEW = 9, 8  # decoding runs past the windows and chunks of 8 (keys evicted from the cache)
SLIDING = ["sliding_attention", "full_attention"] * 2
#: per architecture: config overrides of a 4-layer tiny model whose schedule matters within 21 tokens
ARCHS = {
    "smollm3": {"layer_types": ["full_attention"] * 4},  # no_rope_layers: layer 3 is NoPE
    "gemma3_text": {"layer_types": SLIDING},
    "cohere2": {"layer_types": SLIDING},  # its full layers skip the rotation: a global NoPE layer
    "ergo": {"layer_types": SLIDING},  # full_attention's rope_parameters are None: NoPE
    "beam": {"layer_types": SLIDING, "topk_group": 1},
    "gpt_oss": {"layer_types": SLIDING},
    "llama4_text": {"layer_types": ["chunked_attention"] * 3 + ["full_attention"], "attention_chunk_size": 8,
                    "floor_scale": 4},  # the NoPE layer's temperature steps every 4 tokens
}


def build(arch: str):
    cfg = tiny_config(arch)
    cfg.num_hidden_layers = 4
    for key, value in ARCHS[arch].items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if arch == "gpt_oss":  # sinks far from 0, so that dropping them could not pass
        with torch.no_grad():
            for m in adapter.attention_modules(model):
                m.sinks.normal_(0.0, 2.0)
    return model


def run(model) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Full-forward logits, and greedy cached ``generate``'s tokens and step logits."""
    with torch.no_grad():
        logits = model(IDS).logits
        out = model.generate(IDS[:, :PROMPT], attention_mask=torch.ones(2, PROMPT, dtype=torch.long),
                             max_new_tokens=NEW, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return logits, out.sequences, list(out.logits)


def specs(model) -> list[tuple[str, dict, int | None, int | None]]:
    s = model_schedule(model).resolve(model.config.num_hidden_layers, model.config.layer_types)
    return [(x.encoding, x.config, x.window, x.chunk) for x in s]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_models_own_schedule_reinjected_gives_its_logits_and_decoding(arch: str) -> None:
    model = build(arch)
    own, own_seq, own_steps = run(model)
    schedule = model_schedule(model)
    inject(model, schedule)
    assert model.config._attn_implementation == "posenc_fused"
    assert injected_spec(model)["schedule"] == schedule.to_dict()
    logits, seq, steps = run(model)
    assert (logits - own).abs().max() <= 1e-5
    assert torch.equal(seq, own_seq)
    assert max((a - b).abs().max().item() for a, b in zip(steps, own_steps)) <= 1e-5
    adapter.restore(model)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, own)


def test_what_the_schedules_read_is_the_configs() -> None:
    smol = specs(build("smollm3"))
    assert [s[0] for s in smol] == ["rope", "rope", "rope", "nope"]  # no_rope_layers [1, 1, 1, 0, ...]
    assert smol[0][1]["theta"] == 2e6 and {s[2] for s in smol} == {None}
    gemma = specs(build("gemma3_text"))
    assert [(s[1]["theta"], s[2]) for s in gemma] == [(1e4, 8), (1e6, None)] * 2  # per-layer-type bases
    for arch in ("cohere2", "ergo", "beam"):
        assert [(s[0], s[2]) for s in specs(build(arch))] == [("rope", 8), ("nope", None)] * 2, arch
    assert specs(build("cohere2"))[0][1]["layout"] == "interleaved"
    oss = specs(build("gpt_oss"))
    assert {s[0] for s in oss} == {"yarn"} and oss[0][1]["factor"] == 32.0 and [s[2] for s in oss] == [8, None] * 2
    llama4 = specs(build("llama4_text"))
    assert [(s[0], s[3]) for s in llama4] == [("rope", 8)] * 3 + [("log_temperature", None)]
    assert llama4[3][1] == {"floor_scale": 4.0, "attn_scale": 0.1} and llama4[0][1]["layout"] == "interleaved"


@pytest.mark.parametrize("arch,rules", [
    ("smollm3", [{"layers": "rest", "encoding": "rope"}]),  # the NoPE layer rotated
    ("gemma3_text", [{"layers": "type:sliding_attention", "encoding": "rope", "window": 4},
                     {"layers": "rest", "encoding": "rope"}]),  # a shorter window
    ("cohere2", [{"layers": "rest", "encoding": "rope", "window": 8}]),  # no global layer
    ("llama4_text", [{"layers": "every 4", "encoding": "nope"}, {"layers": "rest", "encoding": "rope", "chunk": 8}]),
    ("gpt_oss", [{"layers": "rest", "encoding": "rope"}]),  # plain rope, no window
])
def test_a_changed_schedule_changes_the_logits(arch: str, rules: list) -> None:
    """Each change moves the logits by over 10x the equality bound above (re-injection errs by <= 5e-7)."""
    model = build(arch)
    with torch.no_grad():
        own = model(IDS).logits
    inject(model, LayerSchedule(rules))
    with torch.no_grad():
        assert (model(IDS).logits - own).abs().max() > 1e-4


def test_a_users_schedule_takes_each_layer_types_base_from_the_model() -> None:
    """Rules without ``theta`` get the base of each layer's own type (Gemma 3: 10k local, 1M global)."""
    model = build("gemma3_text")
    with torch.no_grad():
        own = model(IDS).logits
    inject(model, LayerSchedule([{"layers": "type:sliding_attention", "encoding": "rope", "window": 8},
                                 {"layers": "type:full_attention", "encoding": "rope"}]))
    thetas = [m.posenc.theta for m in adapter.attention_modules(model)]
    assert thetas == [1e4, 1e6, 1e4, 1e6]
    with torch.no_grad():
        assert (model(IDS).logits - own).abs().max() <= 1e-5


def test_llama4s_own_temperature_is_off_while_the_schedule_carries_it() -> None:
    """The schedule's ``log_temperature`` replaces the layer's own (not applied twice); restore switches it back."""
    model = build("llama4_text")
    layer = adapter.attention_modules(model)[3]
    inject(model, model_schedule(model))
    assert layer.attn_temperature_tuning is False and layer.posenc.name == "log_temperature"
    adapter.restore(model)
    assert layer.attn_temperature_tuning is True and layer.posenc is None


def test_a_bias_in_a_scheduled_layer_decodes_as_its_full_forward() -> None:
    """ALiBi on SmolLM3's NoPE layer, RoPE in a window elsewhere: cached decoding equals a full forward."""
    model = build("smollm3")
    inject(model, LayerSchedule([{"layers": [3], "encoding": "alibi"},
                                 {"layers": "rest", "encoding": "rope", "window": 6}]))
    _, seq, steps = run(model)
    with torch.no_grad():
        full = model(seq[:, :-1]).logits[:, PROMPT - 1:]
    assert max((step - full[:, i]).abs().max().item() for i, step in enumerate(steps)) <= 1e-5


def test_a_schedule_on_a_model_with_an_absolute_table_is_refused() -> None:
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("gpt2")).eval()
    with pytest.raises(ValueError, match="wpe"):
        inject(model, LayerSchedule([{"layers": "rest", "encoding": "alibi"}]))


def test_a_checkpoint_brings_a_scheduled_hf_model_back() -> None:
    """The spec names the schedule; re-injected before the state dict loads, a learned encoding's
    parameters (FIRE in the NoPE layer) come back and so do the logits."""
    from posenc_lightning.inject import CHECKPOINT_KEY, restore_from_checkpoint

    model = build("smollm3")
    inject(model, LayerSchedule([{"layers": [3], "encoding": "fire"}, {"layers": "rest", "encoding": "rope"}]))
    with torch.no_grad():
        for p in adapter.attention_modules(model)[3].posenc.parameters():
            p.add_(torch.randn_like(p))  # away from the initialisation a fresh build would give
        want = model(IDS).logits
    fresh = build("smollm3")
    restore_from_checkpoint(fresh, {CHECKPOINT_KEY: injected_spec(model)})
    fresh.load_state_dict(model.state_dict())
    assert adapter.attention_modules(fresh)[3].posenc.name == "fire"
    with torch.no_grad():
        assert torch.equal(fresh(IDS).logits, want)


@pytest.mark.parametrize("arch", ["gpt_oss", "llama4_text", "cohere2"])
def test_training_gradients_equal_the_models_own(arch: str) -> None:
    """Every parameter's gradient of a language-model loss (gpt-oss's sinks, through the dense path,
    included) equals transformers' own eager attention's, within 1e-5 of its largest entry (fp32;
    measured <= 9.3e-7). Not in float64: transformers computes its cos/sin in float32 whatever the
    model's dtype, and gpt-oss's grouped experts take no float64."""
    theirs = build(arch)
    theirs.set_attn_implementation("eager")
    ours = build(arch)
    ours.load_state_dict(theirs.state_dict())
    inject(ours, model_schedule(ours))
    for model in (theirs, ours):
        model(IDS, labels=IDS).loss.backward()
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        ref = grads[name].grad
        assert (p.grad is None) == (ref is None), name
        if ref is not None:
            assert (p.grad - ref).abs().max() <= 1e-5 * ref.abs().max(), name


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss", "cohere2", "llama4_text"])
def test_left_padded_decoding_equals_the_models_own(arch: str) -> None:
    """Row 1 left-padded by 3: pads attend only pads, windows count them as transformers does (by
    index), chunks start at the row's first token (as transformers shifts them by the padding)."""
    ids, mask = IDS[:, :PROMPT].clone(), torch.ones(2, PROMPT, dtype=torch.long)
    ids[1, :3], mask[1, :3] = 0, 0
    model = build(arch)
    outs = []
    for step in range(2):
        if step:
            inject(model, model_schedule(model))
        with torch.no_grad():
            outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                       output_logits=True, return_dict_in_generate=True))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert max((a - b).abs().max().item() for a, b in zip(outs[0].logits, outs[1].logits)) <= 1e-5


def test_a_schedule_replaces_and_is_replaced_by_one_encoding() -> None:
    """Schedule, then ALiBi everywhere (the windows go), then the schedule again (the logits come back);
    the same schedule with another backend keeps the encodings and switches the backend."""
    model = build("gemma3_text")
    with torch.no_grad():
        own = model(IDS).logits
    schedule = model_schedule(model)
    inject(model, schedule)
    inject(model, "alibi")
    layers = adapter.attention_modules(model)
    assert all(m.posenc.name == "alibi" and getattr(m, "posenc_window", None) is None for m in layers)
    first = inject(model, schedule)
    assert inject(model, schedule, backend="eager") is first
    assert [m.posenc_backend for m in layers] == ["eager"] * 4 and [m.posenc_window for m in layers] == [8, None] * 2
    with torch.no_grad():
        assert (model(IDS).logits - own).abs().max() <= 1e-5
