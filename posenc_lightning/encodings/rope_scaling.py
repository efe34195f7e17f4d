"""Rotary context extension: pi, ntk, dynamic_ntk, yarn, llama3, long_rope.

Each is a `RotaryEncoding` with its own frequency law (`posenc_lightning.functional.rope_scaling`)
and the Hugging Face ``rope_parameters`` semantics. All have ``factor`` and ``set_scale(factor)``
(the context curriculum calls it every step); the cos/sin cache is keyed on `frequencies_key`,
which includes the factor, so a new scale never reuses a stale table.

``dynamic_ntk`` and ``long_rope`` depend on the current length (largest key position + 1), so
they are ``dynamic``: the KV cache keeps their keys un-rotated and all keys are rotated with the
current frequencies at attend time. Unlike HF's stateful ``dynamic_rope_update`` (which keeps
the largest length seen), the frequencies here are a pure function of the current length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from posenc_lightning.encodings.registry import register
from posenc_lightning.encodings.rope import RoPE, RotaryEncoding
from posenc_lightning.functional.rope import rope_cos_sin
from posenc_lightning.functional.rope_scaling import (
    dynamic_ntk_inv_freq,
    llama3_inv_freq,
    longrope_attention_factor,
    longrope_inv_freq,
    ntk_inv_freq,
    pi_inv_freq,
    yarn_attention_factor,
    yarn_inv_freq,
)

Layout = Literal["half", "interleaved"]


class ScaledRotary(RotaryEncoding):
    """A rotary encoding with a run-time scale ``factor`` over ``original_max_position_embeddings``."""

    scalable = True

    def __init__(self, factor: float = 4.0, original_max_position_embeddings: int = 512, theta: float = 10000.0,
                 layout: Layout = "half", partial_rotary_factor: float = 1.0) -> None:
        super().__init__(theta=theta, layout=layout, partial_rotary_factor=partial_rotary_factor)
        if int(original_max_position_embeddings) < 1:
            raise ValueError(f"{self.name}: original_max_position_embeddings must be >= 1, "
                             f"got {original_max_position_embeddings}")
        self.original_max_position_embeddings = int(original_max_position_embeddings)
        self.factor = 1.0
        self.set_scale(factor)

    def set_scale(self, factor: float) -> None:
        """Change the scale at run time; the cos/sin table is rebuilt on next use."""
        factor = float(factor)
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"{self.name}: factor must be a positive number (1 = no scaling), got {factor}")
        self.factor = factor

    def _law_key(self) -> tuple:
        return ()

    def config(self) -> dict[str, Any]:
        """The init args with the *current* scale (after `set_scale`), for logs and re-building."""
        return {**super().config(), "factor": self.factor}

    def frequencies_key(self, seq_len: int | None) -> Any:
        return (self.name, self.factor, self.theta, self.original_max_position_embeddings) + self._law_key()


@register("pi", "rotate", "Position interpolation: rope at positions m/s (Chen et al., 2023)")
class PositionInterpolation(ScaledRotary):
    """PI (Chen et al., 2023, eq. 2): ``f'(x, m) = f(x, m L / L')``; implemented as ``theta_i / s``
    like HF's ``linear`` rope_type."""

    hf_rope_type: ClassVar[str | None] = "linear"

    def __init__(self, factor: float = 4.0, original_max_position_embeddings: int = 512, theta: float = 10000.0,
                 layout: Layout = "half", partial_rotary_factor: float = 1.0) -> None:
        super().__init__(factor, original_max_position_embeddings, theta, layout, partial_rotary_factor)

    @classmethod
    def config_from_rope_parameters(cls, rope_parameters: dict[str, Any], max_position_embeddings: int,
                                    original_max_position_embeddings: int) -> dict[str, Any]:
        return {**super().config_from_rope_parameters(rope_parameters, max_position_embeddings,
                                                      original_max_position_embeddings),
                "factor": float(cls._required(rope_parameters, "factor")),
                "original_max_position_embeddings": original_max_position_embeddings}

    def _rope_law_parameters(self) -> tuple[dict[str, Any], int | None] | None:
        return {"factor": self.factor}, None

    def frequencies(self, seq_len: int | None = None, device: torch.device | None = None) -> tuple[Tensor, float]:
        return pi_inv_freq(self.rotary_dim, self.theta, self.factor, device), 1.0


