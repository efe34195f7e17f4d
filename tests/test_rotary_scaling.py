"""Rotary context extension: equality with Hugging Face and with the papers' formulas."""

from __future__ import annotations

import math

import pytest
import torch

from posenc_lightning.encodings import build_encoding, from_hf
from posenc_lightning.encodings.hf import hf_rope_laws
from posenc_lightning.encodings.rope_scaling import DynamicNTK, Llama3, LongRoPE, YaRN
from posenc_lightning.functional.rope_scaling import yarn_find_correction_dim

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

FACTORS = (1, 2, 4, 8, 16, 40)
HEAD_DIMS = (64, 128)
ORIGINALS = (512, 2048, 4096)
THETAS = (10000.0, 500000.0)
GRID = [(f, d, o) for f in FACTORS for d in HEAD_DIMS for o in ORIGINALS]


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=1e-6, atol=0)


def hf_config(head_dim: int, max_pos: int, params: dict, original: int | None = None) -> LlamaConfig:
    cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                      max_position_embeddings=max_pos, rope_parameters=dict(params))
    if original is not None:
        cfg.original_max_position_embeddings = original
    return cfg


def hf(rope_type: str, head_dim: int, max_pos: int, params: dict, seq_len: int | None = None):
    cfg = hf_config(head_dim, max_pos, {"rope_type": rope_type, **params})
    if rope_type == "default":
        inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"), seq_len=seq_len)


def ours(params: dict, head_dim: int, max_pos: int, seq_len: int | None = None):
    enc = from_hf(params, head_dim, max_pos)
    return enc.frequencies(seq_len, torch.device("cpu"))


