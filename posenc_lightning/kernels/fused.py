"""`fused_attention`: the autograd Function around the Triton kernels, and the launch plans that
the tests and `benchmarks/triton_compile_report.py` compile for real GPU targets.

Inputs: q ``[B, H, Nq, D]``; k, v ``[B, Hkv, Nk, D]`` (grouped-query allowed); fp16/bf16/fp32,
accumulated in float32. Rotary (`RotaryTables`): cos/sin tables ``[L, R/2]`` (or per batch/head
``[Bt, Ht, L, R/2]``) gathered in-kernel at per-token rows, so any positions work (offsets,
packed documents, non-monotone). Biases read in-kernel: linear-bias slopes ``[H]``, a relative
table ``[H, 2R+1]``, cumulative decays ``c_q [B, H, Nq]``, ``c_k [B, H, Nk]``, one parametric
bias evaluated per tile from the positions by its own ``@triton.jit`` functions (`TileBias`), a
dense ``[B|1, H, Nq, Nk]``; a softmax normalizer's distance modulation of the logits (``modulation``).
Every tensor the kernels allocate is O(N) or O(N D): never N x N (except the gradient of a
dense bias, which is N x N itself); the tile bias's parameter gradients are per-program partial
sums ``[B, H, N / BLOCK, GB]``, reduced after the launch (`TileBias.unpack`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import triton
from torch import Tensor

from posenc_lightning.kernels import _common, softmax, stick_breaking
from posenc_lightning.kernels.tile_table import MOD_CONFIGS, SB_CONFIGS, SOFTMAX_CONFIGS, WINDOW_CONFIGS

if TYPE_CHECKING:
    from posenc_lightning.encodings.bias import TileBias

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 accumulation, float64 for float64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def acc_tl(dtype: torch.dtype):
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(eq=False)
class RotaryTables:
    """cos/sin tables and the table row of every token (``idx_q [B, Nq]``, ``idx_k [B, Nk]``)."""

    cos_q: Tensor
    sin_q: Tensor
    idx_q: Tensor
    cos_k: Tensor
    sin_k: Tensor
    idx_k: Tensor
    layout: str = "half"

    @property
    def rotary_dim(self) -> int:
        return 2 * self.cos_q.shape[-1]


#: tile sizes under TRITON_INTERPRET=1 (tests change them to cover several tilings)
INTERPRET_BLOCKS = (16, 16)


def cuda_arch(device: torch.device) -> int:
    """90 on Hopper and later, else 80 (the two tables of `SOFTMAX_CONFIGS`)."""
    major, _ = torch.cuda.get_device_capability(device)
    return 90 if major >= 9 else 80


def block_config(kind: str, head_dim: int, dtype: torch.dtype, gpu: bool = False, arch: int | None = None,
                 window: bool = False, modulated: bool = False) -> dict:
    """Tile sizes per kernel ``kind`` (fwd, bwd_dkdv, bwd_dq, sb_fwd, sb_bwd, sb_bwd_dkdv, rotate,
    rowdot); ``gpu``: the GPU sizes even under the interpreter (for the compile report); ``arch``: 80 or 90 (the
    tables `SOFTMAX_CONFIGS` and `SB_CONFIGS`; default 90); ``window``: a sliding-window layer's
    kernels (`WINDOW_CONFIGS` first); ``modulated``: a softmax kernel with a normalizer's modulation
    (`MOD_CONFIGS` first; the two tables hold different kernels: stick-breaking takes no modulation)."""
    if interpreting() and not gpu:
        return {"BM": INTERPRET_BLOCKS[0], "BN": INTERPRET_BLOCKS[1], "num_warps": 1, "num_stages": 1}
    if kind in ("rotate", "rowdot"):
        return {"BM": 32, "BN": 32, "num_warps": 4, "num_stages": 1}
    if kind in ("fwd", "bwd_dkdv", "bwd_dq", "sb_fwd", "sb_bwd", "sb_bwd_dkdv"):
        key = (90 if arch is None or arch >= 90 else 80, 64 if head_dim <= 64 else 128,
               "32" if dtype in (torch.float32, torch.float64) else "16", kind)
        table = SB_CONFIGS if kind.startswith("sb_") else SOFTMAX_CONFIGS
        if window and key in WINDOW_CONFIGS:
            bm, bn, warps, stages = WINDOW_CONFIGS[key]
        else:
            bm, bn, warps, stages = MOD_CONFIGS[key] if modulated and key in MOD_CONFIGS else table[key]
        return {"BM": bm, "BN": bn, "num_warps": warps, "num_stages": stages}
    raise ValueError(f"block_config: unknown kernel kind {kind!r}; known: fwd, bwd_dkdv, bwd_dq, sb_fwd, sb_bwd, "
                     "sb_bwd_dkdv, rotate, rowdot")


def head_block(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


@dataclass(eq=False)
class Plan:
    """Everything about one call except q, k, v and the differentiable bias tensors."""

    scale: float
    causal: int  # 0 none, 1 key <= query, 2 key < query (stick-breaking without the diagonal)
    q_offset: int = 0
    #: a sliding window W: key j visible to query i only if ``i + q_offset - j < W`` (by index); the
    #: kernels skip the key tiles below it (``WINDOW``)
    window: int | None = None
    rotary: RotaryTables | None = None
    q_segments: Tensor | None = None
    k_segments: Tensor | None = None
    k_valid: Tensor | None = None
    bias_q_pos: Tensor | None = None
    bias_k_pos: Tensor | None = None
    stick_breaking: bool = False
    tile: TileBias | None = None  # its functions and sizes; the parameters go through autograd
    #: ``(decay, floor)``: the softmax kernels multiply every logit (scaled scores plus bias) by
    #: ``floor + (1 - floor) exp(-decay |i - j|)`` at the bias positions, and dS by it in the backward
    modulation: tuple[float, float] | None = None
    #: (q_start, k_start) when the bias positions are ``start + arange(N)`` in every row: the
    #: softmax kernels then compute them from the indices instead of loading them
    pos_start: tuple[int, int] | None = None
    #: kernel kind -> {BM, BN, num_warps, num_stages} replacing `block_config`'s pinned tiles (ablations)
    tiles: dict | None = None
    extra: dict = field(default_factory=dict)

    def config(self, kind: str, head_dim: int, dtype: torch.dtype, arch: int | None) -> dict:
        """The tiles of kernel ``kind``: the given ones (`tiles`), else the pinned `block_config`."""
        if self.tiles is not None and kind in self.tiles:
            return dict(self.tiles[kind])
        return block_config(kind, head_dim, dtype, arch=arch, window=self.window is not None,
                            modulated=self.modulation is not None)

    @property
    def tile_block(self) -> int:
        """``TILE_GB``: the length of a packed tile-gradient row (16 without a tile: unused)."""
        return self.tile.grad_block if self.tile is not None else 16


def _table4(t: Tensor) -> tuple[Tensor, int, int, int]:
    """A cos/sin table as ``[Bt, Ht, L, R/2]`` (from ``[L, R/2]``, ``[Bt, L, R/2]`` or 4-D) with
    zero strides on the broadcast dims."""
    t = t.float()
    if t.dim() == 2:
        t = t[None, None]
    elif t.dim() == 3:
        t = t[:, None]
    t = t.contiguous()
    sb = 0 if t.shape[0] == 1 else t.stride(0)
    sh = 0 if t.shape[1] == 1 else t.stride(1)
    return t, sb, sh, t.stride(2)


def common_args(q: Tensor, k: Tensor, plan: Plan, slopes, table, c_q, c_k, dense,
                tile_params=None) -> tuple[dict, dict]:
    """The keyword arguments shared by every attention kernel, and their constexpr flags."""
    _, h, nq, d = q.shape
    nk = k.shape[2]
    dummy = q.new_zeros(1, dtype=torch.float32)
    idummy = torch.zeros(1, dtype=torch.int32, device=q.device)
    rot = plan.rotary
    a: dict = {"H": h, "GROUP": h // k.shape[1], "Nq": nq, "Nk": nk, "D": d, "scale": float(plan.scale),
               "q_offset": int(plan.q_offset), "window": int(plan.window or 0)}
    a["qk_scale"] = float(plan.scale) * 1.4426950408889634  # log2(e): the softmax kernels' logits are base 2
    a["q_start"], a["k_start"] = plan.pos_start if plan.pos_start is not None else (0, 0)
    if rot is not None:
        for side, cos, sin, idx in (("q", rot.cos_q, rot.sin_q, rot.idx_q), ("k", rot.cos_k, rot.sin_k, rot.idx_k)):
            c, sb, sh, sp = _table4(cos)
            s, *_ = _table4(sin)
            a.update({f"{side.upper()}COS": c, f"{side.upper()}SIN": s, f"s_{side}cb": sb, f"s_{side}ch": sh,
                      f"s_{side}cp": sp, f"{side.upper()}IDX": idx.to(torch.int32).contiguous()})
        a["R"] = rot.rotary_dim
    else:
        for side in "qk":
            a.update({f"{side.upper()}COS": dummy, f"{side.upper()}SIN": dummy, f"s_{side}cb": 0, f"s_{side}ch": 0,
                      f"s_{side}cp": 0, f"{side.upper()}IDX": idummy})
        a["R"] = 0
    seg = plan.q_segments is not None
    a["QSEG"] = plan.q_segments.to(torch.int32).contiguous() if seg else idummy
    a["KSEG"] = (plan.k_segments if plan.k_segments is not None else plan.q_segments).to(torch.int32).contiguous() \
        if seg else idummy
    a["KVALID"] = plan.k_valid.to(torch.int32).contiguous() if plan.k_valid is not None else idummy
    tile = plan.tile if tile_params is not None else None
    has_pos = slopes is not None or table is not None or tile is not None or plan.modulation is not None
    ranged = plan.pos_start is not None and not plan.stick_breaking
    a["QP"] = plan.bias_q_pos.float().contiguous() if has_pos and not ranged else dummy
    a["KP"] = plan.bias_k_pos.float().contiguous() if has_pos and not ranged else dummy
    a["SLOPES"] = slopes if slopes is not None else dummy
    a["TABLE"] = table if table is not None else dummy
    a["RMAX"] = (table.shape[-1] - 1) // 2 if table is not None else 0
    a["s_th"] = table.stride(0) if table is not None else 0
    a["CQ"] = c_q if c_q is not None else dummy
    a["CK"] = c_k if c_k is not None else dummy
    a["s_cqb"], a["s_cqh"] = (c_q.stride(0), c_q.stride(1)) if c_q is not None else (0, 0)
    a["s_ckb"], a["s_ckh"] = (c_k.stride(0), c_k.stride(1)) if c_k is not None else (0, 0)
    a["DENSE"] = dense if dense is not None else dummy
    a["s_db"] = (0 if dense.shape[0] == 1 else dense.stride(0)) if dense is not None else 0
    a["s_dh"], a["s_dm"] = (dense.stride(1), dense.stride(2)) if dense is not None else (0, 0)
    a["TILE"] = tile_params if tile is not None else dummy
    a["TILE_W"], a["tile_eps"] = (tile.width, float(tile.eps)) if tile is not None else (0, 0.0)
    decay, floor = plan.modulation if plan.modulation is not None else (0.0, 1.0)
    a["mod_a"], a["mod_floor"] = float(decay) * 1.4426950408889634, float(floor)  # exp(-x) = exp2(-x log2(e))
    import triton.language as tl

    dot_t = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
             torch.float64: tl.float64}[q.dtype]
    if interpreting() and q.dtype == torch.bfloat16:
        dot_t = tl.float32  # the interpreter has no bf16 arithmetic: stay in float32
    flags = {"ROT": 0 if rot is None else (1 if rot.layout == "half" else 2), "CAUSAL": plan.causal,
             "WINDOW": plan.window is not None,
             "HAS_SEG": seg, "HAS_KVALID": plan.k_valid is not None, "HAS_LIN": slopes is not None,
             "HAS_REL": table is not None, "HAS_DEC": c_q is not None, "HAS_DENSE": dense is not None,
             "HAS_TILE": tile is not None, "TILE_GB": plan.tile_block, "HAS_MOD": plan.modulation is not None,
             # the tile's own @triton.jit functions, compile-time constants of the kernels
             "TILE_VALUE": tile.value if tile is not None else None,
             "TILE_GRADS": tile.grads if tile is not None else None,
             "POS_RANGE": ranged, "DOT_T": dot_t, "PREC": "ieee", "BD": head_block(d),
             "ACC": acc_tl(q.dtype)}
    return a, flags


def _strides(prefix: str, x: Tensor) -> dict:
    return {f"s{prefix}b": x.stride(0), f"s{prefix}h": x.stride(1), f"s{prefix}n": x.stride(2)}


def _contig_last(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(kernel, grid, args: dict, flags: dict, cfg: dict) -> None:
    """Launch ``kernel`` with the arguments and flags it declares (`common_args` makes them for
    every kernel: the softmax kernels take no rotary tables, for one)."""
    names = set(kernel.arg_names)
    kw = {n: x for n, x in {**args, **flags}.items() if n in names}
    kernel[grid](**kw, BM=cfg["BM"], BN=cfg["BN"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def store_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels write for ``dtype`` inputs: the input dtype, except bf16 under the
    interpreter, which writes float32 (its bf16 conversion is not round-to-nearest), cast by torch."""
    return torch.float32 if dtype == torch.bfloat16 and interpreting() else dtype