@register("ntk", "rotate", "NTK-aware scaled rope: base b*s^(d/(d-2)) (bloc97, 2023)")
class NTKAware(ScaledRotary):
    """NTK-aware interpolation: rope with base ``theta * factor^(d/(d-2))`` at every length.

    No transformers rope_type reads back as it (``hf_rope_type`` None): it is written as plain rope
    (``default``) with that base, which transformers reads as `RoPE`."""

    hf_rope_type: ClassVar[str | None] = None

    def __init__(self, factor: float = 4.0, original_max_position_embeddings: int = 512, theta: float = 10000.0,
                 layout: Layout = "half", partial_rotary_factor: float = 1.0) -> None:
        super().__init__(factor, original_max_position_embeddings, theta, layout, partial_rotary_factor)

    def to_rope_parameters(self, layout: str = "half") -> tuple[dict[str, Any], int | None] | None:
        if type(self) is not NTKAware:  # a subclass may change the law
            return None
        d = self.rotary_dim  # a new base: b' = b s^(d/(d-2)) (bloc97)
        return RoPE(theta=self.theta * self.factor ** (d / (d - 2)), layout=self.layout,
                    partial_rotary_factor=self.partial_rotary_factor).to_rope_parameters(layout)

    def frequencies(self, seq_len: int | None = None, device: torch.device | None = None) -> tuple[Tensor, float]:
        return ntk_inv_freq(self.rotary_dim, self.theta, self.factor, device), 1.0


@register("dynamic_ntk", "rotate", "Dynamic NTK: base grows with the current length (HF 'dynamic')")
class DynamicNTK(ScaledRotary):
    """Dynamic NTK scaling (HF ``dynamic``): base ``theta * (s L / L_orig - (s - 1))^(d/(d-2))``
    with L the current length (largest key position + 1); plain rope for ``L <= L_orig``.
    HF's ``max_position_embeddings`` is ``original_max_position_embeddings`` here."""

    dynamic = True
    hf_rope_type: ClassVar[str | None] = "dynamic"

    def __init__(self, factor: float = 4.0, original_max_position_embeddings: int = 512, theta: float = 10000.0,
                 layout: Layout = "half", partial_rotary_factor: float = 1.0) -> None:
        super().__init__(factor, original_max_position_embeddings, theta, layout, partial_rotary_factor)

    @classmethod
    def config_from_rope_parameters(cls, rope_parameters: dict[str, Any], max_position_embeddings: int,
                                    original_max_position_embeddings: int) -> dict[str, Any]:
        # HF's dynamic law measures lengths against config.max_position_embeddings
        return {**super().config_from_rope_parameters(rope_parameters, max_position_embeddings,
                                                      original_max_position_embeddings),
                "factor": float(cls._required(rope_parameters, "factor")),
                "original_max_position_embeddings": int(max_position_embeddings)}

    def _rope_law_parameters(self) -> tuple[dict[str, Any], int | None] | None:
        # transformers measures the length against max_position_embeddings
        return {"factor": self.factor}, self.original_max_position_embeddings

    def _effective_len(self, seq_len: int | None) -> int:
        return max(int(seq_len or 0), self.original_max_position_embeddings)

    def frequencies(self, seq_len: int | None = None, device: torch.device | None = None) -> tuple[Tensor, float]:
        return dynamic_ntk_inv_freq(self.rotary_dim, self.theta, self.factor, self._effective_len(seq_len),
                                    self.original_max_position_embeddings, device), 1.0

    def frequencies_key(self, seq_len: int | None) -> Any:
        return super().frequencies_key(seq_len) + (self._effective_len(seq_len),)


