"""The Hugging Face adapter against transformers' own implementations: rope laws equal a model
built with the matching ``rope_parameters`` (same weights), dynamic decoding without stale keys,
export that plain transformers loads, caches and padding, clear errors, replacing and restoring."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.hf_matrix import build, config, generate_error
from posenc_lightning import inject, injected_spec
from posenc_lightning.adapters import hf as adapter
from posenc_lightning.encodings.hf import from_hf
from posenc_lightning.models.hf_export import export_pretrained, load_pretrained, to_rope_parameters

warnings.filterwarnings("ignore")
L = 16  # the tiny models' max_position_embeddings
IDS = torch.randint(1, 64, (2, 40), generator=torch.Generator().manual_seed(3))
LONG_FACTORS = ([1.0, 1.1, 1.3, 1.6, 2.0, 2.4, 2.8, 3.0], [1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0])


def _llama(rope_parameters=None, max_pos=L, layers=2):
    cfg = transformers.LlamaConfig(**{k: v for k, v in config("llama").items() if k != "model_type"})
    cfg.max_position_embeddings, cfg.num_hidden_layers = max_pos, layers
    if rope_parameters is not None:
        cfg.rope_parameters = {"rope_theta": 10000.0, **rope_parameters}
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


LAWS = {  # ours (name, args) : transformers' rope_parameters, max_position_embeddings
    "linear": (("pi", {"factor": 4.0}), {"rope_type": "linear", "factor": 4.0}, L),
    "dynamic": (("dynamic_ntk", {"factor": 4.0}), {"rope_type": "dynamic", "factor": 4.0}, L),
    "yarn": (("yarn", {"factor": 4.0}), {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L},
             4 * L),
    "longrope": (("long_rope", {"short_factor": LONG_FACTORS[0], "long_factor": LONG_FACTORS[1], "factor": 4.0}),
                 {"rope_type": "longrope", "short_factor": LONG_FACTORS[0], "long_factor": LONG_FACTORS[1],
                  "original_max_position_embeddings": L}, 4 * L),
    "llama3": (("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
               {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": L}, 8 * L),
}


@pytest.mark.parametrize("law", list(LAWS))
def test_rope_law_equals_transformers_model_with_matching_rope_parameters(law):
    (name, cfg), params, max_pos = LAWS[law]
    theirs = _llama(params, max_pos)
    ours = _llama()
    ours.load_state_dict(theirs.state_dict())
    inject(ours, name, **cfg)
    with torch.no_grad():
        for n in (12, 40):  # inside and beyond the original length (the dynamic laws switch)
            a, b = ours(IDS[:, :n]).logits, theirs(IDS[:, :n]).logits
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the export is the same rope_parameters (and loads back to the same encoding)
    exported, _ = to_rope_parameters(ours.model.layers[0].self_attn.posenc if law in ("dynamic", "longrope")
                                     else ours.model.rotary_emb.posenc)
    for key, value in params.items():
        assert exported[key] == pytest.approx(value), key
    assert from_hf(exported, 16, max_pos).config() == from_hf(params | {"rope_theta": 10000.0}, 16, max_pos).config()


@pytest.mark.parametrize("layers", [1, 2])
def test_dynamic_ntk_decoding_past_the_original_length_equals_a_full_forward(layers):
    """Keys are cached un-rotated, so growing past L rotates every key with the new base: with one
    layer decoding equals a full forward exactly. transformers' own ``dynamic`` caches rotated keys,
    which go stale. With more layers a full forward also re-encodes the prefix's hidden states at the
    new base, which no cache keeps: ours then differs by that alone (numbers printed side by side)."""
    ours = _llama(layers=layers)
    theirs = _llama({"rope_type": "dynamic", "factor": 4.0}, layers=layers)
    theirs.load_state_dict(ours.state_dict())
    inject(ours, "dynamic_ntk", factor=4.0)
    prompt = IDS[:, :10]
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0

    def decode_error(model):
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
            errs = []
            for t, lg in enumerate(out.logits):
                m = torch.cat((mask, torch.ones(2, t, dtype=mask.dtype)), 1)
                pos = (m.cumsum(-1) - 1).clamp_min(0)
                full = model(out.sequences[:, :10 + t], attention_mask=m, position_ids=pos, use_cache=False).logits
                errs.append((full[:, -1] - lg).abs().max().item())
        return max(errs)

    ours_err, theirs_err = decode_error(ours), decode_error(theirs)
    print(f"dynamic decoding to 30 tokens (L=16, {layers} layers) vs full forward: "
          f"posenc {ours_err:.2g}, transformers {theirs_err:.2g}")
    assert ours_err < (1e-5 if layers == 1 else 1e-3)
    assert theirs_err > 5 * ours_err  # transformers' stale rotated keys


@pytest.mark.parametrize("name,cfg", [("yarn", {"factor": 4.0}), ("dynamic_ntk", {"factor": 4.0}),
                                      ("long_rope", {"factor": 4.0}), ("ntk", {"factor": 2.0})])
def test_rope_family_export_loads_in_plain_transformers_with_equal_logits(tmp_path, name, cfg):
    module = build("phi")  # partial rotary
    inject(module, name, **cfg)
    with torch.no_grad():
        ref = module.model(IDS).logits
    result = export_pretrained(module, str(tmp_path))
    assert result["format"] == "transformers"
    assert not (tmp_path / "posenc_lightning.json").exists()
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True).eval()
    assert plain.config.rope_parameters["partial_rotary_factor"] == 0.5
    with torch.no_grad():
        torch.testing.assert_close(plain(IDS).logits, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch,name", [("gpt2", "alibi"), ("llama", "fire"), ("qwen2", "fox"), ("llama", "nope")])
def test_other_encodings_export_and_reload_with_posenc(tmp_path, arch, name):
    module = build(arch)
    inject(module, name)
    for p in module.parameters():  # make the encoding's parameters differ from a fresh init
        if p.requires_grad:
            p.data.add_(0.01)
    with torch.no_grad():
        ref = module.model(IDS[:, :24]).logits
    with pytest.warns(UserWarning, match="load_pretrained"):
        result = export_pretrained(module, str(tmp_path))
    assert result["format"] == "posenc_lightning"
    back = load_pretrained(str(tmp_path)).eval()
    assert injected_spec(back)["encoding"] == name
    with torch.no_grad():
        torch.testing.assert_close(back(IDS[:, :24]).logits, ref, atol=0, rtol=0)
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True).eval()
    with torch.no_grad():
        assert (plain(IDS[:, :24]).logits - ref).abs().max() > 1e-4  # the encoding is not there without posenc


@pytest.mark.parametrize("name", ["fire", "relative_bias", "rope_alibi"])
def test_static_cache_keys_get_their_positions(name):
    """A static cache hands the whole max_cache_len buffer to attention: key positions come from the
    recorded cache length (a bias not linear in distance would be wrong otherwise)."""
    module = build("llama")
    inject(module, name)
    ids = IDS[:, :12]
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        out = module.model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                                    cache_implementation="static", output_logits=True, return_dict_in_generate=True)
        for t, lg in enumerate(out.logits):
            m = torch.cat((mask, torch.ones(2, t, dtype=mask.dtype)), 1)
            full = module.model(out.sequences[:, :12 + t], attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp_min(0),
                                use_cache=False).logits
            torch.testing.assert_close(lg, full[:, -1], atol=2e-5, rtol=1e-5)


def test_fox_with_a_static_cache_is_a_clear_error():
    module = build("llama")
    inject(module, "fox")
    with pytest.raises(ValueError, match="dynamic cache"):
        module.model.generate(IDS[:, :6], max_new_tokens=2, do_sample=False, pad_token_id=0,
                              cache_implementation="static")


def test_found_at_any_depth_of_a_plain_lightning_module_and_trains():
    """A user's LightningModule holding the model in a dict of modules: no code change."""
    import lightning.pytorch as pl

    class Mine(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.nets = torch.nn.ModuleDict({"lm": build("qwen2").model})

        def training_step(self, batch, _):
            return self.nets["lm"](batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    from posenc_lightning import PosEncCallback

    module = Mine()
    table = [p for n, p in module.named_parameters() if "posenc" in n]
    assert not table
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(IDS), batch_size=2)
    pl.Trainer(max_steps=2, callbacks=[PosEncCallback("relative_bias")], logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(module, data)
    trained = {n: p for n, p in module.named_parameters() if "posenc" in n}
    assert trained and all(p.grad is not None for p in trained.values())
    assert injected_spec(module)["encoding"] == "relative_bias"


def test_model_defaults_fill_the_encoding_arguments():
    module = build("gpt_neox")  # rotary_pct 0.25
    enc = inject(module, "yarn", factor=4.0)
    assert enc.original_max_position_embeddings == L and enc.partial_rotary_factor == 0.25 and enc.theta == 10000.0
    enc = inject(module, "yarn", factor=4.0, original_max_position_embeddings=8)
    assert enc.original_max_position_embeddings == 8


def test_replacing_restores_the_original_positions_first():
    module = build("gpt2")
    hf = module.model
    wpe = hf.transformer.wpe
    with torch.no_grad():
        original = hf(IDS[:, :20]).logits
    inject(module, "alibi")
    assert hf.config._attn_implementation == "posenc_fused" and hf.transformer.wpe is not wpe
    inject(module, "nope")  # replaces alibi: wpe still removed, the user's sdpa back
    assert hf.config._attn_implementation == "sdpa"
    assert all(getattr(m, "posenc", None) is None for m in adapter.attention_modules(hf))
    adapter.restore(hf)
    assert hf.transformer.wpe is wpe
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS[:, :20]).logits, original, atol=0, rtol=0)


