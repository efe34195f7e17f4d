"""Triton fused attention (``posenc_lightning/kernels``): rotary, ``LinearBias``,
``RelativeBias``, ``DecayBias``, one parametric bias a kind evaluates per tile (`TileBias`, its
own ``@triton.jit`` functions; and a given ``DenseBias``), packed documents, padding, a sliding
window or chunk (`LOCAL_MASKS`) and stick-breaking are computed inside the kernels, forward and
backward, with no N x N tensor; so is a bias read at positions counted by content gates
(`GatedCounts`, ``KernelBias.counted``), by kernels of its own that take it alone
(`kernels.gated_counts`).
Encodings that may return a kind the kernels cannot read (``fused_in`` without "kernel": rows
that read q and k) are refused: the kernels would take them as a materialized N x N tensor. Products
of q- and k-sized operands (`KernelBias.products`, a `ProductBias`) become one product of wider q and
k (v zero-padded to their width), within the kernels' `MAX_HEAD_DIM` channels.

Rotary is fused for encodings that declare a rotation the kernels can apply
(`Encoding.fused_rotary`: a `RotaryEncoding` keeping the shared rotation): the mixin skips
``encoding.rotate`` and passes that encoding as ``ctx.rotary``; the kernels gather its cos/sin
table (attention scaling folded in) at every token's position. A normalizer that declares the
"kernel" form (`Normalizer.fused_in`) is fused: a `Walk.STICK_BREAKING` walk by the stick-breaking
kernels, a `Walk.SOFTMAX` walk by the softmax kernels with its modulation of the logits
(`Normalizer.kernel_modulation`) computed per tile from the call's positions.
Runs on CUDA; on CPU only under ``TRITON_INTERPRET=1`` (the tests). ``auto`` picks it on CUDA.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

from posenc_lightning.attention.backends import unfused_bias
from posenc_lightning.attention.mask import LOCAL_KINDS, AttentionMask
from posenc_lightning.encodings.base import AttentionContext, Bias, Encoding, KernelBias, Normalizer, Walk
from posenc_lightning.functional.positions import host_reads_ok

NAME = "triton"
#: rotates q, k in-kernel with ``ctx.rotary`` (the mixin then skips ``encoding.rotate``)
FUSES_ROTARY = True
#: the local masks it honors (`attention.mask.LOCAL_KINDS`): a sliding window, as the kernels' own
#: loop bounds and edge mask (softmax and stick-breaking), and a chunk, as segment ids of their
#: segment mask
LOCAL_MASKS = LOCAL_KINDS
MAX_HEAD_DIM = 128
#: the fused form it computes a bias kind in (`Bias.fused_in`): the kernels' arguments
FUSED_BIAS = "kernel"
#: the fused form it runs a normalizer in (`Normalizer.fused_in`)
FUSED_NORMALIZER = "kernel"
#: the normalizer walks the kernels implement: stick-breaking, and a softmax with a per-tile modulation
KERNEL_WALKS = (Walk.STICK_BREAKING, Walk.SOFTMAX)


#: looked up once (a forward must not search the import path)
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


def supports(encoding: Encoding, device: torch.device, requires_grad: bool) -> str | None:
    if not _HAVE_TRITON:
        return "triton is not installed (pip install 'posenc-lightning[triton]')"
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type != "cuda" and not (device.type == "cpu" and interpret):
        return f"the Triton kernels run on CUDA (on CPU only with TRITON_INTERPRET=1), not on {device.type}"
    kind = encoding.normalizer_kind
    if "normalize" in encoding.stages and (kind is None or FUSED_NORMALIZER not in kind.fused_in
                                           or kind.walk not in KERNEL_WALKS):
        return (f"{encoding.name} replaces softmax with a normalizer the kernels do not implement (stick-breaking, "
                "or a softmax whose modulation declares the kernel form)")
    if encoding.head_dim is not None and encoding.head_dim > MAX_HEAD_DIM:
        return f"head_dim {encoding.head_dim} > {MAX_HEAD_DIM}"
    if encoding.head_dim is not None and encoding.head_dim * (1 + encoding.product_operands) > MAX_HEAD_DIM:
        return (f"{encoding.name}'s bias multiplies {encoding.product_operands} more q/k operand pair(s): the kernels "
                f"would take q, k {encoding.head_dim * (1 + encoding.product_operands)} wide (> {MAX_HEAD_DIM})")
    return unfused_bias(encoding, FUSED_BIAS, "the Triton kernels")


def rotary_tables(rot: Encoding, ctx: AttentionContext):  # rot: a `RotaryEncoding`
    """cos/sin tables of ``rot`` for the kernels: one row per position when positions are
    non-negative integers (gathered in-kernel), else one row per token."""
    from posenc_lightning.kernels.fused import RotaryTables

    qp, kp = ctx.q_pos, ctx.k_pos
    if qp.dim() != 2 or kp.dim() != 2:
        raise ValueError(f"{rot.name}: fused rotary takes [B, N] positions, got {tuple(qp.shape)}")
    seq_len = ctx.seq_len if rot.frequencies_key(None) != "static" else None
    integer = not qp.dtype.is_floating_point and not kp.dtype.is_floating_point
    if integer and qp.numel() and kp.numel() and rot.frequencies_key(seq_len) is not None:
        if ctx.q_start is not None and ctx.k_start is not None:  # known without reading the positions
            lo, hi = min(ctx.q_start, ctx.k_start), max(ctx.q_start + qp.shape[1], ctx.k_start + kp.shape[1])
        elif host_reads_ok(qp):
            lo, hi = int(min(qp.min(), kp.min())), int(max(qp.max(), kp.max())) + 1
        else:
            lo = hi = -1
        if lo >= 0:
            rows = torch.arange(hi, device=qp.device)[None]
            cos, sin = rot.cos_sin(rows, seq_len, 0)  # [1, L, R/2] or [1, H, L, R/2]
            return RotaryTables(cos, sin, qp, cos, sin, kp, rot.layout)
    cq, sq = rot.cos_sin(qp, seq_len)
    ck, sk = rot.cos_sin(kp, seq_len)
    b = qp.shape[0]
    iq = torch.arange(qp.shape[1], device=qp.device).expand(b, -1)
    ik = torch.arange(kp.shape[1], device=qp.device).expand(b, -1)
    return RotaryTables(cq, sq, iq, ck, sk, ik, rot.layout)


def split_bias(bias: Bias | None, n_heads: int, positions: tuple[Tensor, Tensor] | None = None) -> KernelBias:
    """The kernels' bias arguments: each term folds itself in (`Bias.fold_into`: the kinds the
    kernels read natively; anything else, or a second position set, as a dense rest).
    ``positions``: ``(q_pos, k_pos)`` claimed first (a normalizer's modulation reads them)."""
    args = KernelBias()
    if positions is not None:
        args.claim_positions(*positions)
    if bias is not None:
        bias.fold_into(args)
    if args.dense is not None:
        args.dense = args.dense.expand(-1, n_heads, -1, -1)
    return args


def attend(q: Tensor, k: Tensor, v: Tensor, *, bias: Bias | None, mask: AttentionMask, scale: float,
           normalizer: Normalizer | None = None, ctx: AttentionContext | None = None) -> Tensor:
    from posenc_lightning.kernels.fused import fused_attention

    sb = False
    attend_current = False
    modulation = None
    if normalizer is not None:
        if FUSED_NORMALIZER not in normalizer.fused_in or normalizer.walk not in KERNEL_WALKS:
            raise ValueError(f"the triton backend does not implement {normalizer.name}'s normalizer; "
                             "use backend='blockwise' or 'eager'")
        if ctx is not None:
            normalizer.check_causal(ctx.causal)
        if normalizer.walk is Walk.STICK_BREAKING:
            sb, attend_current = True, bool(normalizer.attend_current)
        else:
            modulation = normalizer.kernel_modulation()
            if normalizer.modulated and modulation is None:
                raise ValueError(f"{normalizer.name}: its modulation has no kernel form (kernel_modulation)")
            if modulation is not None and (ctx is None or ctx.q_pos.dim() != 2 or ctx.k_pos.dim() != 2):
                raise ValueError(f"{normalizer.name}: the kernels' modulation reads [B, N] positions from the context")
    rot = ctx.rotary if ctx is not None else None
    tables = rotary_tables(rot, ctx) if rot is not None else None
    if tables is not None and tables.cos_q.dim() == 4 and tables.cos_q.shape[1] > 1 and k.shape[1] != q.shape[1]:
        raise ValueError(f"{rot.name}: per-head frequencies need n_kv_heads == n_heads")
    kb = split_bias(bias, q.shape[1], (ctx.q_pos, ctx.k_pos) if modulation is not None else None)
    if kb.counted is not None:
        return _counted(q, k, v, kb, mask, scale, sb or tables is not None or modulation is not None)
    d = v.shape[-1]
    if kb.products:
        if tables is not None:
            raise ValueError("the kernels fuse a rotation or a product of operands, not both in one call")
        q, k, v = _widened(q, k, v, scale, kb)
    starts = {}
    if (ctx is not None and kb.q_pos is not None and kb.q_pos is ctx.q_pos and kb.k_pos is ctx.k_pos
            and ctx.q_start is not None and ctx.k_start is not None):  # a plain range: distances from indices
        starts = {"bias_q_start": ctx.q_start, "bias_k_start": ctx.k_start}
    seg, k_seg = _chunk_segments(mask, q.shape[0], q.device)
    out = fused_attention(
        q, k, v, scale=scale, causal=mask.causal, q_offset=mask.q_offset, rotary=tables,
        q_segments=seg, k_segments=k_seg, k_valid=mask.k_valid, window=mask.window,
        slopes=kb.slopes, table=kb.table, bias_q_pos=kb.q_pos, bias_k_pos=kb.k_pos, c_q=kb.c_q, c_k=kb.c_k,
        dense=kb.dense, tile=kb.tile, stick_breaking=sb, attend_current=attend_current,
        modulation=(modulation.decay, modulation.floor) if modulation is not None else None, **starts)
    return out[..., :d].to(q.dtype)


def _widened(q: Tensor, k: Tensor, v: Tensor, scale: float, kb: KernelBias) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v for one product with the bias's products of operands (`KernelBias.products`):
    ``scale [(1 + own / scale) q, a_j / scale] . [k, b_j] = scale q k^T + own q k^T + sum_j a_j b_j^T``,
    v zero-padded to the same width (the kernels take one head dim; the output's extra channels are 0).
    The gradients to ``own`` and the operands come through the kernels' dQ and dK of the wider ones."""
    qs = [q * (1 + kb.own / scale).to(q.dtype)] + [(a / scale).to(q.dtype) for a, _ in kb.products]
    ks = [k] + [b.to(k.dtype) for _, b in kb.products]
    wq, wk = torch.cat(qs, -1), torch.cat(ks, -1)
    if wq.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"the bias's products make q, k {wq.shape[-1]} wide (> {MAX_HEAD_DIM}); use backend='sdpa'")
    return wq, wk, torch.nn.functional.pad(v, (0, wq.shape[-1] - v.shape[-1]))


def _counted(q: Tensor, k: Tensor, v: Tensor, kb: KernelBias, mask: AttentionMask, scale: float,
             fused_more: bool) -> Tensor:
    """Softmax attention with a bias counted by content gates (`GatedCounts`), by its own kernels."""
    from posenc_lightning.kernels.gated_counts import gated_count_attention

    c = kb.counted
    others = (kb.slopes, kb.table, kb.c_q, kb.c_k, kb.dense, kb.tile)
    if fused_more or any(t is not None for t in others):
        raise ValueError("the Triton kernels take a bias counted by content gates alone (no rotary, other bias "
                         "term, modulation or stick-breaking with it); use backend='sdpa'")
    if not (mask.causal and c.causal) or c.q is not q or c.k is not k or mask.q_offset != c.q_offset:
        raise ValueError("the Triton kernels count gated positions causally, from the q and k they attend with "
                         "and at the mask's offset; use backend='sdpa'")
    if mask.window is not None:
        raise ValueError("the kernels of a bias counted by content gates take no sliding window; use backend='sdpa'")
    seg, k_seg = _chunk_segments(mask, q.shape[0], q.device)
    out = gated_count_attention(q, k, v, c.table, gate_scale=c.gate_scale, scale=scale, q_offset=mask.q_offset,
                                q_segments=seg, k_segments=k_seg, k_valid=mask.k_valid)
    return out.to(q.dtype)


def _chunk_segments(mask: AttentionMask, batch: int, device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    """The kernels' segment ids ``(q, k)``: the mask's own, with a chunk folded in as one more
    segment id per token (chunk ``index // C``; combined with documents as ``doc * n_chunks + chunk``)."""
    seg, k_seg = mask.q_segments, (mask.k_segments if mask.q_segments is not None else None)
    if mask.chunk is None:
        return seg, k_seg
    if seg is not None and k_seg is None:
        k_seg = seg
    n_chunks = mask.n_k // mask.chunk + 1
    qc = (torch.arange(mask.n_q, device=device) + mask.q_offset).div(mask.chunk, rounding_mode="floor")
    kc = torch.arange(mask.n_k, device=device).div(mask.chunk, rounding_mode="floor")
    if seg is None:
        return qc.expand(batch, -1), kc.expand(batch, -1)
    return seg.long() * n_chunks + qc, k_seg.long() * n_chunks + kc
