"""The `Encoding` base class and the structured attention-bias kinds (docs/architecture.md, stages 1-4).

An encoding implements only the stages it uses:

1. ``embed(h, positions)``      add a vector to the hidden state (sinusoidal, learned)
2. ``rotate(q, k, ctx)``        transform q and k by position (the rotary family)
3. ``bias(q, k, ctx)``          return a structured `Bias` added to the logits
4. ``normalize(ctx)``            a `Normalizer` replacing softmax (stick-breaking)

A bias is a *description* (`LinearBias`, `RelativeBias`, `DecayBias`, `DenseBias`, or a sum;
defined in `posenc_lightning.encodings.bias`, re-exported here) that owns what each backend
asks of it. ``i`` and ``j`` are always the tokens' *positions*, never their indices in the batch.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from posenc_lightning.encodings import proven_on_gpu
from posenc_lightning.encodings.bias import (
    Bias,
    BiasSum,
    DecayBias,
    DenseBias,
    GatedCounts,
    KernelBias,
    KeyOnly,
    LinearBias,
    ProductBias,
    RelativeBias,
    ScaledBias,
    cut,
    span,
)
from posenc_lightning.encodings.normalizer import Normalizer, Walk
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.positions import max_position

__all__ = [
    "AttentionContext",
    "Bias",
    "BiasSum",
    "DecayBias",
    "DenseBias",
    "Encoding",
    "GatedCounts",
    "KernelBias",
    "KeyOnly",
    "LinearBias",
    "Normalizer",
    "ProductBias",
    "RelativeBias",
    "ScaledBias",
    "Walk",
    "cut",
    "span",
]


# --------------------------------------------------------------------------------------------
# The context an encoding sees inside attention
# --------------------------------------------------------------------------------------------
@dataclass(eq=False)
class AttentionContext:
    """What stages 2-4 may need besides q and k.

    ``q_pos`` / ``k_pos`` are ``[B, Nq]`` / ``[B, Nk]`` (``[B, N, 2]`` for 2-D encodings);
    ``hidden`` is the layer input ``[B, Nq, d_model]`` (content-dependent encodings only);
    ``cache`` the layer's `LayerKVCache` (encodings with per-token state keep it there);
    ``rotary`` the encoding whose rotation a fused backend applies in-kernel (`Encoding.fused_rotary`;
    q and k then arrive un-rotated), set by the mixin only for backends with ``FUSES_ROTARY``.
    ``q_start`` / ``k_start``: when known without reading the positions (the mixin made them, or a
    cache filled only so), every row of ``q_pos`` / ``k_pos`` is ``start + arange(N)``; None: not
    known. Fast paths read these instead of the values (no device sync, nothing data-dependent to
    trace: `functional.positions`).
    ``k_hidden``: the layer input at the keys' tokens when the keys are not only the queries' own
    and no cache holds their state (context parallelism: gathered from the group); the queries are
    then the last ``Nq`` keys. None otherwise (``hidden`` covers the keys).
    ``context_len``: the context length when known at construction (else derived: `seq_len`).
    ``mode``: traced or eager and the device type, decided once when the context is made; an
    encoding reads it (``ctx.mode.host_reads``) instead of asking ``torch.compiler``. It carries
    the module's ``posenc_tunables`` (`functional.tunables.Tunables`), the defaults where it has none.
    """

    q_pos: Tensor
    k_pos: Tensor
    causal: bool = True
    hidden: Tensor | None = None
    cache: Any = None
    module: nn.Module | None = None
    rotary: Encoding | None = None
    q_start: int | None = None
    k_start: int | None = None
    k_hidden: Tensor | None = None
    #: the context length when the caller knows it (context parallelism: the whole sequence's)
    context_len: int | None = None
    #: traced or eager and the device, decided when the context is made (`functional.mode.Mode`)
    mode: Mode = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.mode is None:  # the attention module's tunables, if it declares them
            self.mode = Mode.now("cpu" if self.q_pos is None else self.q_pos.device.type,  # (no positions: a test's)
                                 getattr(self.module, "posenc_tunables", None))

    @property
    def ascending(self) -> bool:
        """Queries and keys are the same tokens at ``start + arange(N)`` (known without a read)."""
        return self.k_pos is self.q_pos and self.q_start is not None

    _seq_len: int | None = field(default=None, init=False, repr=False)

    @property
    def seq_len(self) -> int:
        """Current context length: largest key position + 1 (as HF's dynamic scaling uses);
        static when ``k_start`` is known, else one read of the positions, kept (for dynamic laws
        only: under ``torch.compile`` a graph break at that read, `_read_seq_len`)."""
        if self._seq_len is None:
            n = self.context_len if self.context_len is not None else max_position(self.k_pos, self.k_start)
            self._seq_len = n if n is not None else _read_seq_len(self.k_pos)
        return self._seq_len


def _read_seq_len(k_pos: Tensor) -> int:
    """The one host read a dynamic rotary law needs when the positions are not known statically
    (its frequencies depend on the largest position). Declared: on a GPU it is a sync, under
    ``torch.compile`` a graph break here (and an error with ``fullgraph=True``); positions the
    mixin makes itself, or a cache filled by them, never get here (`AttentionContext.k_start`)."""
    return int(k_pos.max()) + 1


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
    #: with ``position_dims`` 1, also takes ``[B, N, k]`` positions (rope_2d, liere, comrope)
    accepts_nd_positions: ClassVar[bool] = False
    #: `set_scale` changes the scale `factor` at run time (pi, ntk, yarn, clex, ...; curricula use it)
    scalable: ClassVar[bool] = False
    #: `set_factors` replaces per-dimension rescale factors (long_rope; LongRoPE's search uses it)
    searchable: ClassVar[bool] = False
    #: the `Normalizer` class `normalize` returns (its ``fused_in`` and ``walk`` tell a backend whether
    #: it can run it before any call); None: keeps softmax
    normalizer_kind: ClassVar[type[Normalizer] | None] = None
    #: the current scale of a scalable encoding (1 = unscaled)
    factor: float = 1.0
    #: needs the layer's hidden state in ``attend(..., hidden=...)`` (FoX gates)
    requires_hidden: ClassVar[bool] = False
    #: keeps per-token state beside the cached keys (``ctx.cache.extra``: FoX's cumulative gates),
    #: so its cache must hold exactly the tokens seen (no fixed-size static buffer)
    keeps_cache_state: ClassVar[bool] = False
    #: runs with the keys gathered over a context-parallel group (`posenc_lightning.parallel`); an
    #: encoding with `keeps_cache_state` must set it itself, its bias reading ``ctx.k_hidden`` there
    context_parallel: ClassVar[bool] = True
    #: the bias kinds `bias` may return (their ``fused_in`` tells a fused backend whether it can
    #: compute them without an N x N tensor); none declared = unknown: only blocks of rows (sdpa)
    bias_kinds: ClassVar[tuple[type[Bias], ...]] = ()
    #: how many q/k-sized operand pairs its bias multiplies (`ProductBias`): a kernel folding them
    #: into its own product takes q and k ``head_dim * (1 + product_operands)`` channels wide
    product_operands: int = 0
    #: rotary encodings need an even head_dim
    needs_even_head_dim: ClassVar[bool] = False
    #: ``rotate`` is a cheap, deterministic function of (q, k, ctx): attention recomputes it in
    #: backward instead of keeping the rotated q, k for it (`attention.recompute`)
    cheap_rotation: ClassVar[bool] = False
    #: the transformers ``rope_type`` this law is written as and read back from (`to_rope_parameters`,
    #: `posenc_lightning.encodings.hf.from_hf`); None: no transformers rope law reads back as it. Each
    #: class declares its own: a subclass that does not (it may change the law) has None
    hf_rope_type: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "hf_rope_type" not in cls.__dict__:  # not inherited: a subclass's law may differ
            cls.hf_rope_type = None
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
        """Returns:
            The ``__init__`` arguments this encoding was built with (saved in checkpoints, logged).
        """
        cfg = dict(getattr(self, "_init_args", {}))
        return {k: v for k, v in cfg.items() if not isinstance(v, (nn.Module, Tensor))}

    def to_rope_parameters(self, layout: str = "half") -> tuple[dict[str, Any], int | None] | None:
        """This encoding as a transformers rope law (`models.hf_export.export_pretrained` writes it).

        Args:
            layout: how the target model pairs the rotated channels (``"half"`` or ``"interleaved"``).

        Returns:
            ``(rope_parameters, max_position_embeddings or None)`` for which transformers'
            ``ROPE_INIT_FUNCTIONS`` give this encoding's frequencies and attention scaling, or None
            when no rope law does (here: every encoding but the rotary laws that declare one).
        """
        return None

    def hparams_for_logging(self) -> dict[str, Any]:
        """Returns:
            ``{"posenc/encoding": name, "posenc/<arg>": value}``, values a logger accepts.
        """
        out: dict[str, Any] = {"posenc/encoding": self.name}
        for k, v in self.config().items():
            out[f"posenc/{k}"] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
        return out

    def gpu_record(self, backend: str, table: Mapping[tuple[str, str], Any] | None = None) -> str | None:
        """The recorded GPU run that validated ``backend`` (a custom kernel) for this encoding.

        Args:
            backend: a backend name, e.g. ``"triton"``.
            table: a table of `proven_on_gpu.PROVEN`'s form to read instead of it.

        Returns:
            The results page and GPU of that run (`proven_on_gpu.PROVEN`), or None.
        """
        entry = (proven_on_gpu.PROVEN if table is None else table).get((backend, self.name))
        return None if entry is None else proven_on_gpu.record_of(entry)

    def gpu_ms(self, backend: str, table: Mapping[tuple[str, str], Any] | None = None) -> float | None:
        """The time a recorded GPU run measured for this encoding through ``backend``.

        Args:
            backend: a backend name, e.g. ``"sdpa"``.
            table: a table of `proven_on_gpu.PROVEN`'s form to read instead of it.

        Returns:
            Milliseconds of `proven_on_gpu.REFERENCE_CASE`, or None where no time was recorded.
        """
        return proven_on_gpu.ms_of((proven_on_gpu.PROVEN if table is None else table).get((backend, self.name)))

    def bind(self, *, n_heads: int | None = None, head_dim: int | None = None,
             d_model: int | None = None) -> Encoding:
        """Tell the encoding the attention sizes; builds its size-dependent parameters once known.

        Args:
            n_heads: query heads.
            head_dim: size of one head.
            d_model: the model width (stage-1 encodings).

        Returns:
            ``self``.

        Raises:
            ValueError: a size differs from the one it was bound to, or a rotary encoding gets an
                odd ``head_dim``.
        """
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
    def embed(self, h: Tensor, positions: Tensor, start: int | None = None) -> Tensor:
        """Stage 1: add position information to the hidden state.

        Args:
            h: token embeddings ``[B, N, d_model]``.
            positions: their positions ``[B, N]``.
            start: the positions are known to be ``start + arange(N)`` in every row; None: not known.

        Returns:
            ``h`` with positions added (default: unchanged).
        """
        return h

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """Stage 2: transform queries and keys by position.

        Args:
            q: queries ``[B, H, Nq, D]``.
            k: keys ``[B, Hkv, Nk, D]``.
            ctx: positions and the rest of the call (`AttentionContext`).

        Returns:
            ``(q, k)`` transformed (default: unchanged).
        """
        return q, k

    def bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Bias | None:
        """Stage 3: a bias on the logits, as a description a backend computes (`Bias`).

        Args:
            q: queries ``[B, H, Nq, D]`` (after `rotate`).
            k: keys ``[B, Hkv, Nk, D]`` (after `rotate`).
            ctx: positions and the rest of the call (`AttentionContext`).

        Returns:
            The bias, or None (default).
        """
        return None

    def normalize(self, ctx: AttentionContext) -> Normalizer | None:
        """Stage 4: what replaces softmax, as a description a backend computes (`Normalizer`).

        Args:
            ctx: positions and the rest of the call (`AttentionContext`).

        Returns:
            The normalizer (an instance of the declared `normalizer_kind`), or None (default: softmax).
        """
        return None

    # ---------------------------------------------------------------- capabilities
    def set_scale(self, factor: float) -> None:
        """Change the scale `factor` at run time (scalable encodings; curricula call it).

        Args:
            factor: the new scale (1 = unscaled).

        Raises:
            ValueError: the encoding is not `scalable`.
        """
        raise ValueError(f"{self.name} has no set_scale(): it is not scalable; use a scalable encoding "
                         f"(pi, ntk, dynamic_ntk, yarn, llama3, long_rope, clex, ...)")

    def set_factors(self, short_factor: Any = None, long_factor: Any = None, n_hat: int | None = None) -> None:
        """Replace the rescale factors (searchable encodings; LongRoPE's search calls it).

        Args:
            short_factor: per-dimension factors within the original length; None: keep.
            long_factor: per-dimension factors beyond it; None: keep.
            n_hat: the first positions kept un-interpolated; None: keep.

        Raises:
            ValueError: the encoding is not `searchable`.
        """
        raise ValueError(f"{self.name} has no set_factors(): it is not searchable; use 'long_rope'")

    @property
    def fused_rotary(self) -> Encoding | None:
        """The rotary encoding whose rotation a fused backend may apply in-kernel instead of
        `rotate` (its ``cos_sin`` tables gathered at every token's position), or None."""
        return None

    def softmax_scale(self, head_dim: int) -> float:
        """The logit scale; rotary scalings fold their attention temperature into cos/sin instead.

        Args:
            head_dim: size of one head.

        Returns:
            ``1 / sqrt(head_dim)``.
        """
        return head_dim ** -0.5

    @property
    def stages(self) -> frozenset[str]:
        """The stages this encoding implements, from which methods the class overrides."""
        return frozenset(s for s in ("embed", "rotate", "bias", "normalize")
                         if getattr(type(self), s) is not getattr(Encoding, s))

    def reserve(self, n_positions: int, device: torch.device | None = None) -> None:
        """Build position tables now, outside any traced region (a table cannot grow inside a
        ``torch.compile`` graph). Default: no table, nothing to do.

        Args:
            n_positions: positions ``0..n_positions-1`` will be looked up.
            device: where the tables live; None: where the encoding is.
        """

    def check_positions(self, positions: Tensor, start: int | None = None) -> None:
        """Raise a clear error for positions the encoding cannot represent (a check that needs the
        values reads them only where `host_reads_ok`).

        Args:
            positions: ``[B, N]`` (or ``[B, N, k]``) positions.
            start: as in `embed`.

        Raises:
            ValueError: a position out of the encoding's range (a learned table's length).
        """

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
        """Returns:
            An independent copy (one per layer with ``share_across_layers=False``).
        """
        return copy.deepcopy(self)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config().items())
