"""The block engine shared by sdpa's rows (`sdpa`) and the blockwise backend's tiles (`tiles`): how many
query rows one block takes (one budget, `Tunables.bias_block_bytes`), and a block's bias rows recomputed from
stand-ins for the bias's inputs with their gradient routed back to those inputs (`BlockRows`),
whether a block's rows are new, so that its mask may be written into them (`owned_rows`), and a
block's causal mask added to it (`hide_after_diagonal`).

A bias is never materialized ``[H, N, N]``: a block of query rows gets its slice (`Bias.rows`), and
backward recomputes it from detached windows of `Bias.grad_inputs` (`Bias.rows_from`,
`Bias.input_windows`), differentiated there (`block_grad.block_vjp`): gradients are window-sized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from posenc_lightning.attention.backends.engine.block_grad import block_vjp
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import Bias
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables

_F32 = 4


def rows_within(n_rows: int, row_bytes: int, live: int = 1, least: int | None = None, *,
                tunables: Tunables = DEFAULT_TUNABLES) -> int:
    """Query rows per block so that ``live`` block-sized tensors of ``row_bytes`` per row fit in
    the block budget (`Tunables.bias_block_bytes`): at least ``least``, at most ``n_rows``.

    Args:
        n_rows: the most rows a block may take (the queries, or a backend's own cap).
        row_bytes: bytes of one query row of one such tensor.
        live: how many such tensors a block keeps alive together.
        least: the fewest rows (None: `Tunables.min_rows`).
        tunables: the call's (`functional.mode.Mode.tunables`).

    Returns:
        The rows per block.
    """
    least = tunables.min_rows if least is None else least
    return int(min(n_rows, max(least, tunables.bias_block_bytes // (live * max(row_bytes, 1)))))


def forward_rows(n_heads: int, n_q: int, n_k: int, *, tunables: Tunables = DEFAULT_TUNABLES) -> int:
    """Query rows per block of sdpa's forward by rows: one block of bias ``[1, H, rows, keys]``."""
    return rows_within(n_q, _F32 * n_heads * max(n_k, 1), tunables=tunables)


def backward_rows(b: int, n_heads: int, n_q: int, n_k: int, share: float = 1.0, released: bool = False,
                  threads: int = 1, *, forward_blocks: bool = False, tunables: Tunables = DEFAULT_TUNABLES) -> int:
    """Query rows per block of the own backward passes: half a forward block, as the logits, the
    weights, ``dS`` and the bias rows of a block are alive together; ``share`` of that for a bias
    whose recomputed rows keep more row-sized state (`Bias.backward_share`).

    Args:
        b, n_heads, n_q, n_k: the batch, heads, queries and keys.
        share: `Bias.backward_share`.
        released: the caller frees a block's bias rows once they are in its logits
            (`BlockRows.release`): with ``share`` 1 and more than one thread the block takes the
            whole budget (the engine's two block buffers, the rows only until the softmax): half
            the blocks, half the per-block fixed cost, which the threads do not share (at one
            thread the smaller block measured as fast or faster; CHANGELOG.md). A share below 1
            keeps half a block times ``share``.
        threads: the intra-op threads the backward runs on (1 where traced: no thread count is read
            inside a compiled graph).
        forward_blocks: the bias asks for the forward's blocks (`Bias.forward_blocks`): with
            ``released`` and ``share`` 1 the whole budget at one thread too.
        tunables: the call's (`functional.mode.Mode.tunables`).

    Returns:
        The rows per block.
    """
    whole = released and share >= 1.0 and (threads > 1 or forward_blocks)
    rows = rows_within(n_q, _F32 * b * n_heads * max(n_k, 1), live=1 if whole else 2, tunables=tunables)
    return rows if share >= 1.0 else max(tunables.min_rows // 2, int(rows * share))


def tile_rows(b: int, n_heads: int, n_k: int, cap: int, least: int, *, tunables: Tunables = DEFAULT_TUNABLES) -> int:
    """Query rows per block of the blockwise backend with a bias computed by rows: a block's bias
    rows and their gradient live across all its key tiles, beside the rows' own intermediates
    (four block-sized tensors); at most ``cap``, at least ``least``."""
    return rows_within(cap, _F32 * b * n_heads * max(n_k, 1), live=4, least=least, tunables=tunables)


def wide_zeros(t: Tensor) -> Tensor:
    """A zero accumulator for ``t``'s gradient, float32 or wider."""
    return torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32), device=t.device)


