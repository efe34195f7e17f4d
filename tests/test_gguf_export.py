"""``posenc export --format gguf``: the rope-key mapping and the refusals (no llama.cpp needed), the
converted file's keys (llama.cpp's converter source needed), and llama.cpp end to end (llama_cpp needed).

The models are tiny random Llamas (built here, nothing downloaded) with a 300-token byte-fallback BPE
tokenizer trained here on a few strings (the converter needs a tokenizer). They are "trained" at
``ORIGINAL`` = 16 tokens and extended 8x: llama.cpp is compared with transformers on the same 128 token
ids (positions up to 8x the original length) and on greedy decoding with its KV cache.

Tolerance (f32 GGUF): max |llama.cpp - transformers| <= 1e-4 x max(1, max |logits|). The weights are
the trained float32 values bit for bit and llama.cpp keeps its KV cache in float32, so the two differ
only by the order of float32 sums (measured 3e-6 to 9e-6 of the logits' scale); a wrong rope law moves
the logits by far more (`test_the_comparison_tells_laws_apart`: over 0.1 x scale between laws).
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posenc_lightning import inject
from posenc_lightning.models.gguf_check import gguf_additions, gguf_precheck
from posenc_lightning.models.gguf_export import (
    ConverterMissing,
    GGUFRefused,
    converter_source,
    export_gguf,
    read_gguf,
)
from posenc_lightning.models.hf_export import export_pretrained
from posenc_lightning.models.llama_cpp_check import TOLERANCE, compare_llama_cpp, llama_cpp_available
from posenc_lightning.models.serving import export_facts
from tests.helpers import run_posenc

warnings.filterwarnings("ignore")
ORIGINAL, FACTOR, N = 16, 8.0, 128  # N = 8 x ORIGINAL
HALF = 8  # head_dim 16: 8 rotary frequencies
LAWS = {  # the test's name -> (posenc encoding, its arguments)
    "rope": ("rope", {}),
    "linear": ("pi", {"factor": FACTOR}),
    "yarn": ("yarn", {"factor": FACTOR}),
    # 16 positions: wavelengths 6.3 (kept), 20 and 63 (ramped), the rest (divided by 8)
    "llama3": ("llama3", {"factor": FACTOR, "low_freq_factor": 0.25, "high_freq_factor": 2.0}),
    "longrope": ("long_rope", {"factor": FACTOR, "short_factor": [1.0 + 0.05 * i for i in range(HALF)],
                               "long_factor": [1.0 + 1.5 * i for i in range(HALF)]}),
    # YaRN with DeepSeek's mscale pair: transformers' attention factor is not llama.cpp's 0.1 ln s + 1,
    # so posenc writes rope.scaling.attn_factor
    "yarn_mscale": ("yarn", {"factor": FACTOR, "mscale": 1.0, "mscale_all_dim": 0.5}),
}


def build_tokenizer(out: Path) -> int:
    """A Llama-2-style tokenizer (BPE, byte fallback, ``▁`` for spaces) of 300 tokens trained on a few
    strings; returns its size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    text = ["the quick brown fox jumps over the lazy dog", "positions beyond the trained length",
            "rotary embeddings rotate queries and keys"] * 4
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return tok.get_vocab_size()


def tiny_llama(vocab: int, model_type: str = "llama", **extra):
    """A random 2-layer Llama trained at ``ORIGINAL`` tokens; weights large enough (init 0.3) that the
    attention pattern, so the rope law, moves the logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=ORIGINAL, initializer_range=0.3, bos_token_id=1,
                               eos_token_id=2, **extra)
    return AutoModelForCausalLM.from_config(cfg).eval()


def with_law(vocab: int, key: str):
    name, cfg = LAWS[key]
    model = tiny_llama(vocab)
    inject(model, name, **cfg)
    return model


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> tuple[Path, int]:
    d = tmp_path_factory.mktemp("tok")
    return d, build_tokenizer(d)


@pytest.fixture(scope="module")
def hf_exports(tok_dir, tmp_path_factory) -> dict[str, str]:
    """``--format hf`` of every law (no converter needed)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for key in LAWS:
        export_pretrained(with_law(tok_dir[1], key), str(root / key), tokenizer_dir=str(tok_dir[0]))
        out[key] = str(root / key)
    return out


def _plan(path: str, posenc_keys: bool = True) -> dict[str, tuple[str | None, str]]:
    cfg = json.loads((Path(path) / "config.json").read_text())
    checks = gguf_precheck(export_facts(path), cfg.get("rope_parameters") or {}, posenc_keys=posenc_keys)
    return {c.field: (c.key, c.writer) for c in checks}


# ---- the key mapping (CI: no llama.cpp) ----

