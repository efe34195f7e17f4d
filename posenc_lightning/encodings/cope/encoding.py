"""CoPE (Golovneva et al., 2024, "Contextual Position Encoding: Learning to Count What's
Important"): positions counted by content gates, added to the logits as ``z_i[p_ij]``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding, GatedCounts, span
from posenc_lightning.encodings.cope.bias import CoPEBias
from posenc_lightning.encodings.cope.rows import cope_band_rows, cope_causal_rows, cope_lookup
from posenc_lightning.encodings.registry import register
from posenc_lightning.functional.cope import (
    cope_band_counts,
    cope_clamped_count,
    cope_counts,
    cope_interpolate,
    cope_positions,
)
from posenc_lightning.functional.positions import host_reads_ok
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables


@register("cope", "bias", "Contextual position encoding: gated counts of keys, interpolated position embeddings (Golovneva et al., 2024)")
class CoPE(Encoding):
    """``logits_ij += z_i[p_ij]`` with ``g_ij = sigmoid(q_i.k_j / sqrt(d))`` (the scaled logits, as
    the paper's code), ``p_ij = sum_{t=j..i} g_it`` clamped to ``max_position - 1``, and
    ``z_i[p] = q_i . e[p]`` interpolated at fractional ``p`` (eqs. 3-5).

    Args:
        max_position: number of position embeddings ``e[0..max_position-1]`` (the clamp).
        per_head: one embedding table per head instead of one shared by the heads.
        init_std: embeddings start at ``N(0, init_std)`` (0 = zeros, the paper's init).

    Initialization: as the paper's listing (Golovneva et al., 2024, ``class CoPE``): the position
    embeddings at zeros, so every count starts with no bias; the listing's ``npos_max`` is
    ``max_position`` here, an argument the listing leaves to each experiment.
    """

    #: rows by blocks (sdpa, blockwise) or the gated counts in the Triton kernels' tile (`CoPEBias`)
    bias_kinds = (CoPEBias,)

    def __init__(self, max_position: int = 64, per_head: bool = False, init_std: float = 0.0) -> None:
        super().__init__()
        if max_position < 2:
            raise ValueError(f"cope: max_position must be >= 2, got {max_position}")
        self.max_position = max_position
        self.per_head = per_head
        self.init_std = init_std
        self.pos_emb: nn.Parameter | None = None

    def _ready(self) -> bool:
        return self.head_dim is not None and (self.n_heads is not None or not self.per_head)

    def build(self) -> None:
        heads = self.n_heads if self.per_head else 1
        w = torch.zeros(heads, self.head_dim, self.max_position)
        if self.init_std > 0:
            nn.init.normal_(w, std=self.init_std)
        self.pos_emb = nn.Parameter(w)

    def gates(self, q: Tensor, k: Tensor) -> Tensor:
        """``sigmoid(q_i . k_j / sqrt(d))`` ``[B, H, Nq, Nk]`` float32 (GQA keys repeated)."""
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale(q.shape[-1])
        return torch.sigmoid(logits)

    def positions(self, q: Tensor, k: Tensor, causal: bool = True) -> Tensor:
        """Contextual positions ``[B, H, Nq, Nk]`` (unclamped)."""
        return cope_positions(self.gates(q, k), causal, q_offset=k.shape[-2] - q.shape[-2])

    def bias_tensor(self, q: Tensor, k: Tensor, causal: bool = True, q_offset: int | None = None) -> Tensor:
        """``z_i[p_ij]`` ``[B, H, Nq, Nk]`` float32 (eqs. 3-5); query ``i`` sits at key index
        ``i + q_offset`` (default ``Nk - Nq``: cached keys first)."""
        if self.pos_emb is None:
            raise RuntimeError("cope: head_dim unknown; call bind(head_dim=...) or inject() first")
        if q_offset is None:
            q_offset = k.shape[-2] - q.shape[-2]
        pos = cope_positions(self.gates(q, k), causal, q_offset=q_offset).clamp(max=self.max_position - 1)
        z = torch.matmul(q.float(), self.pos_emb.float())  # [B, H, Nq, P]
        return cope_interpolate(z, pos)

    def bias_rows(self, q: Tensor, k: Tensor, causal: bool, q_offset: int, pos_emb: Tensor | None = None,
                  clamped: int = 0, counted: tuple[Tensor, Tensor] | None = None,
                  tunables: Tunables = DEFAULT_TUNABLES) -> Tensor:
        """`bias_tensor` by a faster route, same values and gradients (``pos_emb``: a stand-in for
        the parameter; causal: `cope_causal_rows`, ``k`` the keys from index ``clamped`` on, see
        `clamped_keys`; ``counted``: the rows' gates and counts over ``k`` if already computed,
        `cope_counts`). Computed by sub-blocks of about ``tunables.cope_chunk_bytes`` of rows
        (``cope_grad_chunk_bytes`` with gradients), each recomputed in backward (checkpoint), so
        that the gates and counts of a whole block never coexist."""
        pos_emb = self.pos_emb if pos_emb is None else pos_emb
        grad = torch.is_grad_enabled()
        per_row = 4 * q.shape[0] * q.shape[1] * k.shape[-2]
        step = max(1, (tunables.cope_grad_chunk_bytes if grad else tunables.cope_chunk_bytes) // max(per_row, 1))
        if q.shape[-2] <= step:
            return self._rows(q, k, causal, q_offset, pos_emb, clamped, counted)
        pieces = []
        for a in range(0, q.shape[-2], step):
            part = None if counted is None else tuple(t[:, :, a:a + step] for t in counted)
            args = (q[:, :, a:a + step], k, causal, q_offset + a, pos_emb, clamped, part)
            if grad:
                from torch.utils.checkpoint import checkpoint

                pieces.append(checkpoint(self._rows, *args, use_reentrant=False))
            else:
                pieces.append(self._rows(*args))
        return torch.cat(pieces, dim=-2)

    #: the share of the engine's backward blocks of rows these rows take (`Bias.backward_share`):
    #: recomputed from q and k, they keep the gates, counts and q/k windows' gradients alive too
    BACKWARD_SHARE = 0.75

    def _rows(self, q: Tensor, k: Tensor, causal: bool, q_offset: int, pos_emb: Tensor, clamped: int = 0,
              counted: tuple[Tensor, Tensor] | None = None) -> Tensor:
        if causal:
            return cope_causal_rows(q.float(), k.float(), pos_emb.float(), self.softmax_scale(q.shape[-1]),
                                    self.max_position, q_offset, clamped, counted)
        pos = cope_positions(self.gates(q, k), causal, q_offset=q_offset)
        return cope_lookup(torch.matmul(q.float(), pos_emb.float()), pos, self.max_position)

    def clamped_keys(self, q: Tensor, k: Tensor, q_offset: int, width: int | None = None) -> int:
        """Causal: how many leading keys have ``p_ij >= max_position - 1`` for every query row of
        ``q`` (query ``i`` at key ``i + q_offset``): there the bias is ``z_i[P - 1]`` and neither
        the gates nor the counts get a gradient (the clamp), so rows need only the keys after them.
        Read from the suffix sums over the ``width`` keys before the first query (doubled until
        they reach the clamp; the same sums, in the same order, as the rows'); 0 where values
        cannot be read."""
        return self._clamp(q, k, q_offset, width)[0]

    def _clamp(self, q: Tensor, k: Tensor, q_offset: int, width: int | None = None
               ) -> tuple[int, tuple[Tensor, Tensor] | None]:
        """`clamped_keys` and, where some are, the rows' gates and counts over the keys after
        them (`cope_counts`), which the search computed: the rows then need not compute them."""
        top = self.max_position - 1
        if not host_reads_ok(q):
            return 0, None
        width = max(width or 0, 2 * self.max_position)  # counts of fewer than P - 1 gates (<= 1) never clamp
        with torch.no_grad(), torch.autocast(q.device.type, enabled=False):  # float32, as the rows
            while q_offset - width > 0:
                j0 = q_offset - width
                g, suffix = cope_counts(q.float(), k[:, :, j0:].float(), self.softmax_scale(q.shape[-1]), q_offset - j0)
                # p_ij does not increase along j: each row's count of p >= top is its clamped prefix
                n = cope_clamped_count(suffix, top)
                if n:  # the last keys' suffix sums are a prefix of suffix
                    return j0 + n, (g[..., n:], suffix[..., :suffix.shape[-1] - n])
                width *= 2
        return 0, None

    def _band(self, q: Tensor, k: Tensor, q_offset: int, width: int = 0
              ) -> tuple[int, tuple[Tensor, Tensor] | None]:
        """Causal: the narrowest band (`cope_band_counts`) of the rows of ``q`` (query ``i`` at key
        ``q_offset + i``, ``k`` the keys up to the last query) that leaves every key before each
        row's band clamped (``p_ij >= max_position - 1``: there the bias is ``z_i[P - 1]`` and nothing
        gets a gradient), with its gates and counts: ``(width, counted)``; ``(0, None)`` where no band
        shorter than the keys does, or values cannot be read. Bands from ``width`` (at least
        ``2 * max_position``: fewer gates never reach the clamp) are counted, doubled until one is."""
        top = self.max_position - 1
        if not host_reads_ok(q):
            return 0, None
        width = max(width, 2 * self.max_position)
        with torch.no_grad(), torch.autocast(q.device.type, enabled=False):  # float32, as the rows
            while q_offset - width > 0:
                g, suffix = cope_band_counts(q.float(), k[:, :, q_offset - width:].float(),
                                             self.softmax_scale(q.shape[-1]), width)
                # the band's leading columns clamped in every row: the rest is the band
                n = min(cope_clamped_count(suffix, top), width)
                if n:
                    return width - n, (g[..., n:], suffix[..., :suffix.shape[-1] - n])
                width *= 2
        return 0, None

    def bias(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> Bias | None:
        if self.pos_emb is None:
            raise RuntimeError("cope: head_dim unknown; call bind(head_dim=...) or inject() first")
        n_q, n_k, causal = q.shape[-2], k.shape[-2], ctx.causal
        last: dict[tuple[int, int, int], int] = {}  # a block's window may be asked more than once
        # the gates and counts the search computed for a block, until its rows take them
        counted: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}
        # along one pass over the blocks: the previous block's width is the next one's first guess;
        # where no key was clamped, counts over twice the keys are needed before a new search
        walk = {"s": -1, "width": 0, "retry": 0}
        # blocks of the run form (`constant_before`): the band's first key and width, and its counts
        bands: dict[tuple[int, int, int], tuple[int, int]] = {}
        band_counted: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}

        def keys(e: int, ke: int) -> int:
            # p_ij counts the keys between j and i: rows [s, e) need q[s:e] and the keys up to
            # max(k_stop, their last query) only (what the blockwise backends ask for anyway)
            return min(n_k, max(ke, n_k - n_q + e))

        def first(s: int, e: int, ke: int) -> int:  # the keys before are clamped for rows [s, e)
            if not causal or not host_reads_ok(q):  # (traced: no values to read, no memo to write)
                return 0
            if bands.get((s, e, ke), (0, 0))[0]:
                return bands[s, e, ke][0]
            if (s, e, ke) not in last:
                last.clear()
                counted.clear()
                q_off, j = n_k - n_q + s, 0
                if s <= walk["s"]:  # a new pass
                    walk.update(width=0, retry=0)
                if q_off >= walk["retry"]:
                    j, found = self._clamp(q[:, :, s:e], k[:, :, :keys(e, ke)], q_off, walk["width"])
                    if found is not None:
                        counted[s, e, ke] = found
                    if j:
                        # the next block's first query clamps about as far back as this one's: its
                        # distance and a margin (a miss doubles the width and counts again)
                        walk.update(width=(q_off - j) + (q_off - j) // 4 + 16, retry=0)
                    else:
                        walk.update(width=0, retry=2 * q_off)
                walk["s"] = s
                last[s, e, ke] = j
            return last[s, e, ke]

        def run(s: int, e: int, ke: int) -> int:  # rows [s, e) past their bands: one value a row
            if not causal or not host_reads_ok(q):
                return 0
            if (s, e, ke) not in bands:
                bands.clear()
                band_counted.clear()
                q_off = n_k - n_q + s
                if s <= walk["s"]:  # a new pass
                    walk.update(width=0, retry=0)
                width, found = self._band(q[:, :, s:e], k[:, :, :keys(e, ke)], q_off, walk["width"])
                if found is not None:
                    band_counted[s, e, ke] = found
                    # the next block's band is about as wide as this one's: its width and a margin
                    walk.update(width=width + width // 4 + 16)
                walk["s"] = s
                bands[s, e, ke] = (q_off - width if found is not None else 0, width)
            return bands[s, e, ke][0]

        def past(s: int, e: int, k0: int, ke: int, q_rows: Tensor, k_keys: Tensor, pos_emb: Tensor,
                 banded: bool = False) -> Tensor:
            clamped = keys(e, ke) - k_keys.shape[-2] - k0  # the window's keys start at first(s, e, ke) >= k0
            c, width = bands.get((s, e, ke), (0, 0))
            # the run form's rows (`banded`: the keys a causal mask hides are free) on the bands, where
            # the window is the band's
            if banded and c and k0 < c and k_keys.shape[-2] == width + e - s:
                found = band_counted.pop((s, e, ke), None)
                if found is not None and found[0].shape[-2:] != (q_rows.shape[-2], width + 1):
                    found = None
                out = cope_band_rows(q_rows.float(), k_keys.float(), pos_emb.float(), self.softmax_scale(q.shape[-1]),
                                     self.max_position, width, clamped, found)
                return out if out.shape[-1] == ke - k0 else out[..., :ke - k0]
            found = counted.pop((s, e, ke), None)
            if found is not None and found[0].shape[-2:] != (q_rows.shape[-2], k_keys.shape[-2]):
                found = None  # not the window the search was for
            # query s at key n_k - n_q + s; the rows' first column is key k0
            out = self.bias_rows(q_rows, k_keys, causal, n_k - n_q + s - k0, pos_emb, clamped, found,
                                 ctx.mode.tunables)
            # a view only where keys are cut: new rows take sdpa's mask in place (`owned_rows`)
            return out if out.shape[-1] == ke - k0 else out[..., :ke - k0]

        def rows(s: int, e: int, ke: int, q_rows: Tensor, k_keys: Tensor, pos_emb: Tensor) -> Tensor:
            return past(s, e, 0, ke, q_rows, k_keys, pos_emb)

        def run_rows(s: int, e: int, k0: int, ke: int, q_rows: Tensor, k_keys: Tensor, pos_emb: Tensor) -> Tensor:
            return past(s, e, k0, ke, q_rows, k_keys, pos_emb, banded=True)

        out = CoPEBias.lazy(rows, n_q, n_k, inputs=(q, k, self.pos_emb),
                            window=lambda s, e, ke: (span(s, e, -2), span(first(s, e, ke), keys(e, ke), -2), None),
                            backward_share=self.BACKWARD_SHARE, constant_before=run, rows_past=run_rows)
        # what the Triton kernels read to count the positions in their tile (query i at key n_k - n_q + i)
        out.counts = GatedCounts(q, k, self.pos_emb, self.softmax_scale(q.shape[-1]), n_k - n_q, causal)
        return out