@dataclass(eq=False)
class BlockRows:
    """One block's bias rows (detached) and what routes their gradient to the bias's inputs:
    ``live`` the inputs differentiated to, ``windows`` the part of each input the rows read.
    ``rows`` is None once `release` dropped it (the rows' shape and dtype are kept for `backward`)."""

    rows: Tensor | None
    pullback: Callable[[Tensor], tuple[Tensor, ...]] | None
    live: tuple[int, ...]
    windows: tuple

    def __post_init__(self) -> None:
        self.shape, self.dtype = self.rows.shape, self.rows.dtype

    def release(self) -> Tensor:
        """The rows, no longer held here: once the caller has added them to the logits, their
        block-sized memory is free before the block's softmax and ``dS`` (a pullback keeps what
        it needs itself), so a backward block may take more rows in the same memory."""
        rows, self.rows = self.rows, None
        return rows

    @classmethod
    def of(cls, bias: Bias, inputs: Sequence[Tensor], need: Sequence[bool], start: int, stop: int, k_stop: int,
           compiling: bool, k_start: int = 0, diagonal: int | None = None, eager_autograd: bool = True
           ) -> BlockRows:
        """The rows ``[start, stop) x [k_start, k_stop)`` of ``bias`` from detached windows of its
        ``inputs`` (`Bias.grad_inputs`), differentiable to those where ``need``: by the bias's own
        `HandRows.rows_and_pullback` where it has one (eagerly, all the keys, grad mode off), else
        ``rows_from`` differentiated (`block_grad.block_vjp`).

        Args:
            bias: the bias (`Bias.recomputable`).
            inputs: its `Bias.grad_inputs`.
            need: per input, whether it needs a gradient.
            start: first query row.
            stop: query row past the last.
            k_stop: keys ``0..k_stop-1``.
            compiling: traced by ``torch.compile`` (`block_grad.block_vjp`).
            k_start: first key (`Bias.rows_past`; the windows are those of keys ``[0, k_stop)``).
            diagonal: the caller's causal mask hides key ``j`` from row ``start + r`` where ``j >
                diagonal + r`` (`HandRows.rows_and_pullback`'s), or None.
            eager_autograd: the call's `Tunables.eager_autograd` (`block_grad.block_vjp`).

        Returns:
            The block.
        """
        windows = tuple(bias.input_windows(start, stop, k_stop))
        views = [t.detach() if w is None else t.detach()[w] for t, w in zip(inputs, windows)]
        live = tuple(i for i, n in enumerate(need) if n)

        def rows_of(*diff: Tensor) -> Tensor:  # the rows as a function of the inputs that need a gradient
            vs = list(views)
            for i, d in zip(live, diff):
                vs[i] = d
            if k_start:
                return bias.rows_past(start, stop, k_start, k_stop, vs)  # [B|1, H|1, r, K - k_start]
            return bias.rows_from(start, stop, k_stop, vs)  # [B|1, H|1, r, K]

        if not live:
            return cls(rows_of().detach(), None, live, windows)
        if not (compiling or k_start or torch.is_grad_enabled()):  # no graph wanted of the gradients
            hand = bias.hand_rows()  # `Bias.hand_rows`
            fused = None if hand is None else hand.rows_and_pullback(start, stop, k_stop, views, need, diagonal)
            if fused is not None:
                return cls(fused[0], fused[1], live, windows)
        rows, pullback = block_vjp(rows_of, *[views[i] for i in live], compiling=compiling,
                                   eager_autograd=eager_autograd)
        return cls(rows.detach(), pullback, live, windows)

    def backward(self, d_rows: Tensor, into: Callable[[int], Tensor]) -> None:
        """Add the gradient of the rows, ``d_rows [B, H, r, K]`` (summed where the rows broadcast),
        to each live input's accumulator ``into(i)`` (full-size), window by window."""
        if self.pullback is None:
            return
        for dim in (0, 1):
            if self.shape[dim] == 1 and d_rows.shape[dim] > 1:
                d_rows = d_rows.sum(dim, keepdim=True)
        for i, gi in zip(self.live, self.pullback(d_rows.to(self.dtype))):
            acc, w = into(i), self.windows[i]
            (acc if w is None else acc[w]).add_(gi)


def hide_after_diagonal(t: Tensor, first: int, k0: int = 0, hides: dict | None = None) -> Tensor:
    """``t [..., r, K]`` (column ``j``: key ``k0 + j``; row ``i`` sees keys up to ``first + i``) with
    ``-inf`` added in place where a row may not see the key: a 0/-inf triangle over the columns from
    the first key hidden from row 0 on (the keys before it are seen by every row), the logits finite.

    Args:
        t: the block, written in place.
        first: the last key the first row sees.
        k0: the key of ``t``'s first column.
        hides: a dict kept by the caller across the blocks of one call (eagerly), where the triangle
            of each block shape is built once.

    Returns:
        ``t``.
    """
    j0 = max(0, first - k0 + 1)
    if j0 >= t.shape[-1]:  # the last key is visible to the first row: nothing hidden
        return t
    key = (t.shape[-2], t.shape[-1] - j0, first - k0 + 1 - j0, t.dtype)  # column j0 + j hidden from row i
    hide = None if hides is None else hides.get(key)  # where j >= i + key[2]
    if hide is None:
        hide = torch.full(key[:2], float("-inf"), dtype=t.dtype, device=t.device).triu_(key[2])
        if hides is not None:
            hides[key] = hide
    t[..., j0:].add_(hide)
    return t


def owned_rows(rows: Tensor, bias: Bias, mask: AttentionMask, batch: int, compiling: bool) -> bool:
    """The rows were computed just now (not a view or one of the bias's own tensors), so the mask
    may be written into them: one block-sized copy less. Only for kinds whose rows are new
    tensors (`Bias.fresh_rows`), eagerly, and not rows shared by a batch (``[1, ...]``) that a
    per-batch mask (documents, padding) would have to widen."""
    if not bias.fresh_rows or rows.requires_grad or rows._base is not None or compiling:
        return False
    if rows.shape[0] != batch and (mask.q_segments is not None or mask.k_valid is not None):
        return False
    ptr = rows.untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() != ptr for t in bias.grad_inputs() or ())
