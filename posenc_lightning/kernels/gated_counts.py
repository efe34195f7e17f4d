"""`gated_count_attention`: the autograd Function around the CoPE kernels (`kernels.cope`), which the
Triton backend calls for a bias read at positions counted by content gates
(`encodings.bias.GatedCounts`), and their tiles.

Inputs: q ``[B, H, Nq, D]``, k, v ``[B, Hkv, Nk, D]`` (grouped-query allowed), the position
embeddings ``E [Hp, D, P]`` (``Hp`` 1: shared by the heads, or ``H``). ``Z = q E`` (``[B, H, Nq, P]``,
float32; float64 for float64 inputs) is a torch product before the launch, so autograd gives
``dE = q^T dZ`` and the ``dZ E^T`` part of dq; the kernels give dq's softmax and gate parts, dk, dv
and dZ. Causal only (query ``i`` at key ``i + q_offset``), with packed documents and key padding
masking the softmax. Every tensor allocated is O(N D), O(N P) or O(N^2 / BN) (the carries per key
block): never N x N.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from posenc_lightning.kernels import cope, fused
from posenc_lightning.kernels.fused import (
    Plan,
    acc_dtype,
    common_args,
    cuda_arch,
    head_block,
    interpreting,
    row_dot,
    store_dtype,
)
from posenc_lightning.kernels.tile_table import COPE_CONFIGS

COPE_KINDS = ("cope_fwd", "cope_bwd_dq", "cope_bwd_dkdv")


def cope_block_config(kind: str, head_dim: int, dtype: torch.dtype, gpu: bool = False, arch: int | None = None) -> dict:
    """Tile sizes of CoPE kernel ``kind`` (`COPE_KINDS`) from `tile_table.COPE_CONFIGS` (``arch``
    80 or 90, default 90); under the interpreter `fused.INTERPRET_BLOCKS` unless ``gpu``."""
    if kind not in COPE_KINDS:
        raise ValueError(f"cope_block_config: unknown kernel kind {kind!r}; known: {', '.join(COPE_KINDS)}")
    if interpreting() and not gpu:
        # read at the call: tests change the interpreter's tiles
        return {"BM": fused.INTERPRET_BLOCKS[0], "BN": fused.INTERPRET_BLOCKS[1], "num_warps": 1, "num_stages": 1}
    key = (90 if arch is None or arch >= 90 else 80, 64 if head_dim <= 64 else 128,
           "32" if dtype in (torch.float32, torch.float64) else "16", kind)
    bm, bn, warps, stages = COPE_CONFIGS[key]
    return {"BM": bm, "BN": bn, "num_warps": warps, "num_stages": stages}


def _heads(x: Tensor, name: str) -> dict:
    return {name: x, f"s{name.lower()}b": x.stride(0), f"s{name.lower()}h": x.stride(1),
            f"s{name.lower()}n": x.stride(2)}


def _run(kernel, grid, args: dict, cfg: dict) -> None:
    """Launch ``kernel`` with the arguments it declares out of ``args``."""
    names = set(kernel.arg_names)
    kernel[grid](**{n: x for n, x in args.items() if n in names}, BM=cfg["BM"], BN=cfg["BN"],
                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def kernel_args(q: Tensor, k: Tensor, n_positions: int, plan: Plan, gate_scale: float) -> dict:
    """The keyword arguments and compile-time flags every CoPE kernel reads besides its tensors
    (``n_positions``: ``P``, the table's integer positions)."""
    a, flags = common_args(q, k, plan, None, None, None, None, None)
    return {**a, **flags, "P": int(n_positions), "gate_scale": float(gate_scale),
            "BP": triton.next_power_of_2(int(n_positions)), "BD": head_block(q.shape[-1])}


class _CoPEAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, z, plan: Plan, gate_scale: float):
        b, h, nq, d = q.shape
        arch = cuda_arch(q.device) if q.is_cuda else None
        cfg = cope_block_config("cope_fwd", d, q.dtype, arch=arch)
        cfg_dq = cope_block_config("cope_bwd_dq", d, q.dtype, arch=arch)
        if cfg["BN"] != cfg_dq["BN"]:
            raise RuntimeError(f"CoPE tile table: cope_fwd's BN {cfg['BN']} must equal the backward's "
                               f"{cfg_dq['BN']} (the carries are per key block); fix COPE_CONFIGS")
        nkb = triton.cdiv(k.shape[2], cfg["BN"])
        out = torch.empty(b, h, nq, d, dtype=store_dtype(q.dtype), device=q.device)
        lse = torch.empty(b, h, nq, dtype=acc_dtype(q.dtype), device=q.device)
        # each row's sum of gates after every key block: O(N^2 / BN)
        gtail = torch.empty(b * h, nkb, nq, dtype=acc_dtype(q.dtype), device=q.device)
        args = {**_heads(q, "Q"), **_heads(k, "K"), **_heads(v, "V"), **_heads(out, "O"), "Z": z, "LSE": lse,
                "GTAIL": gtail, "n_kblocks": nkb, **kernel_args(q, k, z.shape[-1], plan, gate_scale)}
        _run(cope._cope_fwd_kernel, (triton.cdiv(nq, cfg["BM"]), b * h), args, cfg)
        ctx.save_for_backward(q, k, v, z, out, lse, gtail)
        ctx.plan, ctx.gate_scale = plan, gate_scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, z, out, lse, gtail = ctx.saved_tensors
        plan: Plan = ctx.plan
        b, h, nq, d = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        dout = dout.contiguous()
        delta = row_dot(out, dout)
        acc = {"dtype": acc_dtype(q.dtype), "device": q.device}
        arch = cuda_arch(q.device) if q.is_cuda else None
        cfg = cope_block_config("cope_bwd_dq", d, q.dtype, arch=arch)
        cfg_kv = cope_block_config("cope_bwd_dkdv", d, q.dtype, arch=arch)
        if cfg_kv["BN"] != cfg["BN"]:
            raise RuntimeError(f"CoPE tile table: cope_bwd_dkdv's BN {cfg_kv['BN']} must equal cope_bwd_dq's "
                               f"{cfg['BN']} (the carries are per key block); fix COPE_CONFIGS")
        nkb = gtail.shape[1]
        dq = torch.empty(b, h, nq, d, **acc)
        dz = torch.empty(z.shape, **acc)
        dk = torch.empty(b, hkv, nk, d, **acc)
        dv = torch.empty(b, hkv, nk, d, **acc)
        dptail = torch.empty(gtail.shape, **acc)  # each row's sum of dp before every key block
        args = {**_heads(q, "Q"), **_heads(k, "K"), **_heads(v, "V"), **_heads(dout, "O"), "DO": dout, "Z": z,
                "LSE": lse, "DELTA": delta, "GTAIL": gtail, "DPTAIL": dptail, "n_kblocks": nkb, "DQ": dq, "DZ": dz,
                "DK": dk, "DV": dv, **kernel_args(q, k, z.shape[-1], plan, ctx.gate_scale)}
        _run(cope._cope_bwd_dq_kernel, (triton.cdiv(nq, cfg["BM"]), b * h), args, cfg)
        _run(cope._cope_bwd_dkdv_kernel, (triton.cdiv(nk, cfg_kv["BN"]), b * hkv), args, cfg_kv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dz.to(z.dtype), None, None


def gated_count_attention(q: Tensor, k: Tensor, v: Tensor, pos_emb: Tensor, *, gate_scale: float,
                   scale: float | None = None, q_offset: int = 0, q_segments: Tensor | None = None,
                   k_segments: Tensor | None = None, k_valid: Tensor | None = None) -> Tensor:
    """Causal softmax attention with the CoPE bias (`encodings.bias.GatedCounts`) computed in the
    kernels (no N x N tensor).

    Args:
        q: ``[B, H, Nq, D]``; k, v: ``[B, Hkv, Nk, D]`` (``H`` a multiple of ``Hkv``), one dtype
            of fp16/bf16/fp32/fp64.
        pos_emb: the position embeddings ``[Hp, D, P]`` (``Hp`` 1 or ``H``); positions are
            clamped to ``P - 1``.
        gate_scale: the gates' logit scale, ``g = sigmoid(gate_scale q.k)``.
        scale: the attention logit scale (default ``D ** -0.5``).
        q_offset: query ``i`` sits at key ``i + q_offset`` (cached keys first).
        q_segments, k_segments: document ids ``[B, Nq]`` / ``[B, Nk]`` (packed documents).
        k_valid: ``[B, Nk]`` nonzero at real keys (padding).

    Returns:
        ``[B, H, Nq, D]`` in q's dtype.
    """
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"gated_count_attention wants q [B,H,Nq,D], k = v [B,Hkv,Nk,D] of one dtype; got "
                         f"{tuple(q.shape)} {q.dtype}, {tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}")
    d = q.shape[-1]
    if d > 128 or q.shape[1] % k.shape[1] or pos_emb.dim() != 3 or pos_emb.shape[0] not in (1, q.shape[1]) \
            or pos_emb.shape[1] != d:
        raise ValueError(f"gated_count_attention: head_dim {d} must be <= 128, n_heads {q.shape[1]} a multiple of "
                         f"n_kv_heads {k.shape[1]}, pos_emb [1|H, D, P]; got {tuple(pos_emb.shape)}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    z = torch.matmul(q.to(acc_dtype(q.dtype)), pos_emb.to(acc_dtype(q.dtype))).contiguous()  # [B, H, Nq, P]
    plan = Plan(scale=d ** -0.5 if scale is None else float(scale), causal=1, q_offset=int(q_offset),
                q_segments=q_segments, k_segments=k_segments, k_valid=k_valid)
    return _CoPEAttention.apply(q, k, v, z, plan, float(gate_scale))