def test_wrapping_the_users_eager_attention():
    module = build("llama")
    module.model.set_attn_implementation("eager")
    inject(module, "long_rope", factor=4.0)  # past L from the prompt on: the long factors throughout
    assert module.model.config._attn_implementation == "posenc_wrap_eager"
    assert generate_error(module.model, IDS[:, :20], torch.ones(2, 20, dtype=torch.long)) < 1e-5


@pytest.mark.parametrize("name", ["alibi", "fire", "yarn", "sba"])
def test_bf16_model(name):
    module = build("llama").to(torch.bfloat16)
    inject(module, name, **({"factor": 4.0} if name == "yarn" else {}))
    with torch.no_grad():
        out = module.model(IDS[:, :20]).logits
    assert out.dtype == torch.bfloat16 and out.isfinite().all()
    ref = build("llama")
    inject(ref, name, **({"factor": 4.0} if name == "yarn" else {}))
    with torch.no_grad():
        assert (ref.model(IDS[:, :20]).logits - out.float()).abs().max() < 0.1


def test_clear_errors():
    module = build("llama")
    with pytest.raises(ValueError, match="no position-embedding table"):
        inject(module, "sinusoidal")
    with pytest.raises(ValueError, match="Unknown encoding"):
        inject(module, "alibbi")
    fresh = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(module.model.config))
    inject(module, "alibi")
    twin = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(module.model.config))  # config says posenc
    with pytest.raises(ValueError, match="no encoding is injected"):
        twin(IDS[:, :4])
    fresh(IDS[:, :4])


def test_old_transformers_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.46.0")
    with pytest.raises(ValueError, match="transformers >= 5.0"):
        adapter.require_transformers()


@pytest.mark.parametrize("name", ["fire", "fox", "dynamic_ntk"])
def test_gradient_checkpointing_gives_the_same_gradients(name):
    """transformers' gradient checkpointing re-runs each layer in backward: the pre-hook records the
    same call again, so the encoding's and the model's gradients are unchanged."""
    grads = []
    for ckpt in (False, True):
        module = build("llama").train()
        inject(module, name, **({"factor": 4.0} if name == "dynamic_ntk" else {}))
        if ckpt:
            module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        module.model(IDS[:, :24], labels=IDS[:, :24]).loss.backward()
        grads.append({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-6, rtol=1e-5)
