"""Frequency laws of the rotary context-extension methods (pure functions, float32).

Each returns inverse frequencies ``inv_freq [dim/2]`` (and, where the method has one, the
attention scaling folded into cos/sin), computed exactly as the Hugging Face
``transformers.modeling_rope_utils`` functions compute them, so the numbers match to fp32
rounding:

* position interpolation (Chen et al., 2023, eq. 2): ``f'(x, m) = f(x, m / s)``, i.e. ``theta_i / s``;
* NTK-aware base change (bloc97, 2023): ``b' = b * s^(d / (d - 2))``;
* dynamic NTK (emozilla, 2023): the same with ``s' = s * L / L_orig - (s - 1)`` for ``L > L_orig``;
* YaRN (Peng et al., 2023, eq. 17-21): "NTK-by-parts" ramp ``gamma(r)`` between interpolation and
  extrapolation on the number of rotations ``r = L_orig / lambda_d``, and ``sqrt(1/t) = 0.1 ln s + 1``;
* Llama 3.1 (Meta, 2024): wavelength bands with a smooth interpolation between them;
* LongRoPE (Ding et al., 2024, eq. 4): per-dimension rescale factors ``lambda_i``:
  ``theta_i' = theta_i / lambda_i``, attention scale ``sqrt(1 + ln s / ln L_orig)``;
* Resonance RoPE (Wang et al., 2024, eq. 7): wavelengths rounded to integers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "dynamic_ntk_base",
    "dynamic_ntk_inv_freq",
    "llama3_inv_freq",
    "longrope_attention_factor",
    "longrope_inv_freq",
    "ntk_base",
    "ntk_inv_freq",
    "pi_inv_freq",
    "resonance_inv_freq",
    "yarn_attention_factor",
    "yarn_find_correction_dim",
    "yarn_find_correction_range",
    "yarn_get_mscale",
    "yarn_inv_freq",
    "yarn_linear_ramp",
]


def _exponents(dim: int, device: torch.device | None = None) -> Tensor:
    """``2i / dim`` for i in [0, dim/2), float32 (HF: ``arange(0, dim, 2, int64).float() / dim``)."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim


def _base_inv_freq(dim: int, base: float, device: torch.device | None = None) -> Tensor:
    return 1.0 / (base ** _exponents(dim, device))


# ------------------------------------------------------------------ position interpolation
def pi_inv_freq(dim: int, base: float, factor: float, device: torch.device | None = None) -> Tensor:
    """Linear position interpolation: ``theta_i / s`` (== rope at positions ``m / s``)."""
    return _base_inv_freq(dim, base, device) / factor


# ------------------------------------------------------------------ NTK-aware
def ntk_base(base: float, factor: float, dim: int) -> float:
    """NTK-aware scaled base ``b * s^(d/(d-2))``: the lowest frequency is interpolated by s,
    the highest is kept (bloc97)."""
    return base * factor ** (dim / (dim - 2))


def ntk_inv_freq(dim: int, base: float, factor: float, device: torch.device | None = None) -> Tensor:
    return _base_inv_freq(dim, ntk_base(base, factor, dim), device)


def dynamic_ntk_base(base: float, factor: float, dim: int, seq_len: int | None, original_max: int) -> float:
    """Dynamic NTK: ``b * (s * L / L_orig - (s - 1))^(d/(d-2))`` with ``L = max(seq_len, L_orig)``."""
    seq_len = original_max if seq_len is None else max(int(seq_len), original_max)
    return base * ((factor * seq_len / original_max) - (factor - 1)) ** (dim / (dim - 2))


def dynamic_ntk_inv_freq(dim: int, base: float, factor: float, seq_len: int | None, original_max: int,
                         device: torch.device | None = None) -> Tensor:
    return _base_inv_freq(dim, dynamic_ntk_base(base, factor, dim, seq_len, original_max), device)


