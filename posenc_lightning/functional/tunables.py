"""The backends' tunables: the sizes and switches that bound how the attention backends work (block
budgets, tile sizes, which fast path may run), in one typed, frozen record.

A call's `functional.mode.Mode` carries one (`Mode.tunables`, the defaults unless the caller gave
another): the attention module declares it (``PosEncAttentionMixin.posenc_tunables``, read when the
call's `AttentionContext` is made) or a backend is given it (``attend(..., tunables=...)``), and the
code that reads a value takes it from there, never from a module global. None of them changes a
result beyond rounding; they trade memory for speed. The measurements behind the defaults are in
CHANGELOG.md.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

__all__ = ["DEFAULT_TUNABLES", "Tunables"]


@dataclass(frozen=True)
class Tunables:
    """The backends' tunables (`functional.tunables`); ``Tunables(bias_block_bytes=2**16)`` changes one."""

    #: the block engine's budget: the bytes of one block of bias rows (``[B|1, H, rows, keys]``
    #: float32), never the whole ``[H, N, N]``. Content-dependent rows (an MLP per pair, gates and
    #: counts) keep several temporaries of this size, so it is small next to the attention's own
    #: memory; smaller blocks cost more per-block overhead than they save.
    bias_block_bytes: int = 8 * 2**20
    #: the fewest query rows of an engine block, whatever the budget says (a block's fixed cost)
    min_rows: int = 16
    #: sdpa: recompute each block's bias in backward instead of keeping every block alive until then
    checkpoint_blocks: bool = True
    #: sdpa, under compile on CPU: an attention whose weights ``[B, H, Nq, Nk]`` fit in this many
    #: bytes (float32) runs as one traced block (rows, SDPA's math form and its backward, fused by
    #: inductor; at most this much saved for backward). Below it the fixed cost of a loop over
    #: blocks (the own backward, the opaque operator) outweighs the work.
    compiled_one_block_bytes: int = 2 * 2**20
    #: sdpa's run form: a block runs its constant keys on SDPA's CPU kernel when the keys past the
    #: run are at most this share of the block's (the band past it costs the engine's own work)
    run_share: float = 0.7
    #: sdpa's run form: a block takes ``sqrt(run_keys_per_row * keys)`` query rows; each kernel call
    #: reads and writes the gradients of all the run's keys while the band grows with the rows, so
    #: the rows grow with the square root of the keys
    run_keys_per_row: int = 80
    #: sdpa's run form: the band-sized tensors a run block keeps alive together, within the budget
    run_live: int = 6
    #: blockwise: the most query rows per block (a block takes as many as the budget gives
    #: ``tile_live`` tile-sized tensors, `blocks.rows_within`)
    block_rows: int = 256
    #: blockwise: the keys per tile
    block_keys: int = 256
    #: blockwise: the fewest query rows of a block whose bias is computed by rows (`blocks.tile_rows`)
    min_bias_rows: int = 16
    #: blockwise: stick-breaking stops walking a block's key tiles once every row's stick is spent
    #: (the rest is under exp(-80)); one host read per tile, so eagerly on CPU only
    stop_spent: bool = True
    #: blockwise: the tile-sized tensors a backward tile keeps alive together (logits, softplus,
    #: sigmoid, weights, dP, the reversed sums and their flips)
    tile_live: int = 8
    #: flush denormals to zero around the biased sdpa calls and the blockwise normalizers on CPU,
    #: forward and backward: biased softmax weights decay into the denormal range, where x86 CPU
    #: arithmetic is many times slower (restored to PyTorch's default, off, afterwards)
    flush_denormals: bool = True
    #: eagerly, a block's bias is differentiated with ``autograd.grad`` on its small graph rather
    #: than ``torch.func.vjp``, whose per-call overhead can be most of a cheap block's backward
    #: (under compile always ``torch.func.vjp``, which traces)
    eager_autograd: bool = True
    #: FIRE: the columns of ``x`` per step of `encodings.fire.functions.fire_mlp` (the hidden
    #: activations of one step stay in cache)
    fire_mlp_chunk: int = 16384
    #: FIRE: the keys (columns, by distance) per unit selection of a block of rows: larger groups
    #: share a selection's cost (``W`` per group), smaller ones fold more units and switch fewer
    fire_column_group: int = 32
    #: FIRE: the most elements a unit's span may widen by to join a run of units evaluated together
    #: (one product for the run instead of a few dozen operations per run, over a few more elements)
    fire_span_slack: int = 32768
    #: FIRE: rows by distance and their pullback through the compiled segment pass on CPU
    #: (`encodings.fire.native`) where it is built; False: the torch path (`by_distance`)
    fire_native: bool = True
    #: CoPE: the bytes of one sub-block of rows of its bias rows without gradients (its gates, counts
    #: and lookup indices are several such blocks at once); as large as sdpa's blocks: smaller ones
    #: make the gates' matmul cost more than they save
    cope_chunk_bytes: int = 4 * 2**20
    #: CoPE: the same with gradients, where each sub-block is checkpointed (recomputed in backward)
    cope_grad_chunk_bytes: int = 4 * 2**20
    #: PaTH's own attention (`encodings.path_attention`): the bytes a block of query chunks keeps,
    #: forward a few step-sized tensors, backward every step's carried queries and their gradients;
    #: larger blocks walk the key chunks fewer times (a Python loop of small products per walk)
    path_walk_bytes: int = 16 * 2**20

    def as_floats(self) -> list[float]:
        """The values in field order, as floats: for a custom operator, which takes no Python object
        (`from_floats` rebuilds them; every int here is exact in a float)."""
        return [float(x) for x in astuple(self)]

    @classmethod
    def from_floats(cls, values: list[float]) -> Tunables:
        """The record `as_floats` gave."""
        return cls(*(type(f.default)(x) for f, x in zip(fields(cls), values)))


#: the tunables of a call that names none
DEFAULT_TUNABLES = Tunables()
