"""The `Encoding` base class and the structured attention-bias kinds (DESIGN.md, stages 1-4).

An encoding implements only the stages it uses:

1. ``embed(h, positions)``      add a vector to the hidden state (sinusoidal, learned)
2. ``rotate(q, k, ctx)``        transform q and k by position (the rotary family)
3. ``bias(q, k, ctx)``          return a structured `Bias` added to the logits
4. ``normalize(logits, mask, ctx)`` replace softmax (stick-breaking)

A bias is a *description* (`LinearBias`, `RelativeBias`, `DecayBias`, `DenseBias`, or a sum),
so that each backend fuses what it can; ``materialize()`` gives the dense ``[B|1, H, Nq, Nk]``
float32 tensor the eager and SDPA backends add to the logits. ``i`` and ``j`` are always the
tokens' *positions*, never their indices in the batch.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

__all__ = [
    "AttentionContext",
    "Bias",
    "BiasSum",
    "DecayBias",
    "DenseBias",
    "Encoding",
    "LinearBias",
    "RelativeBias",
]


# --------------------------------------------------------------------------------------------
# Bias kinds
# --------------------------------------------------------------------------------------------
#: a part of a tensor (``t[index]``); None = the whole tensor
Index = Any


def span(start: int, stop: int, dim: int = -1) -> Index:
    """The index of ``[start, stop)`` along ``dim`` (negative: counted from the end), e.g.
    ``span(s, e, -2)`` = the query rows ``s:e`` of ``q [B, H, N, D]``."""
    return (Ellipsis, slice(start, stop)) + (slice(None),) * (-dim - 1)
class Bias:
    """A structured additive bias on the attention logits."""

    def materialize(self) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement materialize()")

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        """``materialize()[..., start:stop, :k_stop]`` without building the rest (blockwise SDPA)."""
        return self.materialize()[..., start:stop, :k_stop]

    def grad_inputs(self) -> tuple[Tensor, ...] | None:
        """Every tensor the bias is computed from that may need a gradient (None: unknown).
        Backends with their own backward recompute rows (`rows_from`) and differentiate to these."""
        return None

    def input_windows(self, start: int, stop: int, k_stop: int) -> tuple[Index, ...]:
        """For each of `grad_inputs`, the part of it that ``rows(start, stop, k_stop)`` reads
        (an index; None = all of it)."""
        return (None,) * len(self.grad_inputs() or ())

    @property
    def recomputable(self) -> bool:
        """`rows_from` works: rows can be recomputed from stand-ins for the inputs."""
        return False

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        """``rows(start, stop, k_stop)`` computed from ``views`` (each of `grad_inputs` cut by
        `input_windows`) instead of the stored tensors: a backward pass gives detached leaves
        here and differentiates to them, so gradients are window-sized and never run through
        the model's own graph."""
        raise NotImplementedError(f"{type(self).__name__} cannot recompute rows from stand-in inputs")

    @property
    def terms(self) -> list[Bias]:
        return [self]

    def __add__(self, other: Bias | None) -> Bias:
        if other is None:
            return self
        return BiasSum(self.terms + other.terms)

    __radd__ = __add__