# ------------------------------------------------------------------ YaRN
def yarn_find_correction_dim(num_rotations: float, dim: int, base: float, original_max: int) -> float:
    """The dimension whose wavelength fits ``num_rotations`` times in ``L_orig`` (YaRN eq. 16-17)."""
    return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_find_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float, original_max: int,
                               truncate: bool = True) -> tuple[float, float]:
    """``(low, high)`` dimension bounds of the ramp; floored/ceiled when ``truncate``."""
    low = yarn_find_correction_dim(beta_fast, dim, base, original_max)
    high = yarn_find_correction_dim(beta_slow, dim, base, original_max)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_linear_ramp(low: float, high: float, n: int, device: torch.device | None = None) -> Tensor:
    """``clamp((i - low) / (high - low), 0, 1)`` for i in [0, n) (YaRN's ``gamma``, inverted)."""
    if low == high:
        high += 0.001  # avoid a singular ramp
    ramp = (torch.arange(n, dtype=torch.float32) - low) / (high - low)
    return torch.clamp(ramp, 0, 1).to(device)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """``0.1 * mscale * ln(s) + 1`` for s > 1, else 1 (YaRN eq. 22: ``sqrt(1/t)``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None,
                          attention_factor: float | None = None) -> float:
    """The cos/sin scale: explicit, or DeepSeek's ``mscale/mscale_all_dim`` ratio, or ``get_mscale(s)``."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
    return float(yarn_get_mscale(factor))


def yarn_inv_freq(dim: int, base: float, factor: float, original_max: int, beta_fast: float = 32,
                  beta_slow: float = 1, truncate: bool = True, device: torch.device | None = None) -> Tensor:
    """NTK-by-parts: ``(1 - gamma) * theta / s + gamma * theta``, gamma = 1 (extrapolate) for
    dimensions rotating more than ``beta_fast`` times in ``L_orig``, 0 below ``beta_slow``."""
    pos_freqs = base ** _exponents(dim, device)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    low, high = yarn_find_correction_range(beta_fast, beta_slow, dim, base, original_max, truncate)
    extra = 1 - yarn_linear_ramp(low, high, dim // 2, device)
    # lerp == HF's ``inter * (1 - extra) + extra_freq * extra`` to an ulp, and exact at the ramp's
    # ends and for factor 1 (so yarn(1) is bitwise rope)
    return torch.lerp(inv_inter, inv_extra, extra)


# ------------------------------------------------------------------ Llama 3.1
def llama3_inv_freq(dim: int, base: float, factor: float, original_max: int, low_freq_factor: float = 1.0,
                    high_freq_factor: float = 4.0, device: torch.device | None = None) -> Tensor:
    """Wavelengths below ``L_orig / high_freq_factor`` kept, above ``L_orig / low_freq_factor``
    divided by ``factor``, smoothly interpolated between."""
    inv_freq = _base_inv_freq(dim, base, device)
    low_wavelen = original_max / low_freq_factor
    high_wavelen = original_max / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, out)


# ------------------------------------------------------------------ LongRoPE
def longrope_inv_freq(dim: int, base: float, ext_factors: Sequence[float] | Tensor,
                      device: torch.device | None = None) -> Tensor:
    """``1 / (lambda_i * b^(2i/d))`` with per-dimension rescale factors ``lambda_i``."""
    lam = torch.as_tensor(ext_factors, dtype=torch.float32, device=device)
    if lam.shape != (dim // 2,):
        raise ValueError(f"long_rope: need {dim // 2} rescale factors (rotary_dim/2), got {tuple(lam.shape)}")
    return 1.0 / (lam * base ** _exponents(dim, device))


def longrope_attention_factor(factor: float, original_max: int, attention_factor: float | None = None) -> float:
    """``sqrt(1 + ln s / ln L_orig)`` for s > 1, else 1 (or the explicit value)."""
    if attention_factor is not None:
        return float(attention_factor)
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original_max))


# ------------------------------------------------------------------ Resonance RoPE
def resonance_inv_freq(inv_freq: Tensor) -> Tensor:
    """``2 pi / round(2 pi / theta_i)``: every wavelength an integer number of tokens."""
    wavelen = (2 * math.pi / inv_freq.double()).round().clamp_min(1.0)
    return (2 * math.pi / wavelen).to(inv_freq.dtype)
