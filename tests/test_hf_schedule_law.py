"""One encoding injected by name into a model whose layers differ (`adapters.hf.with_law`): the
encoding takes the place of the positions of the layers that have them, and the layers without
(NoPE, Llama 4's temperature-only layers), windows and chunks stay. The reference is transformers
itself: the same model built with the law in its own ``rope_parameters``."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_hf_schedule import IDS, build, run

from posenc_lightning import inject, injected_spec
from posenc_lightning.adapters import hf as adapter

warnings.filterwarnings("ignore")

#: (law, our arguments, transformers' rope_parameters entries of the same law); the tiny models train at 64
LAWS = {
    "yarn": ({"factor": 4.0, "original_max_position_embeddings": 16},
             {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "pi": ({"factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    "llama3": ({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
               {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}),
}
CASES = [("smollm3", "yarn"), ("llama4_text", "llama3"), ("ergo", "yarn"), ("beam", "pi"), ("smollm3", "pi")]


def with_their_law(arch: str, entries: dict):
    """The tiny model with ``entries`` in its own rope_parameters (every rotary layer type)."""
    model = build(arch)
    cfg = model.config
    params = cfg.rope_parameters
    if any(isinstance(v, dict) or v is None for v in params.values()):  # per layer type
        new = {t: (None if v is None else {**v, **entries}) for t, v in params.items()}
    else:
        new = {**params, **entries}
    cfg.rope_parameters = new
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    theirs.load_state_dict(model.state_dict())
    return model, theirs


@pytest.mark.parametrize("arch,law", CASES)
def test_a_law_by_name_equals_transformers_own_law(arch: str, law: str) -> None:
    ours_cfg, their_entries = LAWS[law]
    ours, theirs = with_their_law(arch, their_entries)
    want, want_seq, want_steps = run(theirs)
    with torch.no_grad():
        plain = ours(IDS).logits
    assert (plain - want).abs().max() > 1e-4  # the law changes the logits: the test can fail
    inject(ours, law, **ours_cfg)
    got, seq, steps = run(ours)
    assert (got - want).abs().max() <= 1e-5
    assert torch.equal(seq, want_seq)
    assert max((a - b).abs().max().item() for a, b in zip(steps, want_steps)) <= 1e-5


def test_the_layers_without_positions_keep_theirs() -> None:
    """SmolLM3's NoPE layer stays NoPE under ALiBi; Llama 4's temperature layer keeps its
    temperature and its chunked layers their chunks; Ergo's windows stay."""
    smol = build("smollm3")
    inject(smol, "alibi")
    assert [m.posenc.name for m in adapter.attention_modules(smol)] == ["alibi"] * 3 + ["nope"]
    llama4 = build("llama4_text")
    inject(llama4, "yarn", factor=2.0)
    layers = adapter.attention_modules(llama4)
    assert [m.posenc.name for m in layers] == ["yarn"] * 3 + ["log_temperature"]
    assert [m.posenc_chunk for m in layers] == [8, 8, 8, None]
    assert {m.posenc.layout for m in layers[:3]} == {"interleaved"}  # the model's own rotation layout
    ergo = build("ergo")
    inject(ergo, "rope")
    assert [(m.posenc.name, m.posenc_window) for m in adapter.attention_modules(ergo)] == [("rope", 8), ("nope", None)] * 2


def test_the_same_law_again_keeps_the_trained_parameters_and_restore_gives_the_model_back() -> None:
    model = build("smollm3")
    with torch.no_grad():
        own = model(IDS).logits
    first = inject(model, "fire")
    with torch.no_grad():
        for p in first.parameters():
            p.add_(1.0)
    assert inject(model, "fire") is first  # a no-op: the trained parameters stay
    assert injected_spec(model)["encoding"] == "smollm3_own+fire"
    assert inject(model, "fire", backend="eager") is first
    inject(model, "alibi")
    assert adapter.attention_modules(model)[0].posenc.name == "alibi"
    adapter.restore(model)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, own)


def test_an_unknown_name_and_an_instance_are_refused_clearly() -> None:
    model = build("smollm3")
    with pytest.raises(ValueError, match="Unknown encoding 'ropee'. Did you mean 'rope'"):
        inject(model, "ropee")
    from posenc_lightning.encodings.rope import RoPE

    with pytest.raises(ValueError, match="per-layer schedule"):
        inject(model, RoPE())


EXPORTS = [("smollm3", "yarn"), ("llama4_text", "llama3"), ("ergo", "yarn"), ("beam", "pi"),
           ("gemma3_text", "pi"), ("cohere2", "yarn")]


@pytest.mark.parametrize("arch,law", EXPORTS)
def test_an_injected_law_exports_to_plain_transformers(arch: str, law: str, tmp_path) -> None:
    """`export_pretrained` writes the law into the model's own config shape (one law; one per layer
    type for Gemma 3, Ergo and Beam, NoPE types left None; Llama 4's and Cohere 2's adjacent pairs),
    and transformers alone loads the directory to the same logits."""
    from posenc_lightning.models.hf_export import export_pretrained

    model = build(arch)
    if getattr(model.config, "mlp_layer_types", None):  # the tiny config was shrunk to 4 layers after building
        model.config.mlp_layer_types = model.config.mlp_layer_types[:4]
    inject(model, law, **LAWS[law][0])
    with torch.no_grad():
        want = model(IDS).logits
    assert export_pretrained(model, str(tmp_path))["format"] == "transformers"
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        assert (back(IDS).logits - want).abs().max() <= 1e-5


def test_a_schedule_no_config_says_exports_in_posenc_format(tmp_path) -> None:
    """ALiBi put into SmolLM3's NoPE layer too (a user's schedule): no transformers config says it, so
    the export is posenc_lightning's own format (with its warning), never a plain config that drops it."""
    from posenc_lightning import LayerSchedule
    from posenc_lightning.models.hf_export import export_pretrained, load_pretrained

    model = build("smollm3")
    inject(model, LayerSchedule([{"layers": "rest", "encoding": "yarn", "config": LAWS["yarn"][0]},
                                 {"layers": [3], "encoding": "rope"}]))
    with torch.no_grad():
        want = model(IDS).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert export_pretrained(model, str(tmp_path))["format"] == "posenc_lightning"
    assert any("not a transformers rope law" in str(w.message) for w in caught)
    with torch.no_grad():
        assert (load_pretrained(str(tmp_path)).eval()(IDS).logits - want).abs().max() <= 1e-5