@register("yarn", "rotate", "YaRN: NTK-by-parts ramp + attention temperature (Peng et al., 2023)")
class YaRN(ScaledRotary):
    """YaRN (Peng et al., 2023, eq. 17-22), HF ``yarn`` semantics: NTK-by-parts,
    ``theta_i' = (1 - gamma_i) theta_i / s + gamma_i theta_i`` with ``gamma_i`` ramping from 0 to 1
    as dimension i's rotations over the original length go from ``beta_slow`` to ``beta_fast``, and
    the logits scaled by ``(0.1 ln s + 1)^2`` (folded into cos/sin).

    Args:
        beta_fast: rotation count above which a dimension is not interpolated (32 in the paper).
        beta_slow: rotation count below which a dimension is fully interpolated (1 in the paper).
        mscale: DeepSeek's attention factor ``get_mscale(s, mscale) / get_mscale(s, mscale_all_dim)``.
        mscale_all_dim: see ``mscale``.
        attention_factor: explicit cos/sin scale (default ``0.1 ln s + 1``).
        truncate: floor/ceil the ramp bounds (HF default True; gpt-oss uses False).
    """

    hf_rope_type: ClassVar[str | None] = "yarn"

    def __init__(self, factor: float = 4.0, original_max_position_embeddings: int = 512, theta: float = 10000.0,
                 beta_fast: float = 32.0, beta_slow: float = 1.0, mscale: float | None = None,
                 mscale_all_dim: float | None = None, attention_factor: float | None = None, truncate: bool = True,
                 layout: Layout = "half", partial_rotary_factor: float = 1.0) -> None:
        self.beta_fast, self.beta_slow = float(beta_fast), float(beta_slow)
        self.mscale, self.mscale_all_dim = mscale, mscale_all_dim
        self.attention_factor, self.truncate = attention_factor, bool(truncate)
        super().__init__(factor, original_max_position_embeddings, theta, layout, partial_rotary_factor)

    def _law_key(self) -> tuple:
        return (self.beta_fast, self.beta_slow, self.mscale, self.mscale_all_dim, self.attention_factor,
                self.truncate)

    @classmethod
    def config_from_rope_parameters(cls, rope_parameters: dict[str, Any], max_position_embeddings: int,
                                    original_max_position_embeddings: int) -> dict[str, Any]:
        p, original = rope_parameters, original_max_position_embeddings
        factor = p.get("factor")
        factor = max_position_embeddings / original if factor is None else float(factor)
        return {**super().config_from_rope_parameters(p, max_position_embeddings, original),
                "factor": factor, "original_max_position_embeddings": original,
                "beta_fast": p.get("beta_fast") or 32.0, "beta_slow": p.get("beta_slow") or 1.0,
                "mscale": p.get("mscale"), "mscale_all_dim": p.get("mscale_all_dim"),
                "attention_factor": p.get("attention_factor"), "truncate": p.get("truncate", True)}

    def _rope_law_parameters(self) -> tuple[dict[str, Any], int | None] | None:
        c, orig = self.config(), self.original_max_position_embeddings
        return {"factor": self.factor, "original_max_position_embeddings": orig, "beta_fast": c["beta_fast"],
                "beta_slow": c["beta_slow"], "mscale": c["mscale"], "mscale_all_dim": c["mscale_all_dim"],
                "attention_factor": c["attention_factor"], "truncate": c["truncate"]}, round(self.factor * orig)

    def attention_scaling(self) -> float:
        return yarn_attention_factor(self.factor, self.mscale, self.mscale_all_dim, self.attention_factor)

    def frequencies(self, seq_len: int | None = None, device: torch.device | None = None) -> tuple[Tensor, float]:
        inv = yarn_inv_freq(self.rotary_dim, self.theta, self.factor, self.original_max_position_embeddings,
                            self.beta_fast, self.beta_slow, self.truncate, device)
        return inv, self.attention_scaling()


