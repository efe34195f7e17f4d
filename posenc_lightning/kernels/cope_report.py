"""The CoPE kernels' compile report (`kernels.cope`): every kernel at the tiles of
`tile_table.COPE_CONFIGS`, compiled for sm80 and sm90 without a GPU, with packed documents and key
padding on, and its shared memory, registers, spills (ptxas ``-v``) and PTX instruction counts
(`resource_report.compile_launch`: global atomics included, which the kernels have none of).

Run as ``python -m posenc_lightning.kernels.cope_report [--check] [--json PATH]`` with
``TRITON_INTERPRET`` unset (tests/test_triton_cope.py starts it in a subprocess).
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

from posenc_lightning.kernels.resource_report import TARGETS, WORST_CASES, compile_launch, emit

KINDS = ("cope_fwd", "cope_bwd_dq", "cope_bwd_dkdv")
#: the integer positions of the example launch (CoPE's default ``max_position``)
POSITIONS = 64
#: the tensors the kernels read or write in float32 (the others are in the input dtype)
_ACC = ("Z", "LSE", "DELTA", "GTAIL", "DPTAIL", "DQ", "DZ", "DK", "DV")


def launch_spec(kind: str, head_dim: int, dtype: torch.dtype, cc: int = 90,
                tile_config: tuple[int, int, int, int] | None = None):
    """``(kernel, values by argument name, num_warps, num_stages)`` of the GPU launch of ``kind``
    for compute capability ``cc`` with packed documents and padding on, at the tiles
    `gated_counts.cope_block_config` picks or at ``tile_config`` ``(BM, BN, num_warps, num_stages)``."""
    from posenc_lightning.kernels import cope
    from posenc_lightning.kernels.fused import Plan
    from posenc_lightning.kernels.gated_counts import cope_block_config, kernel_args

    if kind not in KINDS:
        raise ValueError(f"unknown CoPE kernel kind {kind!r}; known: {', '.join(KINDS)}")
    q = torch.zeros(1, 2, 8, head_dim, dtype=dtype)
    seg = torch.zeros(1, 8, dtype=torch.long)
    plan = Plan(scale=head_dim ** -0.5, causal=1, q_segments=seg, k_valid=seg.bool())
    vals = kernel_args(q, q, POSITIONS, plan, head_dim ** -0.5)
    cfg = cope_block_config(kind, head_dim, dtype, gpu=True, arch=cc)
    if tile_config is not None:
        cfg = dict(zip(("BM", "BN", "num_warps", "num_stages"), tile_config))
    vals.update({"BM": cfg["BM"], "BN": cfg["BN"]})
    kernel = {"cope_fwd": cope._cope_fwd_kernel, "cope_bwd_dq": cope._cope_bwd_dq_kernel,
              "cope_bwd_dkdv": cope._cope_bwd_dkdv_kernel}[kind]
    for p in kernel.params:
        if p.name in vals:
            continue
        if p.name.isupper():  # a tensor the launch allocates or passes through
            vals[p.name] = torch.zeros(1, dtype=torch.float32 if p.name in _ACC else dtype)
        else:
            vals[p.name] = 64  # strides, counts
    return kernel, vals, cfg["num_warps"], cfg["num_stages"]


def compile_one(kind: str, head_dim: int, dtype_name: str, cc: int, ptxas: bool = True,
                tile_config: tuple[int, int, int, int] | None = None) -> dict:
    """One row of the report: ``kind`` compiled for ``sm{cc}``."""
    return compile_launch(kind, head_dim, dtype_name, cc, lambda dtype: launch_spec(kind, head_dim, dtype, cc,
                                                                                    tile_config), ptxas)


def run_all(kinds: tuple[str, ...] = KINDS, jobs: int = 2, ptxas: bool = True) -> list[dict]:
    """Every kind at the largest head dim and dtype of each tiling (`resource_report.WORST_CASES`), both targets."""
    todo = [(k, d, dt, cc, ptxas) for k in kinds for d, dt in WORST_CASES for cc in TARGETS]
    if jobs <= 1:
        return [compile_one(*t) for t in todo]
    with ProcessPoolExecutor(jobs) as ex:
        return list(ex.map(compile_one, *zip(*todo)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 on any compile error or shared memory overflow")
    p.add_argument("--json", help="also write the rows as JSON here")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--kinds", nargs="*", default=list(KINDS))
    p.add_argument("--no-ptxas", action="store_true", help="skip the register/spill figures (ptxas -v is slow)")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the interpreter cannot compile for GPU targets", file=sys.stderr)
        return 2
    return emit(run_all(tuple(a.kinds), a.jobs, not a.no_ptxas), a.json, a.check)


if __name__ == "__main__":
    sys.exit(main())
