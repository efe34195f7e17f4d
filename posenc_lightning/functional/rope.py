"""Rotary position embedding math (Su et al., 2021, "RoFormer", eq. 13-15).

Frequencies ``theta_i = base^(-2i/d)``; a pair of channels at position m is rotated by the
angle ``m * theta_i``. Two channel layouts are in use:

* ``"half"`` (GPT-NeoX / Hugging Face ``rotate_half``): pair (x_i, x_{i+d/2});
* ``"interleaved"`` (the paper, Meta's original LLaMA): pair (x_{2i}, x_{2i+1}).

Angles are always computed in float32 (or float64) from the positions, whatever the dtype of
q and k, so that large positions stay distinct in bf16 models.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc_lightning.autograd.rotary import RotaryHalf, RotaryPair, rotary_dtype
from posenc_lightning.functional.mode import Mode

__all__ = ["apply_rotary", "apply_rotary_reference", "p_rope_inv_freq", "rope_angles", "rope_cos_sin", "rope_inv_freq",
           "rotate_half", "rotate_qk"]


def rope_inv_freq(dim: int, base: float = 10000.0, device: torch.device | None = None,
                  dtype: torch.dtype = torch.float32) -> Tensor:
    """``inv_freq_i = base^(-2i/dim)`` for i in [0, dim/2), as Hugging Face computes it."""
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(dtype) / dim
    return 1.0 / (base ** exponent)


def p_rope_inv_freq(dim: int, base: float, p: float, device: torch.device | None = None,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """p-RoPE (Barbero et al., ICLR 2025, "Round and Round We Go!", sec. 6): RoPE's frequencies
    ``base^(-2i/dim)`` with only the fraction ``p`` of the *highest* kept; the lowest
    ``dim/2 - int(p * dim // 2)`` become 0 (their channels are not rotated: NoPE channels). As the
    paper's code: ``rope_angles = int(p * dim // 2)``, the rest of the timescales infinite.

    Args:
        dim: the rotary dimension; base: the frequency base; p: the kept fraction, in ``[0, 1]``.

    Returns:
        ``[dim/2]`` frequencies, the first ``int(p * dim // 2)`` those of `rope_inv_freq`, the rest 0.
    """
    inv = rope_inv_freq(dim, base, device=device, dtype=dtype)
    keep = int(p * dim // 2)
    return torch.where(torch.arange(inv.shape[0], device=device) < keep, inv, torch.zeros_like(inv))


def rope_angles(positions: Tensor, inv_freq: Tensor) -> Tensor:
    """``m * theta_i`` in float32: positions ``[..., N]`` x inv_freq ``[D/2]`` -> ``[..., N, D/2]``.

    ``inv_freq`` may also be per head ``[H, D/2]``; then positions ``[B, N]`` give
    ``[B, H, N, D/2]``.
    """
    dtype = torch.float64 if inv_freq.dtype == torch.float64 else torch.float32
    pos = positions.to(dtype)
    f = inv_freq.to(dtype)
    if f.dim() == 2:  # per head
        return pos[..., None, :, None] * f[:, None, :]
    return pos[..., None] * f


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, attention_scaling: float = 1.0
                 ) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles (times the attention scaling, as HF folds mscale in)."""
    ang = rope_angles(positions, inv_freq)
    return ang.cos() * attention_scaling, ang.sin() * attention_scaling


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _complex_viewable(x: Tensor) -> bool:
    return x.stride(-1) == 1 and x.storage_offset() % 2 == 0 and all(s % 2 == 0 for s in x.stride()[:-1])


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "half") -> Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` channels of ``x`` (partial rotary keeps the rest).

    ``x``: ``[B, H, N, D]``; ``cos``/``sin``: ``[B, N, R/2]`` or ``[B, H, N, R/2]`` (float32).
    The rotation is done in float32 and cast back to ``x.dtype``. Fast paths (same numbers):
    ``"interleaved"`` is one complex multiply ``(x_2i + i x_2i+1) * (cos + i sin)`` on a view;
    ``"half"`` writes both halves into one buffer with a hand-written backward (when cos/sin
    need no gradient). `apply_rotary_reference` is the plain formula they are tested against.
    """
    if layout not in ("half", "interleaved"):
        raise ValueError(f"unknown rotary layout {layout!r}; use 'half' or 'interleaved'")
    if Mode.tracing():  # the compiler fuses the formula itself (out= views and
        return apply_rotary_reference(x, cos, sin, layout)  # storage offsets do not trace)
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    if layout == "half":
        if cos.requires_grad or sin.requires_grad:  # learned frequencies: plain autograd
            return apply_rotary_reference(x, cos, sin, layout)
        return RotaryHalf.apply(x, cos, sin)
    r = cos.shape[-1] * 2
    wdt = rotary_dtype(x, cos)
    xr = x[..., :r].to(wdt)
    if not _complex_viewable(xr):
        xr = xr.clone(memory_format=torch.contiguous_format)  # a fresh, aligned buffer
    rot = torch.view_as_complex(xr.unflatten(-1, (-1, 2))) * torch.complex(cos.to(wdt), sin.to(wdt))
    out = torch.view_as_real(rot).flatten(-2).to(x.dtype)
    return torch.cat((out, x[..., r:]), dim=-1) if x.shape[-1] > r else out


def rotate_qk(q: Tensor, k: Tensor, cos_q: Tensor, sin_q: Tensor, cos_k: Tensor, sin_k: Tensor,
              layout: str = "half", compiling: bool = False) -> tuple[Tensor, Tensor]:
    """q and k rotated together: `apply_rotary` of each, as one operator forward and one backward
    (`autograd.rotary.RotaryPair`: one Triton launch on CUDA; the inverse rotation of ``dq``, ``dk``
    in backward, nothing but the tables saved).

    cos/sin ``[B, N, R/2]`` or ``[B, H, N, R/2]``, float32 or float64 (the compute dtype: float64
    tables only for float64 q, k). ``compiling`` (the call's `Mode`): the plain formula, which the
    compiler fuses itself; as is a table that needs a gradient (learned frequencies).
    """
    if layout not in ("half", "interleaved"):
        raise ValueError(f"unknown rotary layout {layout!r}; use 'half' or 'interleaved'")
    if compiling or any(t.requires_grad for t in (cos_q, sin_q, cos_k, sin_k)):
        return apply_rotary_reference(q, cos_q, sin_q, layout), apply_rotary_reference(k, cos_k, sin_k, layout)
    if cos_q.dim() == 3:
        cos_q, sin_q = cos_q[:, None], sin_q[:, None]
    if cos_k.dim() == 3:
        cos_k, sin_k = cos_k[:, None], sin_k[:, None]
    return RotaryPair.apply(q, k, cos_q, sin_q, cos_k, sin_k, layout == "interleaved")


def apply_rotary_reference(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "half") -> Tensor:
    """`apply_rotary` straight from RoFormer eq. 34: ``(x1 cos - x2 sin, x2 cos + x1 sin)``."""
    r = cos.shape[-1] * 2
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    xr, rest = x[..., :r].to(rotary_dtype(x, cos)), x[..., r:]
    if layout == "half":
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    elif layout == "interleaved":
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        raise ValueError(f"unknown rotary layout {layout!r}; use 'half' or 'interleaved'")
    out = out.to(x.dtype)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
