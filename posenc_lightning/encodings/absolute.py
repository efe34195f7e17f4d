"""Stage-1 (and Q/K-path) absolute encodings: nope, sinusoidal, learned."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from posenc_lightning.encodings.base import AttentionContext, Encoding
from posenc_lightning.encodings.registry import register
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.positions import arange_offset, max_position
from posenc_lightning.functional.sinusoidal import sinusoidal_table


@register("nope", "none", "No positional encoding: the causal mask is the only order signal (Kazemnejad et al., 2023)")
class NoPE(Encoding):
    """The baseline: implements no stage."""

    def __init__(self) -> None:
        super().__init__()


@register("sinusoidal", "embed", "Fixed sin/cos table added to the token embeddings (Vaswani et al., 2017)")
class Sinusoidal(Encoding):
    """``h + PE(pos)`` with the table of Vaswani et al. (2017), section 3.5.

    Args:
        base: the wavelength base (10000 in the paper).
        scale_input: multiply ``h`` by ``sqrt(d_model)`` first, as the paper does with embeddings
            (section 3.4); without it a small-init embedding (std 0.02) is drowned by the unit-size
            table (TinyGPT at 200 steps: val ppl 20.3 without, 12.8 with).
    """

    def __init__(self, base: float = 10000.0, scale_input: bool = True) -> None:
        super().__init__()
        self.base = base
        self.scale_input = scale_input
        self.register_buffer("_table", torch.empty(0), persistent=False)

    def _ready(self) -> bool:
        return self.d_model is not None

    def reserve(self, n_positions: int, device: torch.device | None = None) -> None:
        if self.d_model is not None:
            self.table(n_positions, device if device is not None else self._table.device)

    def table(self, n: int, device: torch.device) -> Tensor:
        if self._table.shape[0] < n or self._table.device != device:
            size = max(n, 2 * self._table.shape[0])
            pos = torch.arange(size, device=device)
            self._table = sinusoidal_table(pos, self.d_model, self.base)
        return self._table[:n]

    def embed(self, h: Tensor, positions: Tensor, start: int | None = None) -> Tensor:
        if self.d_model is None:
            self.bind(d_model=h.shape[-1])
        alpha = math.sqrt(self.d_model) if self.scale_input else 1.0
        a = arange_offset(positions, start)
        size = max_position(positions, a) if not positions.dtype.is_floating_point else None
        if size is None or (Mode.tracing() and self._table.shape[0] < size):
            # float positions, or values not known without a read, or a table too small to grow
            # inside a traced graph: the formula at these positions
            pe = sinusoidal_table(positions, self.d_model, self.base)
        elif a is not None and a >= 0:  # the common case: a zero-copy slice of the table, one fused op
            pe = self.table(size, h.device)[a:]
        else:
            pe = self.table(size, h.device)[positions]
        return torch.add(pe.to(h.dtype), h, alpha=alpha)  # sqrt(d) h + PE


@register("learned", "embed", "Trainable absolute position table, at the input (GPT-2/BERT) or on the Q/K path")
class Learned(Encoding):
    """A trainable table indexed by position (GPT-2, BERT).

    Args:
        max_seq_len: rows in the table; longer sequences are an error (no extrapolation).
        mode: ``"input"`` adds ``P[pos]`` to the hidden state (stage 1); ``"qk"`` adds a
            per-head ``P[pos]`` to the queries and keys, not the values (stage 2).
        init_std: normal init of the table (0.02 as GPT-2).
    """

    def __init__(self, max_seq_len: int = 1024, mode: Literal["input", "qk"] = "input",
                 init_std: float = 0.02) -> None:
        super().__init__()
        if mode not in ("input", "qk"):
            raise ValueError(f"learned: mode must be 'input' or 'qk', got {mode!r}")
        self.max_seq_len = max_seq_len
        self.mode = mode
        self.init_std = init_std
        self.table: nn.Parameter | None = None

    @property
    def stages(self) -> frozenset[str]:
        return frozenset({"embed"} if self.mode == "input" else {"rotate"})

    def _ready(self) -> bool:
        if self.mode == "input":
            return self.d_model is not None
        return self.n_heads is not None and self.head_dim is not None

    def build(self) -> None:
        shape = (self.max_seq_len, self.d_model) if self.mode == "input" else (
            self.max_seq_len, self.n_heads, self.head_dim)
        self.table = nn.Parameter(torch.randn(*shape) * self.init_std)

    def check_positions(self, positions: Tensor, start: int | None = None) -> None:
        # the bound is checked where it costs no device sync and no graph break (a GPU then
        # raises a device-side index error for a position beyond the table)
        end = max_position(positions, start) if not positions.dtype.is_floating_point else None
        if end is not None and end > self.max_seq_len:
            raise ValueError(
                f"learned: position {end - 1} is beyond the learned table "
                f"(max_seq_len={self.max_seq_len}); a learned table cannot extrapolate. Build it "
                f"with a larger max_seq_len, or use a relative encoding (rope, alibi, fire, ...)")
        if positions.dtype.is_floating_point:
            raise ValueError("learned: positions must be integers (a table cannot be interpolated)")

    def embed(self, h: Tensor, positions: Tensor, start: int | None = None) -> Tensor:
        if self.mode != "input":
            return h
        self.check_positions(positions, start)
        a = arange_offset(positions, start)
        pe = self.table[a:a + positions.shape[1]] if a is not None else self.table[positions]
        return h + pe.to(h.dtype)

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        if self.mode != "qk":
            return q, k
        self.check_positions(ctx.k_pos, ctx.k_start)
        pq = self.table[ctx.q_pos].permute(0, 2, 1, 3)  # [B, H, Nq, D]
        pk = self.table[ctx.k_pos].permute(0, 2, 1, 3)
        if k.shape[1] != pk.shape[1]:  # grouped kv heads: use each group's first head
            pk = pk[:, :: pk.shape[1] // k.shape[1]]
        return q + pq.to(q.dtype), k + pk.to(k.dtype)