def _arch(x: Tensor) -> int | None:
    return cuda_arch(x.device) if x.is_cuda else None


def row_dot(o: Tensor, do: Tensor) -> Tensor:
    """``rowsum(dO * O)`` ``[B, H, N]`` in float32 (float64 for float64 inputs) by one small kernel."""
    b, h, n, d = o.shape
    delta = torch.empty(b, h, n, dtype=acc_dtype(o.dtype), device=o.device)
    cfg = block_config("rowdot", d, o.dtype)
    _common._rowdot_kernel[(triton.cdiv(n, cfg["BM"]), b * h)](
        o, do, delta, *o.stride()[:3], *do.stride()[:3], h, n, d, BM=cfg["BM"], BD=head_block(d),
        ACC=acc_tl(o.dtype), num_warps=cfg["num_warps"])
    return delta


def rotate(x: Tensor, cos: Tensor, sin: Tensor, idx: Tensor, layout: str, inverse: bool = False,
           out_dtype: torch.dtype | None = None) -> Tensor:
    """Rotate ``x [B, H, N, D]`` at table rows ``idx [B, N]`` (``inverse``: the transpose)."""
    x = _contig_last(x)
    b, h, n, d = x.shape
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    c, sb, sh, sp = _table4(cos)
    s, *_ = _table4(sin)
    cfg = block_config("rotate", d, x.dtype)
    grid = (triton.cdiv(n, cfg["BM"]), b * h)
    _common._rotate_kernel[grid](x, y, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
                                 h, n, d, c, s, sb, sh, sp, idx.to(torch.int32).contiguous(), 2 * cos.shape[-1],
                                 ROT=1 if layout == "half" else 2, SIGN=-1 if inverse else 1, BM=cfg["BM"],
                                 BD=head_block(d), ACC=acc_tl(x.dtype), num_warps=cfg["num_warps"])
    return y


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, slopes, table, c_q, c_k, dense, tile_params, plan: Plan):
        q, k, v = _contig_last(q), _contig_last(k), _contig_last(v)
        b, h, nq, d = q.shape
        rot = plan.rotary
        if rot is not None and not plan.stick_breaking:  # rotate once; the softmax kernels take rotated q, k
            q = rotate(q, rot.cos_q, rot.sin_q, rot.idx_q, rot.layout, out_dtype=store_dtype(q.dtype)).to(q.dtype)
            k = rotate(k, rot.cos_k, rot.sin_k, rot.idx_k, rot.layout, out_dtype=store_dtype(k.dtype)).to(k.dtype)
        # softmax: O in the operand dtype; stick-breaking: float32 (its backward's dO . o must be the sum
        # of the g it recomputes: an O rounded to fp16 would add up over the unnormalized weights)
        out = torch.empty(b, h, nq, d, dtype=acc_dtype(q.dtype) if plan.stick_breaking else store_dtype(q.dtype),
                          device=q.device)
        lse = torch.empty(b, h, nq, dtype=acc_dtype(q.dtype), device=q.device)
        args, flags = common_args(q, k, plan, slopes, table, c_q, c_k, dense, tile_params)
        kind = "sb_fwd" if plan.stick_breaking else "fwd"
        cfg = plan.config(kind, d, q.dtype, _arch(q))
        grid = (triton.cdiv(nq, cfg["BM"]), b * h)
        head = {"Q": q, "K": k, "V": v, "O": out, **_strides("q", q), **_strides("k", k), **_strides("v", v),
                **_strides("o", out)}
        if plan.stick_breaking:
            _launch(stick_breaking._sb_fwd_kernel, grid, {**head, **args}, flags, cfg)
        else:
            _launch(softmax._fwd_kernel, grid, {**head, "LSE": lse, **args}, flags, cfg)
        ctx.save_for_backward(q, k, v, out, lse, slopes, table, c_q, c_k, dense, tile_params)
        ctx.plan = plan
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, slopes, table, c_q, c_k, dense, tile_params = ctx.saved_tensors
        plan: Plan = ctx.plan
        b, h, nq, d = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        dout = dout.contiguous()
        delta = row_dot(out, dout)
        args, flags = common_args(q, k, plan, slopes, table, c_q, c_k, dense, tile_params)
        f32 = {"dtype": acc_dtype(q.dtype), "device": q.device}
        dcq = torch.zeros(b, h, nq, **f32) if c_q is not None else delta.new_zeros(1)
        dck = torch.zeros(b, h, nk, **f32) if c_k is not None else delta.new_zeros(1)
        dtable = torch.zeros(table.shape, **f32) if table is not None else delta.new_zeros(1)
        head = {"Q": q, "K": k, "V": v, "DO": dout, **_strides("q", q), **_strides("k", k), **_strides("v", v),
                **_strides("o", dout)}
        arch = _arch(q)
        if plan.stick_breaking:
            # two sweeps, no program adding into another's dQ, dK or dV: the query-major one (dQ, the
            # bias gradients) leaves the row sums after each key block, the key-major one (dK, dV, dc_k)
            # reads them
            dq = torch.empty(b, h, nq, d, **f32)
            dk = torch.empty(b, hkv, nk, d, **f32)
            dv = torch.empty(b, hkv, nk, d, **f32)
            # one dense-bias gradient per batch row (plain stores), summed below where the bias is shared
            ddense = torch.zeros(b, *dense.shape[1:], **f32) if dense is not None else delta.new_zeros(1)
            cfg = plan.config("sb_bwd", d, q.dtype, arch)
            cfg_kv = plan.config("sb_bwd_dkdv", d, q.dtype, arch)
            if cfg_kv["BN"] != cfg["BN"]:
                raise RuntimeError(f"stick-breaking tile table: sb_bwd_dkdv's BN {cfg_kv['BN']} must equal "
                                   f"sb_bwd's {cfg['BN']} (the row sums are per key block); fix SB_CONFIGS")
            nqb, nkb = triton.cdiv(nq, cfg["BM"]), triton.cdiv(nk, cfg["BN"])
            # O(N^2 / BN): two row sums per (row, key block)
            tails = torch.empty(2, b * h, nkb, nq, **f32)
            dslope = torch.zeros(b, h, nqb, **f32)
            dtile = torch.zeros(b, h, nqb, plan.tile_block, **f32) if tile_params is not None else delta.new_zeros(1)
            sums = {"DELTA": delta, "TAILS": tails[0], "GTAILS": tails[1], "n_kblocks": nkb}
            _launch(stick_breaking._sb_bwd_kernel, (nqb, b * h),
                    {**head, **sums, "DQ": dq, "DCQ": dcq, "DTABLE": dtable, "DSLOPE": dslope, "DDENSE": ddense,
                     "DTILE": dtile, "n_qblocks": nqb, "s_ddb": ddense.stride(0) if dense is not None else 0,
                     **args}, flags, cfg)
            _launch(stick_breaking._sb_bwd_dkdv_kernel, (nkb, b * hkv),
                    {**head, **sums, "DK": dk, "DV": dv, "DCK": dck, **args}, flags, cfg_kv)
            if dense is not None and dense.shape[0] != b:
                ddense = ddense.sum(0, keepdim=True)
        else:
            # gradients in the operand dtype; no program adds into another's
            dq = torch.empty(b, h, nq, d, dtype=store_dtype(q.dtype), device=q.device)
            dk = torch.empty(b, hkv, nk, d, dtype=store_dtype(k.dtype), device=q.device)
            dv = torch.empty(b, hkv, nk, d, dtype=store_dtype(v.dtype), device=q.device)
            # one dense-bias gradient per batch row (summed below where the bias is shared): plain stores;
            # zeros for the tiles the causal mask skips
            ddense = torch.zeros(b, *dense.shape[1:], **f32) if dense is not None else delta.new_zeros(1)
            cfg = plan.config("bwd_dkdv", d, q.dtype, arch)
            nkb = triton.cdiv(nk, cfg["BN"])
            dslope = torch.zeros(b, h, nkb, **f32)
            dtile = torch.zeros(b, h, nkb, plan.tile_block, **f32) if tile_params is not None else delta.new_zeros(1)
            grad_strides = {"sgb": dk.stride(0), "sgh": dk.stride(1), "sgn": dk.stride(2)}
            _launch(softmax._bwd_dkdv_kernel, (nkb, b * hkv),
                    {**head, "LSE": lse, "DELTA": delta, "DK": dk, "DV": dv, "DCK": dck, "DTABLE": dtable,
                     "DSLOPE": dslope, "DDENSE": ddense, "DTILE": dtile, "n_kblocks": nkb, **grad_strides,
                     "s_ddb": ddense.stride(0) if dense is not None else 0, **args},
                    {**flags, "EVEN_N": int(nk % cfg["BN"] == 0)}, cfg)
            cfg = plan.config("bwd_dq", d, q.dtype, arch)
            _launch(softmax._bwd_dq_kernel, (triton.cdiv(nq, cfg["BM"]), b * h),
                    {**head, "LSE": lse, "DELTA": delta, "DQ": dq, "DCQ": dcq,
                     "sgb": dq.stride(0), "sgh": dq.stride(1), "sgn": dq.stride(2), **args}, flags, cfg)
            if dense is not None and dense.shape[0] != b:
                ddense = ddense.sum(0, keepdim=True)
        rot = plan.rotary
        if rot is not None:  # back from the rotated q, k: once
            dq = rotate(dq, rot.cos_q, rot.sin_q, rot.idx_q, rot.layout, inverse=True, out_dtype=q.dtype)
            dk = rotate(dk, rot.cos_k, rot.sin_k, rot.idx_k, rot.layout, inverse=True, out_dtype=k.dtype)
        grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                 dslope.sum(-1).sum(0).to(slopes.dtype) if slopes is not None else None,
                 dtable.to(table.dtype) if table is not None else None,
                 dcq.to(c_q.dtype) if c_q is not None else None,
                 dck.to(c_k.dtype) if c_k is not None else None,
                 ddense.to(dense.dtype) if dense is not None else None,
                 plan.tile.unpack(dtile.sum((0, 2))).to(tile_params.dtype) if tile_params is not None else None,
                 None]
        return tuple(grads)


