"""`fire_rows`: a block of FIRE's bias by its cheapest exact route: by distance at known ``start +
arange`` positions (`by_distance`), by key elsewhere (`functions`), the formula when traced."""

from __future__ import annotations

import torch
from torch import Tensor

from posenc_lightning.encodings.fire import segment_rows
from posenc_lightning.encodings.fire.by_distance import Memo, _FireDiagonalRows, _forward
from posenc_lightning.encodings.fire.functions import _FireRows, fire_mlp
from posenc_lightning.functional.fire import fire_normalized_distance
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables


def fire_rows(q_pos: Tensor, k_pos: Tensor, c: Tensor, threshold: Tensor, w1: Tensor, b1: Tensor, w2: Tensor,
              b2: Tensor, eps: float = 1e-6, shift: int | None = None, table: Tensor | None = None,
              memo: Memo | None = None, last: int | None = None, tunables: Tunables = DEFAULT_TUNABLES,
              reuse: bool = False) -> Tensor:
    """FIRE's bias ``[B, H, Nq, Nk]`` (eq. 3): `fire_mlp` of `fire_normalized_distance`, the same
    arithmetic, as one autograd Function. The units are selected per group of keys (`_select`): the
    forward folds those on throughout a group into ``A x + B`` (`_column_rows`), the backward (eq. 3
    differentiated by hand, `_column_grads`) takes the same selection, so a folded unit's gradient
    is a sum over its groups and only the units that switch are evaluated per element, in runs over
    their spans. No autograd graph of the ``[B, Nq, Nk]`` intermediates; saved: ``x`` and the
    selection.

    ``shift``: the positions are known to be ``a + arange`` in one row (shared by the batch) with
    ``q_pos[0, r] - k_pos[0, j] = shift + r - j``; the rows are then computed by distance
    (`_FireDiagonalRows`). ``table`` (with ``shift``): ``[H, Nq + Nk - 1]`` values of a
    distance-only term added to the rows, ``table[h, Nq - 1 - r + j]`` at row r, key j. ``memo``:
    where the rows by distance keep their selection without grad (`by_distance._selection`); ``last``
    (with ``shift``, without grad): the last column of the distance layout a caller's causal mask
    shows, past which the rows need only be finite (`FireBias.causal_rows`). ``tunables``: the
    call's (`Mode.tunables`): the keys per unit selection, the runs' slack, the MLP's chunks.
    ``reuse`` (with ``shift``, without grad): the rows are written into a buffer reused by the next
    such call on this thread (`layouts.padded_rows`), for a caller that consumes them first.
    """
    diagonal = shift is not None and q_pos.shape[0] == k_pos.shape[0] == 1 and q_pos.shape[1] and k_pos.shape[1]
    if table is not None and (not diagonal or Mode.tracing()):
        raise ValueError("fire_rows: a table is added by distance only (known arange positions, eagerly)")
    if Mode.tracing():  # data-dependent unit selection: `fire_mlp`'s compiled form
        x = fire_normalized_distance(q_pos, k_pos, c, threshold, eps)
        return fire_mlp(x.flatten(1), w1, b1, w2, b2, tunables).unflatten(-1, x.shape[1:])
    if diagonal:
        if not torch.is_grad_enabled():  # nothing to record: the Function's forward, no `apply` (binding)
            out = segment_rows.rows(c, threshold, w1, b1, w2, b2, table, q_pos, k_pos, eps, shift, tunables, reuse,
                                    None if memo is None else memo[0])
            if out is not None:
                return out
            return _forward(c, threshold, w1, b1, w2, b2, table, q_pos, k_pos, eps, shift, None, memo, last,
                            tunables, reuse)[0]
        return _FireDiagonalRows.apply(c, threshold, w1, b1, w2, b2, table, q_pos, k_pos, eps, shift, tunables)[0]
    return _FireRows.apply(c, threshold, w1, b1, w2, b2, q_pos, k_pos, eps, shift, tunables)[0]
