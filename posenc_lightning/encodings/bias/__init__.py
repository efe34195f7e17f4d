"""The structured attention-bias kinds (docs/architecture.md, "Bias is a description, not a tensor").

A kind owns everything a backend asks of it, so no backend tests a bias's class:

==================== ====================================================== ==============
method               gives                                                  asked by
==================== ====================================================== ==============
``materialize()``    the dense ``[B|1, H, Nq, Nk]`` float32 tensor          eager
``rows(s, e, ke)``   rows ``s:e``, keys ``:ke`` only (abstract: no kind     sdpa (blocks)
                     falls back to building ``N x N`` silently)
``rows_from`` & co.  rows recomputed from stand-ins for its inputs          sdpa (backward)
``at(q_pos, k_pos)`` the same bias at other positions (``distance_only``)   sdpa (Toeplitz)
``key_only(...)``    ``q_ch[h] * k_ch[b, h, j]`` + a per-row term           sdpa (1 channel)
``head_scaled()``    ``w[h] * pattern(q_pos, k_pos)``, `HeadScaled`          blockwise (tiles)
``scaled(w)``        ``w * bias``, the same kind where it can be             mixture
``score_term(B, H)`` ``f(b, h, q_idx, kv_idx)`` for a flex ``score_mod``     flex
``fold_into(args)``  its part of the Triton kernels' arguments (a kind the    triton
                     kernels evaluate per tile fills ``args.tile``, `TileBias`)
``fused_in``         the fused forms that need no ``N x N`` ("kernel",       triton, flex
                     "score_mod"), read from `Encoding.bias_kinds`           (`supports`)
``value_dependent``  a `ValueDependentForm`: operands and hooks of a kind    sdpa (compiled,
                     whose cheapest form depends on values (rebuilt by name, opaque operator)
                     `opaque.py`)
``hand_rows()``      a `HandRows`: causal rows, and rows with their pullback sdpa (rows),
                     with no autograd graph, by the kind's own algorithm     block engine
==================== ====================================================== ==============

A new kind implements `materialize` and `rows`; every other method has a default that is exact
for any kind (dense score term and kernel argument, lazily scaled rows, no opaque operator). A kind
whose tile the Triton kernels evaluate registers an example tile in its own file
(`register_tile_kind`) for the kernels' resource report.
"""

from posenc_lightning.encodings.bias.dense import DenseBias, ProductBias
from posenc_lightning.encodings.bias.kinds import (
    Bias,
    BiasSum,
    GatedCounts,
    HandRows,
    HeadScaled,
    Index,
    KernelBias,
    KeyOnly,
    OpaqueOperands,
    OwnAttention,
    ScaledBias,
    ScoreTerm,
    ValueDependentForm,
    cut,
    span,
)
from posenc_lightning.encodings.bias.opaque import rebuild_bias, register_opaque_kind
from posenc_lightning.encodings.bias.structured import DecayBias, LinearBias, RelativeBias
from posenc_lightning.encodings.bias.tile import TileBias, register_tile_kind, tile_kinds

__all__ = [
    "Bias",
    "BiasSum",
    "DecayBias",
    "DenseBias",
    "GatedCounts",
    "HandRows",
    "HeadScaled",
    "Index",
    "KernelBias",
    "KeyOnly",
    "LinearBias",
    "OpaqueOperands",
    "OwnAttention",
    "ProductBias",
    "RelativeBias",
    "ScaledBias",
    "ScoreTerm",
    "TileBias",
    "ValueDependentForm",
    "cut",
    "rebuild_bias",
    "register_opaque_kind",
    "register_tile_kind",
    "span",
    "tile_kinds",
]