@register("llama3", "rotate", "Llama 3.1 rope scaling: wavelength bands, smooth in between")
class Llama3(ScaledRotary):
    """Llama 3.1 frequency scaling (HF ``llama3``): wavelengths ``2 pi / theta_i`` longer than
    ``L_orig / low_freq_factor`` are divided by ``factor``, those shorter than
    ``L_orig / high_freq_factor`` kept, and the band between interpolated smoothly. Llama 3.1 uses
    factor 8 with bands 1 and 4."""

    hf_rope_type: ClassVar[str | None] = "llama3"

    def __init__(self, factor: float = 4.0, original_max_position_embeddings: int = 512, theta: float = 10000.0,
                 low_freq_factor: float = 1.0, high_freq_factor: float = 4.0, layout: Layout = "half",
                 partial_rotary_factor: float = 1.0) -> None:
        if not high_freq_factor > low_freq_factor:
            raise ValueError(f"llama3: high_freq_factor ({high_freq_factor}) must exceed low_freq_factor "
                             f"({low_freq_factor})")
        self.low_freq_factor, self.high_freq_factor = float(low_freq_factor), float(high_freq_factor)
        super().__init__(factor, original_max_position_embeddings, theta, layout, partial_rotary_factor)

    def _law_key(self) -> tuple:
        return (self.low_freq_factor, self.high_freq_factor)

    @classmethod
    def config_from_rope_parameters(cls, rope_parameters: dict[str, Any], max_position_embeddings: int,
                                    original_max_position_embeddings: int) -> dict[str, Any]:
        p = rope_parameters
        return {**super().config_from_rope_parameters(p, max_position_embeddings, original_max_position_embeddings),
                "factor": float(cls._required(p, "factor")),
                "original_max_position_embeddings": original_max_position_embeddings,
                "low_freq_factor": float(cls._required(p, "low_freq_factor")),
                "high_freq_factor": float(cls._required(p, "high_freq_factor"))}

    def _rope_law_parameters(self) -> tuple[dict[str, Any], int | None] | None:
        c, orig = self.config(), self.original_max_position_embeddings
        law = {"factor": self.factor, "original_max_position_embeddings": orig,
               "low_freq_factor": c["low_freq_factor"], "high_freq_factor": c["high_freq_factor"]}
        return law, round(self.factor * orig)

    def frequencies(self, seq_len: int | None = None, device: torch.device | None = None) -> tuple[Tensor, float]:
        return llama3_inv_freq(self.rotary_dim, self.theta, self.factor, self.original_max_position_embeddings,
                               self.low_freq_factor, self.high_freq_factor, device), 1.0