def test_each_law_maps_to_the_keys_the_llama_loader_reads(hf_exports):
    rope = _plan(hf_exports["rope"])
    assert rope["rope_theta"] == ("llama.rope.freq_base", "converter")
    assert rope["rope_type"][0] == "llama.rope.scaling.type = (not written: plain rope)"
    assert _plan(hf_exports["linear"])["factor"] == ("llama.rope.scaling.factor", "converter")
    yarn = _plan(hf_exports["yarn"])
    assert yarn["factor"] == ("llama.rope.scaling.factor", "converter")
    assert yarn["original_max_position_embeddings"] == ("llama.rope.scaling.original_context_length", "converter")
    assert yarn["beta_fast"][0] == yarn["beta_slow"][0] == yarn["truncate"][0] == "(none)"  # llama.cpp's defaults
    llama3 = _plan(hf_exports["llama3"])
    for field in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        assert llama3[field] == ("rope_freqs", "converter")
    longrope = _plan(hf_exports["longrope"])
    assert longrope["long_factor"] == ("rope_factors_long", "posenc")
    assert longrope["short_factor"] == ("rope_factors_short", "posenc")
    assert longrope["original_max_position_embeddings"] == ("llama.rope.scaling.original_context_length", "posenc")
    assert longrope["factor"] == ("llama.rope.scaling.attn_factor", "posenc")
    assert _plan(hf_exports["yarn_mscale"])["mscale_all_dim"] == ("llama.rope.scaling.attn_factor", "posenc")


def test_the_plain_converter_loses_what_posenc_adds(hf_exports):
    """Without posenc's additions (a plain convert_hf_to_gguf.py run) LongRoPE's factors and YaRN's
    mscale attention factor reach no key."""
    plain = _plan(hf_exports["longrope"], posenc_keys=False)
    assert plain["long_factor"][0] is None and plain["short_factor"][0] is None
    assert _plan(hf_exports["yarn_mscale"], posenc_keys=False)["mscale_all_dim"][0] is None
    assert None not in {k for k, _ in _plan(hf_exports["yarn"], posenc_keys=False).values()}


