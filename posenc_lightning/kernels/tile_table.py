"""The kernels' pinned tiles: (BM, BN, num_warps, num_stages) per architecture, head-dim bucket,
operand width and kernel kind, read by `kernels.fused.block_config`; no autotuning at run time."""

from __future__ import annotations

#: softmax kernels' (BM, BN, num_warps, num_stages) by (arch, head-dim bucket, operand width, kind):
#: arch 80 (A100 and other sm8x) or 90 (H100, H200); head dims up to 64 or up to 128; "16" for
#: fp16/bf16 (tensor-core products), "32" for fp32 (full-precision products on the CUDA cores:
#: small tiles). Pinned, no autotuning at run time; chosen from the compile report with every
#: feature on (`kernels/resource_report.py`): no register spills in any entry, sm80 and sm90, head
#: dims 64 and 128, every dtype (tests/test_triton_compile.py). dK/dV at head dim 128 holds k, v,
#: dK and dV for a key block on top of the loop's tiles: 16 x 16 on 4 warps is the largest tile
#: without spills on either target.
SOFTMAX_CONFIGS: dict[tuple[int, int, str, str], tuple[int, int, int, int]] = {
    (80, 64, "16", "fwd"): (64, 32, 4, 3),
    (80, 128, "16", "fwd"): (32, 32, 4, 2),
    (80, 64, "16", "bwd_dkdv"): (16, 32, 4, 1),
    (80, 128, "16", "bwd_dkdv"): (16, 16, 4, 1),
    (90, 64, "16", "fwd"): (64, 32, 4, 2),
    (90, 128, "16", "fwd"): (64, 16, 4, 2),
    (90, 64, "16", "bwd_dkdv"): (16, 32, 4, 1),
    (90, 128, "16", "bwd_dkdv"): (16, 16, 4, 1),
    **{(a, d, "16", "bwd_dq"): (32, 32, 4, 2) for a in (80, 90) for d in (64, 128)},
    **{(a, 64, "32", k): (32, 32, 4, 1) for a in (80, 90) for k in ("fwd", "bwd_dq")},
    **{(a, 64, "32", "bwd_dkdv"): (32, 32, 8, 1) for a in (80, 90)},
    **{(a, 128, "32", k): (16, 16, 4, 1) for a in (80, 90) for k in ("fwd", "bwd_dkdv", "bwd_dq")},
}

#: the entries of `SOFTMAX_CONFIGS` that a softmax kernel carrying a normalizer's distance modulation
#: (`fused.Plan.modulation`: one more [BM, BN] tile per score) takes instead: with every feature on,
#: sm80's 16-bit forward at head dim 64 spills 8/8 bytes at 3 stages and its dK/dV at 128 spills 8/4
#: on 4 warps; 2 stages and 8 warps spill none (`resource_report`, ``<kernel>_mod``)
MOD_CONFIGS: dict[tuple[int, int, str, str], tuple[int, int, int, int]] = {
    (80, 64, "16", "fwd"): (64, 32, 4, 2),
    (80, 128, "16", "bwd_dkdv"): (16, 16, 8, 1),
}