def _distance(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``i - j`` for every (query, key) pair: ``[B, Nq, Nk]`` from ``[B, Nq]`` and ``[B, Nk]``."""
    return q_pos[:, :, None] - k_pos[:, None, :]


@dataclass(eq=False)
class LinearBias(Bias):
    """ALiBi: ``-slopes[h] * |i - j|`` (Press et al., 2022, eq. 1)."""

    slopes: Tensor  # [H]
    q_pos: Tensor  # [B, Nq]
    k_pos: Tensor  # [B, Nk]

    def materialize(self) -> Tensor:
        dist = _distance(self.q_pos, self.k_pos).abs().to(torch.float32)
        return -self.slopes.to(torch.float32)[None, :, None, None] * dist[:, None]

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        return LinearBias(self.slopes, self.q_pos[:, start:stop], self.k_pos[:, :k_stop]).materialize()

    def grad_inputs(self) -> tuple[Tensor, ...]:
        return (self.slopes,)

    recomputable = True

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        return LinearBias(views[0], self.q_pos, self.k_pos).rows(start, stop, k_stop)


@dataclass(eq=False)
class RelativeBias(Bias):
    """``table[h, clamp(i - j, -R, R) + R]`` for a table ``[H, 2R + 1]`` (T5, any f(i - j))."""

    table: Tensor  # [H, 2R+1]
    q_pos: Tensor
    k_pos: Tensor

    @property
    def max_distance(self) -> int:
        return (self.table.shape[-1] - 1) // 2

    def materialize(self) -> Tensor:
        r = self.max_distance
        idx = _distance(self.q_pos, self.k_pos).long().clamp(-r, r) + r  # [B, Nq, Nk]
        out = self.table.to(torch.float32)[:, idx]  # [H, B, Nq, Nk]
        return out.permute(1, 0, 2, 3)

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        return RelativeBias(self.table, self.q_pos[:, start:stop], self.k_pos[:, :k_stop]).materialize()

    def grad_inputs(self) -> tuple[Tensor, ...]:
        return (self.table,)

    recomputable = True

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        return RelativeBias(views[0], self.q_pos, self.k_pos).rows(start, stop, k_stop)


@dataclass(eq=False)
class DecayBias(Bias):
    """``c_q[b, h, i] - c_k[b, h, j]`` from cumulative log-gates (FoX, Lin et al., 2025)."""

    c_q: Tensor  # [B, H, Nq]
    c_k: Tensor  # [B, H, Nk]

    def materialize(self) -> Tensor:
        return self.c_q.to(torch.float32)[..., :, None] - self.c_k.to(torch.float32)[..., None, :]

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        return DecayBias(self.c_q[..., start:stop], self.c_k[..., :k_stop]).materialize()

    def grad_inputs(self) -> tuple[Tensor, ...]:
        return (self.c_q, self.c_k)

    def input_windows(self, start: int, stop: int, k_stop: int) -> tuple[Index, ...]:
        return (span(start, stop), span(0, k_stop))

    recomputable = True

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        return DecayBias(views[0], views[1]).materialize()


@dataclass(eq=False)
class DenseBias(Bias):
    """Any bias given as a tensor ``[B or 1, H, Nq, Nk]`` (fallback), or lazily by a function of
    rows (`DenseBias.lazy`: FIRE, CoPE, mixtures), so that blockwise backends never hold ``N x N``."""

    tensor: Tensor | None = None
    fn: Callable[..., Tensor] | None = field(default=None, repr=False)
    shape_qk: tuple[int, int] | None = None  # (Nq, Nk) of a lazy bias
    inputs: tuple[Tensor, ...] | None = field(default=None, repr=False)  # what ``fn`` is computed from
    window: Callable[[int, int, int], tuple[Index, ...]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.tensor is None) == (self.fn is None) or (self.fn is not None and self.shape_qk is None):
            raise ValueError("DenseBias needs a tensor, or a rows function and its sizes: "
                             "DenseBias(tensor) or DenseBias.lazy(fn, n_q, n_k)")
        if self.window is not None and self.inputs is None:
            raise ValueError("DenseBias.lazy: a window needs the inputs it cuts (inputs=...)")

    @classmethod
    def lazy(cls, fn: Callable[..., Tensor], n_q: int, n_k: int, inputs: Sequence[Tensor] | None = None,
             window: Callable[[int, int, int], tuple[Index, ...]] | None = None) -> DenseBias:
        """A bias computed only for the rows asked for (``materialize()`` = all rows).

        Without ``inputs``: ``fn(start, stop, k_stop) -> [B|1, H, stop - start, k_stop]``; the SDPA
        backend then checkpoints each block to get gradients.

        With ``inputs`` (every tensor the rows depend on that may need a gradient: parameters,
        q, k...): ``fn(start, stop, k_stop, *inputs)`` must read them from its arguments only.
        ``window(start, stop, k_stop)`` names the part of each input those rows read (an index,
        None = all; e.g. ``span(start, stop, -2)`` for the query rows of q): ``fn`` then gets
        the parts. The SDPA backend's own backward calls ``fn`` on detached parts and
        differentiates to them: no ``N x N`` kept, gradients only as large as the parts.
        """
        ins = None if inputs is None else tuple(inputs)
        return cls(fn=fn, shape_qk=(int(n_q), int(n_k)), inputs=ins, window=window)

    def grad_inputs(self) -> tuple[Tensor, ...] | None:
        return (self.tensor,) if self.tensor is not None else self.inputs

    def input_windows(self, start: int, stop: int, k_stop: int) -> tuple[Index, ...]:
        if self.tensor is not None:
            return ((Ellipsis, slice(start, stop), slice(0, k_stop)),)
        if self.window is None:
            return (None,) * len(self.inputs or ())
        return tuple(self.window(start, stop, k_stop))

    @property
    def is_lazy(self) -> bool:
        return self.tensor is None

    @property
    def recomputable(self) -> bool:
        return self.tensor is not None or self.inputs is not None

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        if self.tensor is not None:
            return views[0].to(torch.float32)
        if self.inputs is None:
            return super().rows_from(start, stop, k_stop, views)
        return self.fn(start, stop, k_stop, *views).to(torch.float32)

    def materialize(self) -> Tensor:
        if self.tensor is None:
            return self.rows(0, *self.shape_qk)
        return self.tensor.to(torch.float32)

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        if self.tensor is not None:
            return self.tensor[..., start:stop, :k_stop].to(torch.float32)
        if self.inputs is None:
            return self.fn(start, stop, k_stop).to(torch.float32)
        return self.rows_from(start, stop, k_stop, cut(self.inputs, self.input_windows(start, stop, k_stop)))


def cut(tensors: Sequence[Tensor], windows: Sequence[Index]) -> list[Tensor]:
    """``[t[w] for t, w in ...]``, None windows taking the whole tensor."""
    return [t if w is None else t[w] for t, w in zip(tensors, windows)]


@dataclass(eq=False)
class BiasSum(Bias):
    """A sum of bias kinds (hybrids); backends may fuse each term separately."""

    parts: list[Bias] = field(default_factory=list)

    @property
    def terms(self) -> list[Bias]:
        return list(self.parts)

    def materialize(self) -> Tensor:
        out = self.parts[0].materialize()
        for p in self.parts[1:]:
            out = out + p.materialize()
        return out

    def grad_inputs(self) -> tuple[Tensor, ...] | None:
        ins = [p.grad_inputs() for p in self.parts]
        return None if any(i is None for i in ins) else tuple(t for i in ins for t in i)

    def input_windows(self, start: int, stop: int, k_stop: int) -> tuple[Index, ...]:
        return tuple(w for p in self.parts for w in p.input_windows(start, stop, k_stop))

    @property
    def recomputable(self) -> bool:
        return all(p.recomputable for p in self.parts)

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        out, i = None, 0
        for p in self.parts:
            n = len(p.grad_inputs())
            r = p.rows_from(start, stop, k_stop, views[i:i + n])
            out, i = (r if out is None else out + r), i + n
        return out

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        out = self.parts[0].rows(start, stop, k_stop)
        for p in self.parts[1:]:
            out = out + p.rows(start, stop, k_stop)
        return out


# --------------------------------------------------------------------------------------------
# The context an encoding sees inside attention
# --------------------------------------------------------------------------------------------
@dataclass(eq=False)
class AttentionContext:
    """What stages 2-4 may need besides q and k.

    ``q_pos`` / ``k_pos`` are ``[B, Nq]`` / ``[B, Nk]`` (``[B, N, 2]`` for 2-D encodings);
    ``hidden`` is the layer input ``[B, Nq, d_model]`` (content-dependent encodings only);
    ``cache`` the layer's `LayerKVCache` (encodings with per-token state keep it there).
    """

    q_pos: Tensor
    k_pos: Tensor
    causal: bool = True
    hidden: Tensor | None = None
    cache: Any = None
    module: nn.Module | None = None

    @functools.cached_property
    def seq_len(self) -> int:
        """Current context length: largest key position + 1 (as HF's dynamic scaling uses)."""
        return int(self.k_pos.max().item()) + 1 if self.k_pos.numel() else 0


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------
class Encoding(nn.Module):
    """Base class of every positional encoding.

    Subclasses take their hyperparameters as typed ``__init__`` arguments (so LightningCLI's
    ``class_path``/``init_args`` works), create size-dependent parameters in `build` (called
    once by `bind` when the attention sizes are known) and override the stages they use.
    """

    name: ClassVar[str] = "encoding"
    family: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: keys go into the KV cache un-rotated and are rotated at attend time (dynamic scaling)
    dynamic: ClassVar[bool] = False
    #: 1 for ``[B, N]`` positions, 2 for ``[B, N, 2]`` (rope_2d)
    position_dims: ClassVar[int] = 1
    #: needs the layer's hidden state in ``attend(..., hidden=...)`` (FoX gates)
    requires_hidden: ClassVar[bool] = False
    #: keeps per-token state beside the cached keys (``ctx.cache.extra``: FoX's cumulative gates),
    #: so its cache must hold exactly the tokens seen (no fixed-size static buffer)
    keeps_cache_state: ClassVar[bool] = False
    #: rotary encodings need an even head_dim
    needs_even_head_dim: ClassVar[bool] = False
    #: ``rotate`` is a cheap, deterministic function of (q, k, ctx): attention recomputes it in
    #: backward instead of keeping the rotated q, k for it (`attention.recompute`)
    cheap_rotation: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def wrapped(self: Encoding, *args: Any, **kw: Any) -> None:
            outer = not getattr(self, "_recording_init", False)
            if outer:
                object.__setattr__(self, "_recording_init", True)
            try:
                init(self, *args, **kw)
            finally:
                if outer:
                    bound = inspect.signature(init).bind(self, *args, **kw)
                    bound.apply_defaults()
                    cfg = dict(bound.arguments)
                    cfg.pop("self", None)
                    extra = cfg.pop("kwargs", None) or {}
                    cfg.update(extra)
                    object.__setattr__(self, "_init_args", cfg)
                    object.__setattr__(self, "_recording_init", False)

        cls.__init__ = wrapped  # type: ignore[method-assign]

    def __init__(self) -> None:
        super().__init__()
        self.n_heads: int | None = None
        self.head_dim: int | None = None
        self.d_model: int | None = None
        self._built = False

    # ---------------------------------------------------------------- configuration
    def config(self) -> dict[str, Any]:
        """The ``__init__`` arguments this encoding was built with (for checkpoints and logs)."""
        cfg = dict(getattr(self, "_init_args", {}))
        return {k: v for k, v in cfg.items() if not isinstance(v, (nn.Module, Tensor))}

    def hparams_for_logging(self) -> dict[str, Any]:
        out: dict[str, Any] = {"posenc/encoding": self.name}
        for k, v in self.config().items():
            out[f"posenc/{k}"] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
        return out

    def bind(self, *, n_heads: int | None = None, head_dim: int | None = None,
             d_model: int | None = None) -> Encoding:
        """Tell the encoding the attention sizes and create its size-dependent parameters."""
        for attr, val in (("n_heads", n_heads), ("head_dim", head_dim), ("d_model", d_model)):
            if val is None:
                continue
            cur = getattr(self, attr)
            if cur is None:
                setattr(self, attr, int(val))
            elif cur != val:
                raise ValueError(
                    f"{self.name}: {attr}={val} does not match the {attr}={cur} this encoding was "
                    f"built for; build one encoding per shape (inject(..., share_across_layers=False)) "
                    f"or make the modules agree")
        if self.needs_even_head_dim and self.head_dim is not None and self.head_dim % 2:
            raise ValueError(
                f"{self.name} is rotary and needs an even head_dim, got head_dim={self.head_dim}; "
                f"use an even head size (e.g. {self.head_dim + 1}) or a non-rotary encoding such as 'alibi'")
        if not self._built and self._ready():
            self.build()
            self._built = True
        return self

    def _ready(self) -> bool:
        return True

    def build(self) -> None:
        """Create parameters/buffers that depend on ``n_heads``/``head_dim``/``d_model``."""

    # ---------------------------------------------------------------- stages
    def embed(self, h: Tensor, positions: Tensor) -> Tensor:
        """Stage 1: return ``h`` with position information added."""
        return h

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """Stage 2: transform ``q`` ``[B, H, Nq, D]`` and ``k`` ``[B, Hkv, Nk, D]`` by position."""
        return q, k

    def bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Bias | None:
        """Stage 3: a structured bias on the logits, or None."""
        return None

    def normalize(self, logits: Tensor, mask: Tensor | None, ctx: AttentionContext) -> Tensor:
        """Stage 4: attention weights from logits ``[B, H, Nq, Nk]`` (softmax by default)."""
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        w = torch.softmax(logits, dim=-1)
        return torch.nan_to_num(w, nan=0.0) if mask is not None else w

    def softmax_scale(self, head_dim: int) -> float:
        """The logit scale (``1/sqrt(d)``); rotary scalings fold their mscale into cos/sin."""
        return head_dim ** -0.5

    @property
    def stages(self) -> frozenset[str]:
        """The stages this encoding implements, from which methods the class overrides."""
        return frozenset(s for s in ("embed", "rotate", "bias", "normalize")
                         if getattr(type(self), s) is not getattr(Encoding, s))

    def check_positions(self, positions: Tensor) -> None:
        """Raise a clear error for positions the encoding cannot represent."""

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Encoding:
        """``.to()`` / ``.half()`` cast parameters (they follow the model's dtype) but only move the
        non-persistent floating buffers (caches and constants such as rope's cos/sin or ALiBi's
        slopes, computed in float32): they keep their precision in a bf16 model."""
        kept = {k: b for k, b in self._buffers.items()
                if k in self._non_persistent_buffers_set and b is not None and b.is_floating_point()}
        for k in kept:
            del self._buffers[k]
        try:
            super()._apply(fn, recurse)
        finally:
            for k, b in kept.items():
                moved = fn(b)
                self._buffers[k] = moved if moved.dtype == b.dtype else b.to(device=moved.device)
        return self

    def replicate(self) -> Encoding:
        """An independent copy (for ``share_across_layers=False``)."""
        return copy.deepcopy(self)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config().items())