_TILE_KEYS = {"BM", "BN", "num_warps", "num_stages"}


def _checked_tiles(tiles: dict[str, dict] | None) -> dict[str, dict] | None:
    if tiles is None:
        return None
    for kind, cfg in tiles.items():
        if kind not in ("fwd", "bwd_dkdv", "bwd_dq", "sb_fwd", "sb_bwd", "sb_bwd_dkdv") or set(cfg) != _TILE_KEYS:
            raise ValueError(f"tiles[{kind!r}] = {cfg}: give a kernel kind (fwd, bwd_dkdv, bwd_dq, sb_fwd, sb_bwd, sb_bwd_dkdv) "
                             f"-> a dict of exactly {sorted(_TILE_KEYS)}")
        if any(cfg[b] < 16 or cfg[b] & (cfg[b] - 1) for b in ("BM", "BN")):
            raise ValueError(f"tiles[{kind!r}]: BM and BN must be powers of two >= 16 (tl.dot), got {cfg}")
    return dict(tiles)


def segments_from_cu_seqlens(cu_seqlens: Tensor, n: int) -> Tensor:
    """Document ids ``[1, n]`` from cumulative lengths ``[0, l0, l0 + l1, ..., n]`` (varlen APIs)."""
    pos = torch.arange(n, device=cu_seqlens.device)
    return (torch.searchsorted(cu_seqlens[1:].to(pos.dtype), pos, right=True))[None]


