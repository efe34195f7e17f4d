"""Hybrids: encodings composed stage by stage from member encodings (not copied).

`rope_alibi` rotates with RoPE and adds ALiBi's bias; `mixture` is a "dynamic positional
encoding": a softmax-weighted sum of its members' biases with learnable weights, where a rotary
member contributes the logit change it would cause, ``scale * (q' k'^T - q k^T)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from posenc_lightning.encodings.alibi import ALiBi
from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding, Normalizer, ProductBias
from posenc_lightning.encodings.fire.bias import FireTableSum
from posenc_lightning.encodings.registry import build_encoding, register
from posenc_lightning.encodings.rope import RoPE


def _sum(biases: Sequence[Bias | None]) -> Bias | None:
    out: Bias | None = None
    for b in biases:
        if b is not None:
            out = b if out is None else out + b
    return out


class CompositeEncoding(Encoding):
    """Members applied stage by stage: embed and rotate chained in order, biases summed, at most
    one member may replace softmax. Sizes given to `bind` are forwarded to every member."""

    def __init__(self) -> None:
        super().__init__()
        self.members = nn.ModuleList()

    def _set_members(self, members: Sequence[Encoding]) -> None:
        if not members:
            raise ValueError(f"{self.name}: needs at least one member encoding")
        dims = {m.position_dims for m in members}
        if len(dims) > 1:
            raise ValueError(f"{self.name}: members mix 1-D and 2-D positions ({[m.name for m in members]})")
        if sum("normalize" in m.stages for m in members) > 1:
            raise ValueError(f"{self.name}: at most one member may replace softmax "
                             f"({[m.name for m in members if 'normalize' in m.stages]})")
        self.members = nn.ModuleList(members)
        self.position_dims = dims.pop()
        self.dynamic = any(m.dynamic for m in members)
        self.requires_hidden = any(m.requires_hidden for m in members)
        self.needs_even_head_dim = any(m.needs_even_head_dim for m in members)
        self.bias_kinds = tuple(dict.fromkeys(k for m in members if "bias" in m.stages for k in m.bias_kinds))
        self.normalizer_kind = next((m.normalizer_kind for m in members if "normalize" in m.stages), None)

    def bind(self, **sizes: int | None) -> Encoding:
        for m in self.members:
            m.bind(**sizes)
        return super().bind(**sizes)

    @property
    def stages(self) -> frozenset[str]:
        return frozenset().union(*(m.stages for m in self.members))

    @property
    def cheap_rotation(self) -> bool:  # type: ignore[override]
        return all(m.cheap_rotation for m in self.members if "rotate" in m.stages)

    @property
    def fused_rotary(self) -> Encoding | None:
        """The one rotary member, for backends that fuse the rotation (None if not exactly one)."""
        rot = [m for m in self.members if "rotate" in m.stages]
        if len(rot) != 1:
            return None
        return rot[0].fused_rotary

    def reserve(self, n_positions: int, device: torch.device | None = None) -> None:
        for m in self.members:
            m.reserve(n_positions, device)

    def check_positions(self, positions: Tensor, start: int | None = None) -> None:
        for m in self.members:
            m.check_positions(positions, start)

    def softmax_scale(self, head_dim: int) -> float:
        return self.members[0].softmax_scale(head_dim)

    def embed(self, h: Tensor, positions: Tensor, start: int | None = None) -> Tensor:
        for m in self.members:
            if "embed" in m.stages:
                h = m.embed(h, positions, start)
        return h

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        for m in self.members:
            if "rotate" in m.stages:
                q, k = m.rotate(q, k, ctx)
        return q, k

    def bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Bias | None:
        return _sum([m.bias(q, k, ctx) for m in self.members if "bias" in m.stages])

    def normalize(self, ctx: AttentionContext) -> Normalizer | None:
        for m in self.members:
            if "normalize" in m.stages:
                return m.normalize(ctx)
        return None


@register("rope_alibi", "hybrid", "RoPE rotation plus ALiBi's linear bias, composed stage by stage")
class RoPEALiBi(CompositeEncoding):
    """RoPE (``theta``, ``layout``, ``partial_rotary_factor``) then ALiBi (``slope_scale``)."""

    def __init__(self, theta: float = 10000.0, layout: Literal["half", "interleaved"] = "half",
                 partial_rotary_factor: float = 1.0, slope_scale: float = 1.0) -> None:
        super().__init__()
        self._set_members([RoPE(theta=theta, layout=layout, partial_rotary_factor=partial_rotary_factor),
                           ALiBi(slope_scale=slope_scale)])


@register("mixture", "hybrid", "Learned softmax-weighted mixture of encodings' logit biases (dynamic positional encoding)")
class Mixture(CompositeEncoding):
    """``bias = sum_m softmax(w)_m * bias_m`` over member encodings with learnable ``w``.

    Bias members contribute their bias (scaled, same kind); rotary members contribute the logit
    change of their rotation, ``scale * (q_rot k_rot^T - q k^T)`` (a `ProductBias`, which the
    Triton kernels take as one product of operands ``head_dim * (1 + rotary members)`` wide), so
    every member is compared on the logits. Members that embed or replace softmax are refused.

    Args:
        members: registered encoding names.
        member_cfgs: optional ``{name: {arg: value}}`` for the members.
        init_weights: initial mixture logits (default zeros: uniform weights).
    """

    def __init__(self, members: tuple[str, ...] = ("alibi", "relative_bias", "fire"),
                 member_cfgs: dict[str, dict[str, Any]] | None = None,
                 init_weights: tuple[float, ...] | None = None) -> None:
        super().__init__()
        cfgs = member_cfgs or {}
        unknown = set(cfgs) - set(members)
        if unknown:
            raise ValueError(f"mixture: member_cfgs names {sorted(unknown)} that are not members {list(members)}")
        encs = [build_encoding(n, **cfgs.get(n, {})) for n in members]
        bad = [e.name for e in encs if e.stages & {"embed", "normalize"} or not e.stages & {"rotate", "bias"}]
        if bad:
            raise ValueError(f"mixture: members must rotate or add a bias; {bad} do not (or embed / "
                             f"replace softmax). Use e.g. ('alibi', 'relative_bias', 'fire', 'rope')")
        self._set_members(encs)
        self.dynamic = False  # rotary members are applied to the cached raw keys at bias time
        w = torch.zeros(len(encs)) if init_weights is None else torch.tensor(init_weights, dtype=torch.float32)
        if w.shape != (len(encs),):
            raise ValueError(f"mixture: init_weights needs {len(encs)} values, got {tuple(w.shape)}")
        self.mixture_logits = nn.Parameter(w)
        rotary = sum("rotate" in m.stages for m in encs)
        if rotary:  # the logit change of a rotation: a product of the rotated q, k (rows read q, k)
            self.bias_kinds = (*self.bias_kinds, ProductBias)
            self.product_operands = rotary

    @property
    def stages(self) -> frozenset[str]:
        return frozenset({"bias"})

    @property
    def fused_rotary(self) -> Encoding | None:
        return None  # rotary members act through the bias here

    @property
    def weights(self) -> Tensor:
        return torch.softmax(self.mixture_logits.float(), dim=0)

    def _member_bias(self, m: Encoding, q: Tensor, k: Tensor, ctx: AttentionContext) -> Bias | None:
        out = m.bias(q, k, ctx) if "bias" in m.stages else None
        if "rotate" in m.stages:
            # scale * (q' k'^T - q k^T): a product of operands, one wider product in the kernels
            qr, kr = m.rotate(q, k, ctx)
            scale = m.softmax_scale(q.shape[-1])
            own = torch.tensor(-scale, dtype=torch.float32, device=q.device)
            out = _sum([out, ProductBias.of(q, k, own, [(qr * scale, kr)])])
        return out

    def bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Bias | None:
        w = self.weights.to(q.device)
        parts = []
        for i, m in enumerate(self.members):
            b = self._member_bias(m, q, k, ctx)
            if b is not None:
                parts.append(b.scaled(w[i]))  # the same kind where it can be
        return FireTableSum.of(_sum(parts))  # FIRE's rows then take the distance-only terms' table