@pytest.mark.parametrize("key", ["longrope", "yarn_mscale"])
def test_added_attention_factor_is_transformers_own(hf_exports, key):
    """The attention factor posenc writes makes llama.cpp's cos/sin multiplier transformers' (YaRN:
    llama.cpp multiplies its own 0.1 ln s + 1 by rope.scaling.attn_factor; LongRoPE: by it alone)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = hf_exports[key]
    cfg = AutoConfig.from_pretrained(path)
    rope = cfg.rope_parameters
    _, hf_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    added = gguf_additions(export_facts(path), dict(rope))
    factor = added["float32"]["llama.rope.scaling.attn_factor"]
    llama_cpp_multiplier = factor * (1 + 0.1 * math.log(FACTOR)) if key == "yarn_mscale" else factor
    assert llama_cpp_multiplier == pytest.approx(hf_factor, rel=1e-12)
    assert abs(hf_factor - (1 + 0.1 * math.log(FACTOR))) > 0.1  # not llama.cpp's default: the key matters
    if key == "longrope":
        assert added["tensors"]["rope_factors_long.weight"] == LAWS[key][1]["long_factor"]
        assert added["uint32"]["llama.rope.scaling.original_context_length"] == ORIGINAL


# ---- refusals (CI: no llama.cpp, no converter: the check runs first) ----

def _refused(model, tmp_path, tok_dir) -> str:
    with pytest.raises(GGUFRefused) as info:
        export_gguf(model, str(tmp_path / "out"), converter=str(tmp_path / "no-such-converter"),
                    tokenizer_dir=str(tok_dir[0]))
    assert not (tmp_path / "out").exists()  # nothing written
    return str(info.value)


@pytest.mark.parametrize("name,cfg,reason", [
    ("dynamic_ntk", {"factor": FACTOR}, "the converter writes no scaling type for 'dynamic'"),
    ("yarn", {"factor": FACTOR, "beta_fast": 16.0}, "beta_fast=16.0 (the loader's default is 32"),
    ("yarn", {"factor": FACTOR, "truncate": False}, "truncate=False"),
    ("long_rope", {"factor": FACTOR, "n_hat": 2}, "GGUF has no term for a posenc encoding"),
    ("alibi", {}, "GGUF has no term for a posenc encoding"),
    ("rope", {"partial_rotary_factor": 0.5}, "a partial rotation would be a full one"),
])
def test_a_law_llama_cpp_cannot_express_is_refused(tok_dir, tmp_path, name, cfg, reason):
    model = tiny_llama(tok_dir[1])
    inject(model, name, **cfg)
    assert reason in _refused(model, tmp_path, tok_dir)


def test_an_architecture_other_than_llama_is_refused(tok_dir, tmp_path):
    model = tiny_llama(tok_dir[1], "qwen2")
    inject(model, "yarn", factor=FACTOR)
    assert "covers llama.cpp's LLaMA loader only" in _refused(model, tmp_path, tok_dir)


def test_missing_converter_names_the_serve_extra(tok_dir, tmp_path):
    with pytest.raises(ConverterMissing, match=r"posenc-lightning\[serve\]"):
        export_gguf(with_law(tok_dir[1], "yarn"), str(tmp_path / "out"), converter=str(tmp_path / "none"),
                    tokenizer_dir=str(tok_dir[0]))
    fake = tmp_path / "llama_cpp_python-0.3.35"  # a converter tree at another version
    (fake / "vendor" / "llama.cpp" / "conversion").mkdir(parents=True)
    (fake / "vendor" / "llama.cpp" / "gguf-py").mkdir()
    (fake / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").write_text("")
    (fake / "PKG-INFO").write_text("Version: 0.3.35\n")
    with pytest.raises(ConverterMissing, match=r"0\.3\.35, not the pinned 0\.3\.36"):
        converter_source(str(fake))


def test_no_tokenizer_is_an_error_before_converting(tok_dir, tmp_path):
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        export_gguf(with_law(tok_dir[1], "yarn"), str(tmp_path / "out"), converter=str(tmp_path / "none"))


def test_cli_refusal_exits_2_with_the_reason(tok_dir, tmp_path):
    model = tiny_llama(tok_dir[1])
    inject(model, "dynamic_ntk", factor=FACTOR)
    export_pretrained(model, str(tmp_path / "hf"), tokenizer_dir=str(tok_dir[0]))
    code, out = run_posenc("export", str(tmp_path / "hf"), str(tmp_path / "out"), "--format", "gguf")
    assert code == 2 and "no scaling type for 'dynamic'" in out


# ---- the converted file (llama.cpp's converter source needed) ----

def _converter() -> Path:
    try:
        return converter_source()
    except ConverterMissing as e:
        pytest.skip(f"llama.cpp converter source not found: {e}")


@pytest.fixture(scope="module")
def ggufs(tok_dir, tmp_path_factory) -> dict[str, dict]:
    """``--format gguf`` (f32) of every law: ``{key: export_gguf's result}``."""
    _converter()
    root = tmp_path_factory.mktemp("gguf")
    return {key: export_gguf(with_law(tok_dir[1], key), str(root / key), tokenizer_dir=str(tok_dir[0]))
            for key in LAWS}


def test_converted_files_hold_each_law(ggufs, hf_exports):
    keys = {k: r["keys"] for k, r in ggufs.items()}
    assert "llama.rope.scaling.type" not in keys["rope"] and keys["rope"]["llama.rope.freq_base"] == 10000.0
    assert keys["linear"]["llama.rope.scaling.type"] == "linear" and keys["linear"]["llama.rope.scaling.factor"] == 8
    assert keys["yarn"]["llama.rope.scaling.original_context_length"] == ORIGINAL
    assert "llama.rope.scaling.attn_factor" not in keys["yarn"]
    assert keys["longrope"]["llama.rope.scaling.type"] == "longrope"
    read = read_gguf(ggufs["longrope"]["gguf"])
    assert read["tensors"]["rope_factors_long.weight"]["values"] == pytest.approx(LAWS["longrope"][1]["long_factor"])
    assert read["tensors"]["rope_factors_short.weight"]["values"] == pytest.approx(LAWS["longrope"][1]["short_factor"])
    # llama3: the converter's rope_freqs tensor divides the frequencies to transformers' llama3 ones
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.from_pretrained(hf_exports["llama3"])
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    freqs = read_gguf(ggufs["llama3"]["gguf"])["tensors"]["rope_freqs.weight"]["values"]
    assert torch.tensor(freqs) == pytest.approx(base / inv_freq, rel=1e-6)
    assert min(freqs) == 1.0 and max(freqs) == pytest.approx(FACTOR)  # the three regimes of llama3
    assert any(1.0 < f < FACTOR - 1e-3 for f in freqs)


# ---- llama.cpp end to end (llama_cpp needed) ----

needs_llama_cpp = pytest.mark.skipif(not llama_cpp_available(),
                                     reason="llama_cpp (llama-cpp-python, pip install 'posenc-lightning[serve]') "
                                            "is not installed")


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, N), generator=torch.Generator().manual_seed(1))