def fused_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, causal: bool = True,
                    q_offset: int = 0, rotary: RotaryTables | None = None, q_segments: Tensor | None = None,
                    k_segments: Tensor | None = None, cu_seqlens: Tensor | None = None,
                    k_valid: Tensor | None = None, slopes: Tensor | None = None, table: Tensor | None = None,
                    bias_q_pos: Tensor | None = None, bias_k_pos: Tensor | None = None,
                    c_q: Tensor | None = None, c_k: Tensor | None = None, dense: Tensor | None = None,
                    tile: TileBias | None = None, stick_breaking: bool = False,
                    attend_current: bool = False, bias_q_start: int | None = None,
                    bias_k_start: int | None = None, tiles: dict[str, dict] | None = None,
                    window: int | None = None, modulation: tuple[float, float] | None = None) -> Tensor:
    """Attention with rotary / biases / packed documents fused (softmax, or stick-breaking).

    ``tile``: a parametric bias the kernels evaluate per tile at ``bias_q_pos``/``bias_k_pos``
    with its own ``@triton.jit`` functions (`TileBias`; a bias kind's `fold_into` makes it), its
    parameters differentiated through ``tile.params``. ``bias_q_start``/``bias_k_start``: given
    together when every row of ``bias_q_pos``/``bias_k_pos`` is ``start + arange(N)`` (the
    softmax kernels then compute the distances from the indices; default positions are such).
    ``tiles``: kernel kind (fwd, bwd_dkdv, bwd_dq, sb_fwd, sb_bwd) -> ``{"BM", "BN", "num_warps",
    "num_stages"}`` in place of the pinned `block_config` (the tile ablation of benchmarks/gpu_perf.py);
    a result changes by rounding only. ``window``: a causal sliding window W (`AttentionMask.window`:
    query ``i`` sees key ``j`` iff ``0 <= i + q_offset - j < W``, by index); the loops visit only
    the key tiles it reaches, O(N W) work. ``modulation``: ``(decay, floor)`` of a softmax
    normalizer's distance modulation (`Normalizer.kernel_modulation`): ``softmax((s + bias) * (floor +
    (1 - floor) exp(-decay |i - j|)))`` at ``bias_q_pos``/``bias_k_pos`` (any positions, float or
    integer; default ``q_offset + arange``, ``arange``), forward and backward; not with stick-breaking."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"fused_attention wants q [B,H,Nq,D], k = v [B,Hkv,Nk,D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"fused_attention takes fp16/bf16/fp32 q, k, v of one dtype; got {q.dtype}, "
                         f"{k.dtype}, {v.dtype}: cast them first")
    d = q.shape[-1]
    if d > 128 or q.shape[1] % k.shape[1]:
        raise ValueError(f"head_dim {d} must be <= 128 and n_heads {q.shape[1]} a multiple of n_kv_heads "
                         f"{k.shape[1]}; use backend='sdpa' or 'eager'")
    if cu_seqlens is not None:
        if q.shape[0] != 1 or q.shape[2] != k.shape[2]:
            raise ValueError("cu_seqlens packs documents into one row: q, k must be [1, H, N, D]")
        q_segments = segments_from_cu_seqlens(cu_seqlens, q.shape[2])
    if tile is not None and tile.heads != q.shape[1]:
        raise ValueError(f"tile {tile.name}: parameters for {tile.heads} heads, q has {q.shape[1]}")
    pos_start = (int(bias_q_start), int(bias_k_start)) if bias_q_start is not None and bias_k_start is not None \
        else None
    if modulation is not None and stick_breaking:
        raise ValueError("fused_attention: a logit modulation multiplies a softmax's logits; stick-breaking takes none")
    positional = slopes is not None or table is not None or tile is not None or modulation is not None
    if positional and (bias_q_pos is None or bias_k_pos is None):
        b = q.shape[0]
        if bias_q_pos is None and bias_k_pos is None:
            pos_start = (q_offset, 0)
        bias_q_pos = torch.arange(q.shape[2], device=q.device).expand(b, -1) + q_offset if bias_q_pos is None \
            else bias_q_pos
        bias_k_pos = torch.arange(k.shape[2], device=q.device).expand(b, -1) if bias_k_pos is None else bias_k_pos
    if window is not None and (int(window) != window or window < 1 or not (causal or stick_breaking)):
        raise ValueError(f"window={window}: a sliding window is a positive integer and causal (causal=True)")
    if stick_breaking:
        kind = 1 if attend_current else 2
    else:
        kind = 1 if causal else 0
    plan = Plan(scale=d ** -0.5 if scale is None else float(scale), causal=kind, q_offset=q_offset,
                window=None if window is None else int(window), rotary=rotary,
                q_segments=q_segments, k_segments=k_segments, k_valid=k_valid, bias_q_pos=bias_q_pos,
                bias_k_pos=bias_k_pos, stick_breaking=stick_breaking, tile=tile, pos_start=pos_start,
                tiles=_checked_tiles(tiles),
                modulation=(float(modulation[0]), float(modulation[1])) if modulation is not None else None)
    c_q = c_q.contiguous() if c_q is not None else None
    c_k = c_k.contiguous() if c_k is not None else None
    dense = dense.contiguous() if dense is not None else None
    slopes = slopes.contiguous() if slopes is not None else None
    table = table.contiguous() if table is not None else None
    tile_params = tile.params.to(acc_dtype(q.dtype)).contiguous() if tile is not None else None
    return _FusedAttention.apply(q, k, v, slopes, table, c_q, c_k, dense, tile_params, plan)