@register("long_rope", "rotate", "LongRoPE: per-dimension rescale factors, short/long sets (Ding et al., 2024)")
class LongRoPE(ScaledRotary):
    """LongRoPE (Ding et al., 2024, eq. 4), HF ``longrope`` semantics (Phi-3).

    ``theta_i / lambda_i`` with ``short_factor`` while the length is ``<= L_orig`` and
    ``long_factor`` beyond; cos/sin scaled by ``sqrt(1 + ln s / ln L_orig)``. The first ``n_hat``
    positions keep the original angles ``n theta_i`` (the paper's ``I(lambda_i, n_hat)``: 1 for
    ``n < n_hat``, ``1 / lambda_i`` after; section 3.2). ``n_hat=0`` is HF's ``longrope``.

    Args:
        factor: the extension ratio s; None -> ``max_position_embeddings / original_max_position_embeddings``.
        short_factor, long_factor: ``rotary_dim/2`` rescale factors each; None -> all 1 (short) and
            all ``factor`` (long, i.e. position interpolation, following later `set_scale` calls).
        attention_factor: explicit cos/sin scale.
        n_hat: initial positions left un-interpolated (searched by `LongRoPECurriculum`).
    """

    dynamic = True
    searchable = True
    hf_rope_type: ClassVar[str | None] = "longrope"

    def __init__(self, factor: float | None = None, short_factor: list[float] | None = None,
                 long_factor: list[float] | None = None, original_max_position_embeddings: int = 512,
                 max_position_embeddings: int = 2048, theta: float = 10000.0, attention_factor: float | None = None,
                 layout: Layout = "half", partial_rotary_factor: float = 1.0, n_hat: int = 0) -> None:
        self.max_position_embeddings = int(max_position_embeddings)
        self.attention_factor = attention_factor
        self._short: list[float] | None = None
        self._long: list[float] | None = None
        self.n_hat = 0
        if factor is None:
            factor = self.max_position_embeddings / int(original_max_position_embeddings)
        super().__init__(factor, original_max_position_embeddings, theta, layout, partial_rotary_factor)
        self.set_factors(short_factor, long_factor, n_hat)

    def set_factors(self, short_factor: Sequence[float] | Tensor | None = None,
                    long_factor: Sequence[float] | Tensor | None = None, n_hat: int | None = None) -> None:
        """Replace the short and/or long rescale factors and/or ``n_hat`` (None keeps the current)."""
        if n_hat is not None:
            if int(n_hat) != n_hat or n_hat < 0:
                raise ValueError(f"long_rope: n_hat must be a whole number >= 0, got {n_hat!r}")
            self.n_hat = int(n_hat)
        for attr, val in (("short_factor", short_factor), ("long_factor", long_factor)):
            if val is None:
                continue
            vals = [float(x) for x in (val.tolist() if isinstance(val, Tensor) else val)]
            if any(not math.isfinite(x) or x <= 0 for x in vals):
                raise ValueError(f"long_rope: {attr} must be positive finite numbers, got {vals}")
            if self.head_dim is not None and len(vals) != self.rotary_dim // 2:
                raise ValueError(f"long_rope: {attr} needs rotary_dim/2 = {self.rotary_dim // 2} values, got {len(vals)}")
            setattr(self, "_short" if attr == "short_factor" else "_long", vals)

    def build(self) -> None:
        self.set_factors(self._short, self._long)  # check the lengths now that rotary_dim is known

    @classmethod
    def config_from_rope_parameters(cls, rope_parameters: dict[str, Any], max_position_embeddings: int,
                                    original_max_position_embeddings: int) -> dict[str, Any]:
        p = rope_parameters
        return {**super().config_from_rope_parameters(p, max_position_embeddings, original_max_position_embeddings),
                "factor": p.get("factor"), "short_factor": list(cls._required(p, "short_factor")),
                "long_factor": list(cls._required(p, "long_factor")),
                "original_max_position_embeddings": original_max_position_embeddings,
                "max_position_embeddings": int(max_position_embeddings), "attention_factor": p.get("attention_factor")}

    def _rope_law_parameters(self) -> tuple[dict[str, Any], int | None] | None:
        if self.n_hat:  # the kept initial positions have no transformers equivalent
            return None
        return {"short_factor": self.short_factor, "long_factor": self.long_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "attention_factor": self.attention_factor, "factor": self.factor}, self.max_position_embeddings

    @property
    def short_factor(self) -> list[float] | None:
        """The short rescale factors in use (all 1 unless set); None before the head size is known."""
        if self._short is not None:
            return list(self._short)
        return None if self.head_dim is None else [1.0] * (self.rotary_dim // 2)

    @property
    def long_factor(self) -> list[float] | None:
        """The long rescale factors in use (``factor`` everywhere unless set: position interpolation)."""
        if self._long is not None:
            return list(self._long)
        return None if self.head_dim is None else [self.factor] * (self.rotary_dim // 2)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "short_factor": self._short, "long_factor": self._long, "n_hat": self.n_hat}

    def cos_sin_of(self, positions: Tensor, seq_len: int | None = None) -> tuple[Tensor, Tensor]:
        cos, sin = super().cos_sin_of(positions, seq_len)
        if self.n_hat > 0:
            keep = (positions < self.n_hat)[..., None]  # I(lambda, n_hat) = 1 for n < n_hat
            ones = [1.0] * (self.rotary_dim // 2)
            inv_freq = longrope_inv_freq(self.rotary_dim, self.theta, ones, positions.device)
            cos0, sin0 = rope_cos_sin(self.positions_for_angles(positions), inv_freq, self.attention_scaling())
            cos, sin = torch.where(keep, cos0, cos), torch.where(keep, sin0, sin)
        return cos, sin

    def attention_scaling(self) -> float:
        return longrope_attention_factor(self.factor, self.original_max_position_embeddings, self.attention_factor)

    def factors(self, seq_len: int | None) -> list[float]:
        """The rescale factors in use at this length (``long`` iff ``seq_len > L_orig``)."""
        self.rotary_dim  # noqa: B018  (raises a clear error before bind)
        if seq_len and seq_len > self.original_max_position_embeddings:
            return self.long_factor
        return self.short_factor

    def frequencies(self, seq_len: int | None = None, device: torch.device | None = None) -> tuple[Tensor, float]:
        return longrope_inv_freq(self.rotary_dim, self.theta, self.factors(seq_len), device), self.attention_scaling()

    def frequencies_key(self, seq_len: int | None) -> Any:
        long = bool(seq_len and seq_len > self.original_max_position_embeddings)
        return super().frequencies_key(seq_len) + (long, tuple(self.factors(seq_len)), self.attention_factor,
                                                   self.n_hat)