#: stick-breaking kernels' (BM, BN, num_warps, num_stages), keyed as `SOFTMAX_CONFIGS` with the kinds
#: sb_fwd, sb_bwd (query-major: dQ, the bias gradients, the row sums per key block) and sb_bwd_dkdv
#: (key-major: dK, dV), whose BN is sb_bwd's (the row sums are per key block of that BN). Pinned from
#: `benchmarks/sb_tile_search.py` with every feature on: the largest tiles without register spills on
#: both targets (tests/test_triton_compile.py), but for two fp32 entries (`SB_SPILLS`). They hold more
#: per score than the softmax kernels (softplus, its suffix sums, A; the backward g, its suffix sums,
#: dS): smaller tiles.
SB_CONFIGS: dict[tuple[int, int, str, str], tuple[int, int, int, int]] = {
    (80, 64, "16", "sb_fwd"): (32, 32, 4, 2),
    (90, 64, "16", "sb_fwd"): (64, 32, 4, 2),
    **{(a, 128, "16", "sb_fwd"): (32, 16, 4, 1) for a in (80, 90)},
    **{(a, 64, "16", k): (16, 32, 4, 1) for a in (80, 90) for k in ("sb_bwd", "sb_bwd_dkdv")},
    **{(a, 128, "16", k): (16, 16, 4, 1) for a in (80, 90) for k in ("sb_bwd", "sb_bwd_dkdv")},
    **{(a, 64, "32", "sb_fwd"): (32, 32, 4, 1) for a in (80, 90)},
    **{(a, 64, "32", k): (16, 16, 4, 1) for a in (80, 90) for k in ("sb_bwd", "sb_bwd_dkdv")},
    # fp32 at head dim 128 ("ieee" products on the CUDA cores hold their operands per thread): 16 x 16,
    # 8 warps where 4 spill; two entries keep a few bytes of spills (`SB_SPILLS`)
    (80, 128, "32", "sb_fwd"): (16, 16, 4, 1),
    (90, 128, "32", "sb_fwd"): (16, 16, 8, 1),
    **{(a, 128, "32", "sb_bwd"): (16, 16, 8, 1) for a in (80, 90)},
    (80, 128, "32", "sb_bwd_dkdv"): (16, 16, 4, 1),
    (90, 128, "32", "sb_bwd_dkdv"): (16, 16, 4, 1),
}
#: the spilled bytes (stores, loads) left in `SB_CONFIGS` at its tiles, every feature on (ptxas -v,
#: Triton 3.7.1, 2026-12-06): fp32 at head dim 128, where no tile searched had none (16 x 16 on 2, 4
#: and 8 warps, 16 x 32 and 32 x 32 on 4: `benchmarks/results/sb_tile_search-cpu-20261206.txt`)
SB_SPILLS: dict[tuple[str, int, str, str], tuple[int, int]] = {
    ("sb_fwd", 128, "float32", "sm90"): (4, 4),
    ("sb_bwd_dkdv", 128, "float32", "sm80"): (8, 4),
}


#: CoPE kernels' (BM, BN, num_warps, num_stages), keyed as `SOFTMAX_CONFIGS` with the kinds cope_fwd,
#: cope_bwd_dq (query-major: dQ, dZ) and cope_bwd_dkdv (key-major: dK, dV); the three share BN (the
#: carries are stored per key block). From the compile report with packed documents and padding on
#: (`kernels/cope_report.py`, Triton 3.7.1, 2026-12-06): the largest tiles searched without register
#: spills at sm80 and sm90 (tests/test_triton_cope.py); 8 warps where 4 spill (the fp16 backward at
#: head dim 64, fp32 at 128, but for sm80's fp32 dK/dV, which spills on 8). Not yet timed on a GPU.
COPE_CONFIGS: dict[tuple[int, int, str, str], tuple[int, int, int, int]] = {
    **{(a, 64, "16", "cope_fwd"): (32, 32, 4, 1) for a in (80, 90)},
    **{(a, 64, "16", k): (32, 32, 8, 1) for a in (80, 90) for k in ("cope_bwd_dq", "cope_bwd_dkdv")},
    **{(a, 128, "16", k): (16, 16, 4, 1) for a in (80, 90) for k in ("cope_fwd", "cope_bwd_dq", "cope_bwd_dkdv")},
    **{(a, 64, "32", k): (16, 16, 4, 1) for a in (80, 90) for k in ("cope_fwd", "cope_bwd_dq", "cope_bwd_dkdv")},
    **{(a, 128, "32", k): (16, 16, 8, 1) for a in (80, 90) for k in ("cope_fwd", "cope_bwd_dq")},
    (80, 128, "32", "cope_bwd_dkdv"): (16, 16, 4, 1),
    (90, 128, "32", "cope_bwd_dkdv"): (16, 16, 8, 1),
}


#: a sliding-window layer's kernels (``WINDOW``: its loop bounds and edge mask hold a few more
#: registers) where the `SB_CONFIGS` tile spills with the window on: (BM, BN, num_warps, num_stages) by the
#: keys of `SB_CONFIGS`, from the compile report with every feature on (``resource_report --window``):
#: no spills at these tiles (the fp32 `SB_SPILLS` entries keep theirs, the same bytes)
WINDOW_CONFIGS: dict[tuple[int, int, str, str], tuple[int, int, int, int]] = {
    (90, 64, "16", "sb_fwd"): (32, 32, 4, 2),  # 64 x 32: 76/48 bytes spilled
    (80, 128, "16", "sb_bwd_dkdv"): (16, 16, 8, 1),  # 4 warps: 8/4 bytes spilled
}
