"""RoPE (Su et al., 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding").

`RotaryEncoding` is the shared path of the whole rotary family: a frequency law
``frequencies(seq_len) -> (inv_freq, attention_scaling)`` and the rotation of q and k at any
``[B, N]`` positions. cos/sin tables are cached in non-persistent buffers keyed on device,
length and `frequencies_key` (so a change of scale never reuses a stale table). q and k are rotated
together by one operator (`functional.rope.rotate_qk`), with the tables of a call at known
``start + arange`` positions kept in the compute dtype (`RotaryEncoding.rotate`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from posenc_lightning.encodings.base import AttentionContext, Encoding
from posenc_lightning.encodings.registry import register
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.positions import arange_offset, max_position
from posenc_lightning.functional.rope import p_rope_inv_freq, rope_cos_sin, rope_inv_freq, rotate_qk


class RotaryEncoding(Encoding):
    """Base of every rotary encoding.

    Args:
        theta: the frequency base (10000 in RoFormer; 500000 in Llama 3).
        layout: ``"half"`` (GPT-NeoX/HF ``rotate_half``) or ``"interleaved"`` (RoFormer, Meta).
        partial_rotary_factor: fraction of each head's channels that rotate (GPT-NeoX: 0.25).
    """

    needs_even_head_dim = True
    cheap_rotation = True  # cached cos/sin and elementwise ops

    def __init__(self, theta: float = 10000.0, layout: Literal["half", "interleaved"] = "half",
                 partial_rotary_factor: float = 1.0) -> None:
        super().__init__()
        if layout not in ("half", "interleaved"):
            raise ValueError(f"{self.name}: layout must be 'half' or 'interleaved', got {layout!r}")
        if not 0.0 < partial_rotary_factor <= 1.0:
            raise ValueError(f"{self.name}: partial_rotary_factor must be in (0, 1], got {partial_rotary_factor}")
        self.theta = float(theta)
        self.layout = layout
        self.partial_rotary_factor = float(partial_rotary_factor)
        self.register_buffer("_cos", torch.empty(0), persistent=False)
        self.register_buffer("_sin", torch.empty(0), persistent=False)
        self._table_key: Any = None
        #: the compute-dtype tables of recent calls at known ``start + arange`` positions, by
        #: (frequencies, device, dtype, starts, shapes): a repeated call dispatches no operator for them
        self._pair_tables: dict[Any, tuple[Tensor, Tensor, Tensor, Tensor]] = {}

    @property
    def rotary_dim(self) -> int:
        if self.head_dim is None:
            raise RuntimeError(f"{self.name}: head_dim unknown; call bind(head_dim=...) or inject() first")
        dim = int(self.head_dim * self.partial_rotary_factor)
        if dim % 2:
            raise ValueError(f"{self.name}: rotary dim {dim} (head_dim={self.head_dim} x "
                             f"partial_rotary_factor={self.partial_rotary_factor}) must be even")
        return dim

    # ---------------------------------------------------------------- the frequency law
    def base_inv_freq(self, device: torch.device | None = None) -> Tensor:
        return rope_inv_freq(self.rotary_dim, self.theta, device=device)

    def frequencies(self, seq_len: int | None = None, device: torch.device | None = None
                    ) -> tuple[Tensor, float]:
        """``(inv_freq [rotary_dim/2] float32, attention_scaling)`` for the current length."""
        return self.base_inv_freq(device), 1.0

    def frequencies_key(self, seq_len: int | None) -> Any:
        """Identifies the frequencies; None means they must not be cached (learned ones)."""
        return "static"

    def positions_for_angles(self, positions: Tensor) -> Tensor:
        """Positions as the angles see them (identity; interpolation variants may override)."""
        return positions

    # ---------------------------------------------------------------- cos / sin
    def cos_sin_of(self, positions: Tensor, seq_len: int | None = None) -> tuple[Tensor, Tensor]:
        """cos/sin of these positions, computed (`cos_sin` caches a table of them per length)."""
        inv_freq, scaling = self.frequencies(seq_len, positions.device)
        return rope_cos_sin(self.positions_for_angles(positions), inv_freq, scaling)

    def cos_sin(self, positions: Tensor, seq_len: int | None = None, start: int | None = None
                ) -> tuple[Tensor, Tensor]:
        """cos/sin ``[B, N, R/2]`` (or per head ``[B, H, N, R/2]``), float32. ``start``: the
        positions are known to be ``start + arange(N)`` (`AttentionContext.q_start`)."""
        device = positions.device
        key = self.frequencies_key(seq_len)
        if key is None or positions.dtype.is_floating_point or not positions.numel():
            return self.cos_sin_of(positions, seq_len)
        a = arange_offset(positions, start)
        need = max_position(positions, a)
        have = self._cos.shape[-2] if self._cos.dim() >= 2 else 0
        full_key = (key, device)
        if full_key != self._table_key or need is None or need > have:
            if need is None or Mode.tracing():
                # values not known without a read, or a table that would have to grow inside a
                # traced graph (`reserve` sizes it beforehand): the formula at these positions
                return self.cos_sin_of(positions, seq_len)
            self._grow(full_key, need, have, seq_len)
        if a is not None and a >= 0:  # zero-copy slices of the tables
            b, n = positions.shape
            sl = slice(a, a + n)
            if self._cos.dim() == 3:  # per-head table [H, L, R/2]
                return self._cos[None, :, sl].expand(b, -1, -1, -1), self._sin[None, :, sl].expand(b, -1, -1, -1)
            return self._cos[None, sl].expand(b, -1, -1), self._sin[None, sl].expand(b, -1, -1)
        if self._cos.dim() == 3:
            return self._cos[:, positions].transpose(0, 1), self._sin[:, positions].transpose(0, 1)
        return self._cos[positions], self._sin[positions]

    def _grow(self, full_key: Any, need: int, have: int, seq_len: int | None) -> None:
        size = max(need, 2 * have if full_key == self._table_key else need, 256)
        self._cos, self._sin = self.cos_sin_of(torch.arange(size, device=full_key[1]), seq_len)
        self._table_key = full_key
        self._pair_tables.clear()

    def reserve(self, n_positions: int, device: torch.device | None = None) -> None:
        """Build the cos/sin table for positions ``< n_positions`` now, outside any traced region
        (`torch.compile` then reads slices of it; a table cannot grow inside a graph)."""
        key = self.frequencies_key(None)
        if key is None or self.head_dim is None:
            return
        device = device if device is not None else self._cos.device
        full_key = (key, device)
        have = self._cos.shape[-2] if self._cos.dim() >= 2 and full_key == self._table_key else 0
        if n_positions > have:
            self._grow(full_key, n_positions, have, None)

    # ---------------------------------------------------------------- Hugging Face mapping
    @classmethod
    def config_from_rope_parameters(cls, rope_parameters: dict[str, Any], max_position_embeddings: int,
                                    original_max_position_embeddings: int) -> dict[str, Any]:
        """The ``__init__`` arguments of the law transformers reads from ``rope_parameters``.

        `posenc_lightning.encodings.hf.from_hf` calls it on the class whose `hf_rope_type` the dict
        names; each law adds the fields it reads (transformers' names) to the shared ones here.

        Args:
            rope_parameters: the config's ``rope_parameters`` (or older ``rope_scaling``).
            max_position_embeddings: ``config.max_position_embeddings``.
            original_max_position_embeddings: the original length, resolved as transformers does
                (a top-level config value, else the dict's, else ``max_position_embeddings``).

        Returns:
            The config to build this class with.

        Raises:
            ValueError: a field the law needs is missing.
        """
        p = rope_parameters
        return {"theta": float(p.get("rope_theta", p.get("theta", 10000.0))),
                "partial_rotary_factor": float(p.get("partial_rotary_factor", 1.0))}

    @classmethod
    def _required(cls, rope_parameters: dict[str, Any], key: str) -> Any:
        if rope_parameters.get(key) is None:
            raise ValueError(f"from_hf: rope_type {cls.hf_rope_type!r} needs {key!r} in rope_parameters "
                             f"(got {sorted(rope_parameters)})")
        return rope_parameters[key]

    def to_rope_parameters(self, layout: str = "half") -> tuple[dict[str, Any], int | None] | None:
        """``rope_theta``, ``partial_rotary_factor`` (when not 1) and `hf_rope_type`, then the law's
        own fields; None for a law with no `hf_rope_type` or whose layout is not ``layout``.

        Args:
            layout: how the target model pairs channels: ``"half"`` (Llama, most models) or
                ``"interleaved"`` (Llama 4, Cohere: adjacent pairs).

        Returns:
            ``(rope_parameters, max_position_embeddings or None)``, or None.
        """
        if self.hf_rope_type is None or self.layout != layout:
            return None
        law = self._rope_law_parameters()
        if law is None:
            return None
        fields, max_pos = law
        p: dict[str, Any] = {"rope_theta": self.theta}
        if self.partial_rotary_factor != 1.0:
            p["partial_rotary_factor"] = self.partial_rotary_factor
        return {**p, "rope_type": self.hf_rope_type, **fields}, max_pos

    def _rope_law_parameters(self) -> tuple[dict[str, Any], int | None] | None:
        """The law's own ``rope_parameters`` fields and the ``max_position_embeddings`` transformers
        must see (None: keep the model's); None when this instance has no transformers form."""
        return {}, None

    @property
    def fused_rotary(self) -> Encoding | None:
        """Itself when its rotation is exactly `RotaryEncoding.rotate` (and `rotation_tables`) of ``[B, N]`` positions with
        frequencies that carry no gradient (learned frequencies stay on the mixin's path)."""
        own = type(self).rotate is RotaryEncoding.rotate and type(self).rotation_tables is RotaryEncoding.rotation_tables
        if not own or self.position_dims != 1:
            return None
        return None if any(p.requires_grad for p in self.parameters()) else self

    def rotation_tables(self, ctx: AttentionContext) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(cos_q, sin_q, cos_k, sin_k)`` of the call's positions (`cos_sin`), float32: what
        `rotate` turns q and k by (xPos scales them)."""
        seq_len = ctx.seq_len if self.frequencies_key(None) != "static" else None
        cq, sq = self.cos_sin(ctx.q_pos, seq_len, ctx.q_start)
        ck, sk = (cq, sq) if ctx.k_pos is ctx.q_pos else self.cos_sin(ctx.k_pos, seq_len, ctx.k_start)
        return cq, sq, ck, sk

    def _pair_key(self, ctx: AttentionContext, dtype: torch.dtype) -> Any:
        """The key of this call's tables in `_pair_tables`, or None: not cached (traced, positions
        not a known ``start + arange``, or frequencies that must not be cached)."""
        if ctx.mode.compiling or ctx.q_start is None or ctx.k_start is None or ctx.q_pos.is_floating_point():
            return None
        fkey = self.frequencies_key(ctx.seq_len if self.frequencies_key(None) != "static" else None)
        if fkey is None:
            return None
        return (fkey, ctx.q_pos.device, dtype, ctx.q_start, ctx.k_start, tuple(ctx.q_pos.shape),
                tuple(ctx.k_pos.shape), ctx.k_pos is ctx.q_pos)

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        # the compute dtype (`autograd.rotary.rotary_dtype`; a Python choice: promote_types dispatches)
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        key = self._pair_key(ctx, dtype)
        tables = self._pair_tables.get(key) if key is not None else None
        if tables is None:
            cq, sq, ck, sk = self.rotation_tables(ctx)
            if ck.dim() == 4 and k.shape[1] != ck.shape[1]:  # per-head freqs with grouped kv heads
                raise ValueError(f"{self.name}: per-head frequencies need n_kv_heads == n_heads")
            dtype = torch.float64 if cq.dtype == torch.float64 else dtype
            # [B, H|1, N, R/2] in the compute dtype, as `rotate_qk` takes them without a cast or a view
            tables = tuple((t if t.dim() == 4 else t[:, None]).to(dtype) for t in (cq, sq, ck, sk))
            if key is not None:
                if len(self._pair_tables) >= 4:  # a few: a decode step misses anyway
                    self._pair_tables.clear()
                self._pair_tables[key] = tables
        return rotate_qk(q, k, *tables, self.layout, ctx.mode.compiling)


@register("rope", "rotate", "Rotary position embedding: q, k rotated by m*theta_i (Su et al., 2021)")
class RoPE(RotaryEncoding):
    """Plain RoPE (RoFormer eq. 15): each pair of dimensions of q and k at position m is rotated by
    ``m theta_i`` with ``theta_i = theta^(-2i/d)``, so ``q_m . k_n`` depends on ``m - n`` only;
    see `RotaryEncoding` for theta, layout and partial_rotary_factor.

    Args:
        p: p-RoPE's fraction (Barbero et al., ICLR 2025): keep the fraction ``p`` of the highest
            frequencies and drop the lowest (`functional.rope.p_rope_inv_freq`); 1 is plain RoPE,
            0 is NoPE. Unlike ``partial_rotary_factor``, which spreads the whole spectrum over fewer
            channels, the kept frequencies are exactly those of full RoPE.
    """

    hf_rope_type: ClassVar[str | None] = "default"

    def __init__(self, theta: float = 10000.0, layout: Literal["half", "interleaved"] = "half",
                 partial_rotary_factor: float = 1.0, p: float = 1.0) -> None:
        super().__init__(theta=theta, layout=layout, partial_rotary_factor=partial_rotary_factor)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"rope: p (p-RoPE's kept fraction of the highest frequencies) must be in [0, 1], got {p}")
        self.p = float(p)

    def base_inv_freq(self, device: torch.device | None = None) -> Tensor:
        if self.p == 1.0:
            return rope_inv_freq(self.rotary_dim, self.theta, device=device)
        return p_rope_inv_freq(self.rotary_dim, self.theta, self.p, device=device)

    def _rope_law_parameters(self) -> tuple[dict[str, Any], int | None] | None:
        """None with p < 1: transformers has no p-RoPE."""
        return super()._rope_law_parameters() if self.p == 1.0 else None