# ------------------------------------------------------------------ Hugging Face, every rope_type
@pytest.mark.parametrize("theta", THETAS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_default_matches_hf(theta, head_dim):
    p = {"rope_type": "default", "rope_theta": theta}
    inv, s = ours(p, head_dim, 4096)
    ref, rs = hf("default", head_dim, 4096, {"rope_theta": theta})
    close(inv, ref)
    assert s == rs == 1.0


@pytest.mark.parametrize("factor,head_dim,original", GRID)
def test_linear_matches_hf(factor, head_dim, original):
    p = {"rope_type": "linear", "factor": float(factor), "rope_theta": 10000.0}
    inv, s = ours(p, head_dim, original * factor)
    ref, rs = hf("linear", head_dim, original * factor, p)
    close(inv, ref)
    assert s == rs


@pytest.mark.parametrize("factor,head_dim,original", GRID)
def test_dynamic_matches_hf(factor, head_dim, original):
    p = {"rope_type": "dynamic", "factor": float(factor), "rope_theta": 10000.0}
    for seq_len in (original // 2, original, original + 1, 3 * original, factor * original):
        inv, s = ours(p, head_dim, original, seq_len)
        ref, rs = hf("dynamic", head_dim, original, p, seq_len)
        close(inv, ref)
        assert s == rs


@pytest.mark.parametrize("factor,head_dim,original", GRID)
@pytest.mark.parametrize("variant", ["plain", "deepseek", "no_truncate", "explicit", "betas", "theta"])
def test_yarn_matches_hf(factor, head_dim, original, variant):
    p = {"rope_type": "yarn", "factor": float(factor), "rope_theta": 10000.0,
         "original_max_position_embeddings": original}
    p.update({"plain": {}, "deepseek": {"mscale": 0.707, "mscale_all_dim": 1.0}, "no_truncate": {"truncate": False},
              "explicit": {"attention_factor": 0.9}, "betas": {"beta_fast": 16.0, "beta_slow": 2.0},
              "theta": {"rope_theta": 500000.0}}[variant])
    inv, s = ours(p, head_dim, original * factor)
    ref, rs = hf("yarn", head_dim, original * factor, p)
    close(inv, ref)
    assert s == pytest.approx(rs, rel=1e-12)


@pytest.mark.parametrize("factor,head_dim,original", GRID)
def test_llama3_matches_hf(factor, head_dim, original):
    p = {"rope_type": "llama3", "factor": float(factor), "rope_theta": 500000.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": original}
    inv, s = ours(p, head_dim, original * factor)
    ref, rs = hf("llama3", head_dim, original * factor, p)
    close(inv, ref)
    assert s == rs


def _longrope_factors(n: int, factor: float, seed: int) -> tuple[list[float], list[float]]:
    g = torch.Generator().manual_seed(seed)
    short = (1.0 + 0.1 * torch.rand(n, generator=g)).tolist()
    long = torch.sort(1.0 + (factor - 1.0) * torch.rand(n, generator=g)).values.tolist()  # monotone
    return short, long


@pytest.mark.parametrize("factor,head_dim,original", GRID)
@pytest.mark.parametrize("explicit_factor", [True, False])
def test_longrope_matches_hf(factor, head_dim, original, explicit_factor):
    short, long = _longrope_factors(head_dim // 2, factor, factor * head_dim + original)
    p = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
         "short_factor": short, "long_factor": long}
    if explicit_factor:
        p["factor"] = float(factor)
    for seq_len in (None, original // 2, original, original + 1, factor * original + 7):
        inv, s = ours(p, head_dim, original * factor, seq_len)
        ref, rs = hf("longrope", head_dim, original * factor, p, seq_len)
        close(inv, ref)
        assert s == pytest.approx(rs, rel=1e-12)


def test_longrope_phi3_style_top_level_original():
    """Phi-3 keeps original_max_position_embeddings on the config, not in the dict."""
    short, long = _longrope_factors(48, 32.0, 1)
    p = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short, "long_factor": long}
    cfg = hf_config(96, 131072, p, original=4096)
    ref, rs = ROPE_INIT_FUNCTIONS["longrope"](cfg, torch.device("cpu"), seq_len=5000)
    inv, s = from_hf(p, 96, 131072, original_max_position_embeddings=4096).frequencies(5000)
    close(inv, ref)
    assert s == pytest.approx(rs, rel=1e-12)


def test_from_hf_rejects_unknown_and_incomplete():
    with pytest.raises(ValueError, match="supported"):
        from_hf({"rope_type": "su"}, 64, 4096)
    with pytest.raises(ValueError, match="factor"):
        from_hf({"rope_type": "linear"}, 64, 4096)


# ------------------------------------------------------------------ the papers' formulas
def _rope(d: int, b: float) -> list[float]:
    return [b ** (-2 * i / d) for i in range(d // 2)]


def _assert_list(inv: torch.Tensor, ref: list[float]) -> None:
    close(inv, torch.tensor(ref, dtype=torch.float64))


@pytest.mark.parametrize("factor,head_dim,original", GRID)
def test_pi_ntk_dynamic_paper_formulas(factor, head_dim, original):
    d, b, s = head_dim, 10000.0, float(factor)
    pi = build_encoding("pi", factor=s).bind(head_dim=d)
    _assert_list(pi.frequencies()[0], [t / s for t in _rope(d, b)])  # Chen et al. eq. 2
    ntk = build_encoding("ntk", factor=s).bind(head_dim=d)
    _assert_list(ntk.frequencies()[0], _rope(d, b * s ** (d / (d - 2))))  # bloc97
    dyn = DynamicNTK(factor=s, original_max_position_embeddings=original).bind(head_dim=d)
    for L in (original // 2, original, 5 * original):
        s_eff = max(1.0, s * L / original - (s - 1))  # emozilla: alpha grows with L
        _assert_list(dyn.frequencies(L)[0], _rope(d, b * s_eff ** (d / (d - 2))))


@pytest.mark.parametrize("factor,head_dim,original", GRID)
def test_yarn_paper_formula(factor, head_dim, original):
    """Peng et al. eq. 17-22: r(d) = L / lambda_d; gamma = 0 below alpha=1, 1 above beta=32;
    h(theta_d) = (1 - gamma) theta_d / s + gamma theta_d; sqrt(1/t) = 0.1 ln s + 1."""
    d, b, s = head_dim, 10000.0, float(factor)
    enc = YaRN(factor=s, original_max_position_embeddings=original, truncate=False).bind(head_dim=d)
    inv, scale = enc.frequencies()
    theta = _rope(d, b)
    assert scale == pytest.approx(0.1 * math.log(s) + 1 if s > 1 else 1.0, rel=1e-12)
    for i, t in enumerate(theta):
        r = original / (2 * math.pi / t)
        if r > 32:
            assert inv[i].item() == pytest.approx(t, rel=1e-6)
        elif r < 1:
            assert inv[i].item() == pytest.approx(t / s, rel=1e-6)
        else:
            assert t / s * (1 - 1e-6) <= inv[i].item() <= t * (1 + 1e-6)
    # the ramp ends are where the number of rotations is exactly beta_fast / beta_slow
    for beta in (32.0, 1.0):
        dim_f = yarn_find_correction_dim(beta, d, b, original)
        lam = 2 * math.pi * b ** (2 * dim_f / d)
        assert original / lam == pytest.approx(beta, rel=1e-9)
    # monotone: lower frequencies are interpolated at least as much
    ratio = inv / torch.tensor(theta)
    assert torch.all(ratio[1:] <= ratio[:-1] + 1e-6)


@pytest.mark.parametrize("factor,head_dim,original", GRID)
def test_llama3_reference_code(factor, head_dim, original):
    """Meta's ``apply_scaling`` (llama-models), transcribed as the loop it is."""
    d, b, s, lo, hi = head_dim, 500000.0, float(factor), 1.0, 4.0
    new = []
    for f in _rope(d, b):
        wl = 2 * math.pi / f
        if wl < original / hi:
            new.append(f)
        elif wl > original / lo:
            new.append(f / s)
        else:
            sm = (original / wl - lo) / (hi - lo)
            new.append((1 - sm) * f / s + sm * f)
    enc = Llama3(factor=s, original_max_position_embeddings=original, theta=b).bind(head_dim=d)
    _assert_list(enc.frequencies()[0], new)


@pytest.mark.parametrize("factor,head_dim,original", GRID)
def test_longrope_paper_formula(factor, head_dim, original):
    """Ding et al. eq. 4: theta_i / lambda_i; Phi-3's scale sqrt(1 + ln s / ln L_orig)."""
    short, long = _longrope_factors(head_dim // 2, factor, 7)
    enc = LongRoPE(factor=float(factor), short_factor=short, long_factor=long,
                   original_max_position_embeddings=original).bind(head_dim=head_dim)
    th = _rope(head_dim, 10000.0)
    inv_s, sc = enc.frequencies(original)
    inv_l, _ = enc.frequencies(original + 1)
    _assert_list(inv_s, [t / lam for t, lam in zip(th, short)])
    _assert_list(inv_l, [t / lam for t, lam in zip(th, long)])
    want = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    assert sc == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------ identities
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("theta", THETAS)
def test_yarn_factor_one_is_rope(head_dim, theta):
    rope = build_encoding("rope", theta=theta).bind(head_dim=head_dim)
    yarn = build_encoding("yarn", factor=1.0, theta=theta).bind(head_dim=head_dim)
    inv, scale = yarn.frequencies()
    close(inv, rope.frequencies()[0])
    assert scale == 1.0
    pos = torch.tensor([[0, 5, 1000, 4095]])  # fp32 angles: 1 ulp of inv_freq x 4095 < 1e-5
    for a, b in zip(yarn.cos_sin(pos), rope.cos_sin(pos)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_pi_is_rope_at_positions_over_s(factor, layout):
    rope = build_encoding("rope", layout=layout).bind(n_heads=2, head_dim=64)
    pi = build_encoding("pi", factor=float(factor), layout=layout).bind(n_heads=2, head_dim=64)
    pos = torch.tensor([[0, 1, 2, 17, 300, 4095]])
    c1, s1 = pi.cos_sin(pos)
    c2, s2 = rope.cos_sin(pos.double() / factor)
    torch.testing.assert_close(c1, c2.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s1, s2.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["pi", "ntk", "dynamic_ntk", "yarn", "llama3", "long_rope"])
def test_set_scale_invalidates_cached_tables(name):
    enc = build_encoding(name, factor=2.0, original_max_position_embeddings=16).bind(n_heads=2, head_dim=32)
    pos = torch.arange(40)[None]
    before = enc.cos_sin(pos, seq_len=40)
    enc.set_scale(8.0)
    assert enc.factor == 8.0
    after = enc.cos_sin(pos, seq_len=40)
    inv, sc = enc.frequencies(40)
    ang = pos[..., None].float() * inv
    torch.testing.assert_close(after[0], ang.cos() * sc)
    torch.testing.assert_close(after[1], ang.sin() * sc)
    assert not torch.allclose(before[1], after[1])
    with pytest.raises(ValueError, match="factor must be a positive"):
        enc.set_scale(0.0)


def test_long_rope_set_factors_and_switch():
    enc = LongRoPE(factor=4.0, original_max_position_embeddings=16).bind(n_heads=2, head_dim=8)
    assert enc.factors(16) == [1.0] * 4 and enc.factors(17) == [4.0] * 4
    enc.set_scale(2.0)  # the default long set follows the scale (pi-like)
    assert enc.factors(17) == [2.0] * 4
    k16, k17 = enc.frequencies_key(16), enc.frequencies_key(17)
    assert k16 != k17
    enc.set_factors(long_factor=[1.0, 1.5, 2.0, 3.0])
    assert enc.frequencies_key(17) != k17
    close(enc.frequencies(17)[0], 1.0 / (torch.tensor([1.0, 1.5, 2.0, 3.0]) * 10000 ** (torch.arange(0, 8, 2) / 8)))
    with pytest.raises(ValueError, match="rotary_dim/2 = 4"):
        enc.set_factors(short_factor=[1.0, 1.0])


@pytest.mark.parametrize("seq_len", [16, 40])
def test_long_rope_n_hat_keeps_the_first_positions_uninterpolated(seq_len):
    """LongRoPE sec. 3.2: angle ``n I(lambda_i, n_hat) theta_i`` with ``I = 1`` for ``n < n_hat``
    and ``1 / lambda_i`` after, at any positions (offsets, unsorted, a decode step), cos/sin
    scaled alike; n_hat is part of the cache key and of config(); 0 is HF's longrope."""
    short, long = [1.0, 1.2, 1.5, 2.0], [1.0, 2.0, 3.0, 4.0]
    enc = LongRoPE(factor=4.0, short_factor=short, long_factor=long, original_max_position_embeddings=16,
                   n_hat=5).bind(n_heads=2, head_dim=8)
    lam = torch.tensor(short if seq_len <= 16 else long, dtype=torch.float64)
    theta = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    sc = math.sqrt(1 + math.log(4.0) / math.log(16))
    positions = (torch.arange(seq_len)[None], torch.tensor([[7, 0, 4, 5, 30, 2]]),
                 torch.tensor([[4]]), torch.tensor([[5]]))
    for pos in positions:
        n = pos[..., None].double()
        ang = torch.where(n < 5, n * theta, n * theta / lam)
        cos, sin = enc.cos_sin(pos, seq_len)
        torch.testing.assert_close(cos.double(), ang.cos() * sc, rtol=0, atol=2e-6)
        torch.testing.assert_close(sin.double(), ang.sin() * sc, rtol=0, atol=2e-6)
    key = enc.frequencies_key(seq_len)
    enc.set_factors(n_hat=0)
    assert enc.frequencies_key(seq_len) != key
    hf_like = LongRoPE(factor=4.0, short_factor=short, long_factor=long,
                       original_max_position_embeddings=16).bind(n_heads=2, head_dim=8)
    pos = torch.arange(seq_len)[None]
    assert all(torch.equal(a, b) for a, b in zip(enc.cos_sin(pos, seq_len), hf_like.cos_sin(pos, seq_len)))
    enc.set_factors(n_hat=3)
    assert build_encoding("long_rope", **enc.config()).n_hat == 3
    with pytest.raises(ValueError, match="n_hat must be a whole number"):
        enc.set_factors(n_hat=-1)


@pytest.mark.parametrize("name", ["pi", "yarn", "long_rope", "dynamic_ntk"])
def test_config_records_run_time_scale_and_factors(name):
    """config() (logged, saved) rebuilds the encoding as it is *now*, after set_scale/set_factors."""
    enc = build_encoding(name, factor=2.0, original_max_position_embeddings=16).bind(head_dim=8)
    enc.set_scale(5.0)
    if name == "long_rope":
        enc.set_factors(short_factor=[1.0, 1.0, 1.1, 1.2], long_factor=[1.0, 2.0, 4.0, 5.0])
    again = build_encoding(name, **enc.config()).bind(head_dim=8)
    for L in (8, 40):
        inv, sc = enc.frequencies(L)
        inv2, sc2 = again.frequencies(L)
        assert torch.equal(inv, inv2) and sc == sc2


HF_MODULE_CASES = {
    "default": {},
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 4.0},
    "yarn": {"factor": 8.0, "original_max_position_embeddings": 64},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "longrope": {"original_max_position_embeddings": 64, "short_factor": [1.0 + 0.01 * i for i in range(16)],
                 "long_factor": [1.0 + 0.5 * i for i in range(16)]},
}


#: the rope_types the project claims (docs/guides/huggingface.md, Export); transformers also knows
#: others (5.x: ``proportional``, Gemma 4's), which `from_hf` refuses
CLAIMED = {"default", "linear", "dynamic", "yarn", "longrope", "llama3"}


def test_every_claimed_rope_type_is_a_declared_law_compared_with_transformers():
    """The laws' own table (`hf_rope_laws`, from each class's ``hf_rope_type``) is the claimed set;
    transformers knows each of them, and each is compared with its module below (and with
    ``ROPE_INIT_FUNCTIONS`` in the tests above)."""
    laws = hf_rope_laws()
    assert set(laws) == CLAIMED == set(HF_MODULE_CASES)
    assert CLAIMED - {"default"} <= set(ROPE_INIT_FUNCTIONS)  # "default" is plain rope there
    for rope_type, cls in laws.items():
        p = {"rope_type": rope_type, "rope_theta": 10000.0, **HF_MODULE_CASES[rope_type]}
        assert type(from_hf(p, 32, 256)) is cls


@pytest.mark.parametrize("rope_type", list(HF_MODULE_CASES))
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_cos_sin_match_hf_rotary_module(rope_type, partial):
    """End to end against ``LlamaRotaryEmbedding`` (its dynamic/longrope updates included):
    the attention scaling folded into cos/sin, partial rotary, lengths on both sides of the switch."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    if rope_type == "default" and partial != 1.0:
        pytest.skip("Llama's default rope init ignores partial_rotary_factor")
    head_dim = 64 if partial == 0.5 else 32
    p = {"rope_type": rope_type, "rope_theta": 10000.0, "partial_rotary_factor": partial, **HF_MODULE_CASES[rope_type]}
    max_pos = 256 if rope_type == "longrope" else 64
    for n in (40, 200):
        hf_mod = LlamaRotaryEmbedding(hf_config(head_dim, max_pos, p))
        pos = torch.arange(n)[None]
        c_ref, s_ref = hf_mod(torch.zeros(1, dtype=torch.float32), pos)
        enc = from_hf(p, head_dim, max_pos)
        c, s = enc.cos_sin(pos, seq_len=n)
        torch.testing.assert_close(torch.cat((c, c), -1), c_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.cat((s, s), -1), s_ref, rtol=1e-5, atol=1e-5)