@needs_llama_cpp
@pytest.mark.parametrize("key", list(LAWS))
def test_llama_cpp_equals_transformers_up_to_8x(ggufs, tok_dir, key):
    from transformers import AutoModelForCausalLM

    out = Path(ggufs[key]["gguf"]).parent
    served = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    err = compare_llama_cpp(ggufs[key]["gguf"], served, _ids(tok_dir[1]), prompt=N - 16)
    tol = TOLERANCE["f32"] * max(1.0, err["scale"])
    assert err["full"] <= tol, err
    assert err["cached"] <= tol, err
    assert err["greedy_equal"], (err["tokens"], err["reference_tokens"])
    assert len(set(err["tokens"])) > 1  # the decoding is not one repeated token


@needs_llama_cpp
def test_the_comparison_tells_laws_apart(ggufs, tok_dir):
    """The same weights under another law: llama.cpp's yarn file against transformers' plain rope
    and linear readings is off by far more than the tolerance (so the equality above is the law's)."""
    from transformers import AutoModelForCausalLM

    for other in ("rope", "linear"):
        served = AutoModelForCausalLM.from_pretrained(str(Path(ggufs[other]["gguf"]).parent)).eval()
        err = compare_llama_cpp(ggufs["yarn"]["gguf"], served, _ids(tok_dir[1]), prompt=N - 16)
        assert err["full"] > 0.1 * max(1.0, err["scale"]), (other, err)


@needs_llama_cpp
def test_cli_export_and_check_serving(ggufs, tmp_path):
    """``posenc export DIR OUT --format gguf`` from an export directory, then ``posenc check-serving``:
    llama.cpp measured equal, one summary line per engine."""
    src = Path(ggufs["llama3"]["gguf"]).parent
    code, out = run_posenc("export", str(src), str(tmp_path / "cli"), "--format", "gguf")
    assert code == 0 and "model-f32.gguf" in out, out
    code, out = run_posenc("check-serving", str(tmp_path / "cli"), "--engines", "transformers", "llama.cpp")
    assert code == 0, out
    assert "equal [measured, llama.cpp] model-f32.gguf (f32), 128 tokens" in out
    assert "  transformers: OK" in out and "  llama.cpp: OK" in out


@needs_llama_cpp
def test_check_serving_measures_a_plain_conversion_diverging(ggufs, hf_exports, tmp_path):
    """The plain converter on the YaRN mscale export (no posenc key): llama.cpp multiplies cos/sin by
    its own 1 + 0.1 ln 8 and check-serving measures it diverging."""
    import shutil
    import subprocess

    src = _converter()
    d = tmp_path / "plain"
    shutil.copytree(hf_exports["yarn_mscale"], d)
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(d), "--outfile", str(d / "plain.gguf"),
                    "--outtype", "f32"], cwd=str(src), check=True, capture_output=True)
    code, out = run_posenc("check-serving", str(d), "--engines", "llama.cpp")
    assert code == 1, out
    assert "DIVERGES [measured, llama.cpp] plain.gguf" in out and "greedy tokens" in out
    assert "llama.cpp: diverges: attention factor; GGUF cannot carry" in out and "measured logits" in out


@needs_llama_cpp
def test_trained_checkpoint_exports_through_the_cli(tok_dir, tmp_path):
    """A tiny Llama trained here (2 steps of `HFCausalLM` with PosEncCallback's yarn x8, sequences of
    ``ORIGINAL`` tokens), saved as a Lightning checkpoint, goes ``posenc export CKPT OUT --format gguf``;
    llama.cpp equals the trained model at 8x its training length, greedy tokens included."""
    from lightning.pytorch import Trainer

    from posenc_lightning import PosEncCallback
    from posenc_lightning.models.hf import HFCausalLM

    _converter()
    vocab = tok_dir[1]
    torch.manual_seed(0)
    module = HFCausalLM(config={"model_type": "llama", "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "max_position_embeddings": ORIGINAL, "initializer_range": 0.3, "bos_token_id": 1,
                                "eos_token_id": 2}, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(2)
    data = [(x[:-1], x[1:]) for x in torch.randint(3, vocab, (4, ORIGINAL + 1), generator=g)]
    trainer = Trainer(max_steps=2, callbacks=[PosEncCallback("yarn", factor=FACTOR)], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    trainer.save_checkpoint(str(tmp_path / "last.ckpt"))
    code, out = run_posenc("export", str(tmp_path / "last.ckpt"), str(tmp_path / "out"), "--format", "gguf",
                           "--tokenizer", str(tok_dir[0]))
    assert code == 0 and "gguf, yarn" in out, out
    err = compare_llama_cpp(str(tmp_path / "out" / "model-f32.gguf"), module.eval().model, _ids(vocab), prompt=N - 16)
    assert err["full"] <= TOLERANCE["f32"] * max(1.0, err["scale"]), err
    assert err["cached"] <= TOLERANCE["f32"] * max(1.0, err["scale"]), err
    assert err["greedy_equal"], err
