"""Compile every kernel configuration for real GPU targets without a GPU (``triton.compile`` with
a `GPUTarget`), and report shared memory, registers and spills (ptxas ``-v``).

Run as ``python -m posenc_lightning.kernels.resource_report [--check] [--json PATH]``; it needs
``TRITON_INTERPRET`` unset (under the interpreter ``@triton.jit`` makes no compilable function),
so the tests start it in a subprocess. Compiled kernels land in Triton's cache
(``TRITON_CACHE_DIR``, default ``~/.triton/cache``): a second run only reads them back.
``--check`` exits 1 on a compile error or on shared memory above the target's limit.

Besides the plain kernels, ``<kernel>_<tile>`` compiles the kernel again with a tile bias
evaluated per tile on top (`TileBias`): one variant per registered tile kind
(`posenc_lightning.encodings.bias.register_tile_kind`, in the kind's own file); ``<kernel>_mod``
compiles a softmax kernel again with a normalizer's distance modulation of the logits on top
(`Plan.modulation`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from posenc_lightning.encodings.bias import TileBias

#: the attention kernels (every one also compiles with each example tile) and the rotation
BASE_KINDS = ("fwd", "bwd_dkdv", "bwd_dq", "sb_fwd", "sb_bwd", "sb_bwd_dkdv", "rotate")
#: the kernels that also compile with a normalizer's distance modulation (``<kernel>_mod``)
MOD_KINDS = ("fwd", "bwd_dkdv", "bwd_dq")
#: heads of the example launches
_HEADS = 2
HEAD_DIMS = (16, 32, 64, 128)
DTYPES = ("float16", "bfloat16", "float32")
#: compute capability -> opt-in shared memory per block (bytes): A100 163 KiB, H100 227 KiB
TARGETS = {80: 163 * 1024, 90: 227 * 1024}
_ACC = ("O", "LSE", "DELTA", "DQ", "DK", "DV", "DCQ", "DCK", "DTABLE", "DSLOPE", "DDENSE", "DTILE", "TAILS", "GTAILS", "X")
_TY = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
       torch.float64: "fp64", torch.int64: "i64"}


@functools.cache
def example_tiles() -> dict[str, TileBias]:
    """One example tile per registered tile kind (`register_tile_kind`), by `TileBias.name`.
    Importing ``encodings.bias`` imports the ``encodings`` package first, which imports every
    family module, so every kind's registration has run."""
    from posenc_lightning.encodings.bias import tile_kinds

    tiles = {name: example(_HEADS) for name, example in tile_kinds().items()}
    wrong = [f"{name} (gives {t.name})" for name, t in tiles.items() if t.name != name]
    if wrong:
        raise ValueError(f"example tiles named other than their kind: {', '.join(wrong)}")
    return tiles


def all_kinds() -> tuple[str, ...]:
    """`BASE_KINDS`, then ``<kernel>_<tile>`` for every attention kernel and `example_tiles`, then
    ``<kernel>_mod`` for `MOD_KINDS`."""
    attn = [k for k in BASE_KINDS if k != "rotate"]
    return BASE_KINDS + tuple(f"{k}_{t}" for t in example_tiles() for k in attn) + tuple(f"{k}_mod" for k in MOD_KINDS)


def _split(kind: str) -> tuple[str, TileBias | None, bool]:
    """``(kernel, tile, modulated)`` of a kind: ``"fwd"``, ``"fwd_<tile>"`` or ``"fwd_mod"``."""
    if kind.endswith("_mod") and kind[:-4] in MOD_KINDS:
        return kind[:-4], None, True
    for base in BASE_KINDS:
        if kind == base:
            return base, None, False
        if kind.startswith(base + "_") and kind[len(base) + 1:] in example_tiles():
            return base, example_tiles()[kind[len(base) + 1:]], False
    raise ValueError(f"unknown kernel kind {kind!r}; known: {', '.join(all_kinds())}")


def _kernel(kind: str):
    from posenc_lightning.kernels import _common, softmax, stick_breaking

    return {"fwd": softmax._fwd_kernel, "bwd_dkdv": softmax._bwd_dkdv_kernel, "bwd_dq": softmax._bwd_dq_kernel,
            "sb_fwd": stick_breaking._sb_fwd_kernel, "sb_bwd": stick_breaking._sb_bwd_kernel,
            "sb_bwd_dkdv": stick_breaking._sb_bwd_dkdv_kernel,
            "rotate": _common._rotate_kernel}[kind]


#: the features of a launch that ``without`` may switch off
FEATURES = ("rotary", "segments", "padding", "slopes", "table", "decay", "dense")


def launch_spec(kind: str, head_dim: int, dtype: torch.dtype, cc: int = 90, without: tuple[str, ...] = (),
                tile_config: tuple[int, int, int, int] | None = None, window: bool = False):
    """``(kernel, values by argument name, num_warps, num_stages)`` of the GPU launch of ``kind``
    for compute capability ``cc`` with every feature on (rotary, packed documents, padding, all
    four bias kinds; an example tile bias too for the ``<kernel>_<tile>`` variants, a normalizer's
    distance modulation for ``<kernel>_mod``) except those
    named in ``without`` (`FEATURES`), at the tiles `fused.block_config` picks or at
    ``tile_config`` ``(BM, BN, num_warps, num_stages)`` (to search for a table entry); ``window``:
    the kernels of a sliding-window layer (``WINDOW``: its loop bounds and edge tiles)."""
    from posenc_lightning.kernels.fused import Plan, RotaryTables, block_config, common_args, head_block

    kind, tile, modulated = _split(kind)
    b, h, n, d = 1, _HEADS, 8, head_dim
    q = torch.zeros(b, h, n, d, dtype=dtype)
    cos = torch.zeros(n, d // 2)
    pos = torch.zeros(b, n, dtype=torch.long)
    unknown = set(without) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}; known: {', '.join(FEATURES)}")
    on = {f: f not in without for f in FEATURES}
    plan = Plan(scale=d ** -0.5, causal=1, rotary=RotaryTables(cos, cos, pos, cos, cos, pos) if on["rotary"] else None,
                q_segments=pos if on["segments"] else None, k_valid=pos.bool() if on["padding"] else None,
                bias_q_pos=pos.float(), bias_k_pos=pos.float(), stick_breaking=kind.startswith("sb"), tile=tile,
                window=64 if window else None, modulation=(0.005, 0.7) if modulated else None)
    z = torch.zeros(h, dtype=torch.float32)
    c = torch.zeros(b, h, n)
    args, flags = common_args(q, q, plan, z if on["slopes"] else None, torch.zeros(h, 9) if on["table"] else None,
                              c if on["decay"] else None, c if on["decay"] else None,
                              torch.zeros(b, h, n, n) if on["dense"] else None,
                              tile.params if tile is not None else None)
    # a tile bias does not change the tiling
    cfg = block_config(kind, d, dtype, gpu=True, arch=cc, window=window, modulated=modulated)
    if tile_config is not None:
        cfg = dict(zip(("BM", "BN", "num_warps", "num_stages"), tile_config))
    kernel = _kernel(kind)
    if kind == "rotate":
        flags = {"ROT": 1, "SIGN": -1, "BD": head_block(d), "ACC": flags["ACC"]}
        vals = {"COS": args["QCOS"], "SIN": args["QSIN"], "IDX": args["QIDX"], "R": d, "H": h, "N": n, "D": d,
                "X": torch.zeros(1), "Y": torch.zeros(1, dtype=dtype)}  # float32 gradient -> input dtype
    else:
        vals = dict(args)
        flags = {**flags, "EVEN_N": 1}  # dK/dV: N a multiple of the key block
    vals.update(flags)
    vals.update({"BM": cfg["BM"], "BN": cfg["BN"]})
    for p in kernel.params:
        if p.name in vals:
            continue
        if p.name.isupper():  # a tensor the launch allocates or passes through
            vals[p.name] = torch.zeros(1, dtype=torch.float32 if p.name in _ACC else dtype)
        else:
            vals[p.name] = 64  # strides, counts
    return kernel, vals, cfg["num_warps"], cfg["num_stages"]


def _ptxas_usage(ptx: str, cc: int) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas

    arch = f"sm_{cc}a" if cc >= 90 else f"sm_{cc}"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([get_ptxas(cc).path, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(tmp, "k.o")],
                           capture_output=True, text=True, check=False)
    log = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"registers": int(regs.group(1)) if regs else -1,
            "spill_stores": int(spill.group(1)) if spill else -1, "spill_loads": int(spill.group(2)) if spill else -1}


#: PTX instruction counts in the report: matrix instructions (``mma.sync``: one warp's
#: m16n8k16 / m16n8k8 product, ``wgmma.mma_async``: one warpgroup's), the round-to-tf32
#: conversions that split an fp32 operand into 3xTF32 parts (``cvt.rna.tf32``), global atomics
#: (``atom.global`` / ``red.global``), and base-2 exponentials (``ex2.approx``: ``tl.exp`` lowers to
#: a multiply by log2(e) and one, ``tl.exp2`` to one). Static counts: one per instruction in the
#: PTX text, whatever the number of times a loop runs it.
PTX_COUNTS = {"mma": r"\b(?:mma\.sync|wgmma\.mma_async)\b", "tf32": r"\bcvt\.rna\.tf32", "atomics": r"\b(?:atom|red)\.global\b",
              "ex2": r"\bex2\.approx"}


def ptx_counts(ptx: str) -> dict:
    """`PTX_COUNTS` in one kernel's PTX (instruction lines only, comments skipped)."""
    code = "\n".join(ln.split("//")[0] for ln in ptx.splitlines())
    return {k: len(re.findall(pat, code)) for k, pat in PTX_COUNTS.items()}


def compile_one(kind: str, head_dim: int, dtype_name: str, cc: int, ptxas: bool = True,
                without: tuple[str, ...] = (), tile_config: tuple[int, int, int, int] | None = None,
                window: bool = False) -> dict:
    """One row of the report: ``kind`` compiled for ``sm{cc}`` (`launch_spec`'s arguments)."""
    return compile_launch(kind, head_dim, dtype_name, cc, lambda dtype: launch_spec(kind, head_dim, dtype, cc, without,
                                                                                    tile_config, window),
                          ptxas, window)


def compile_launch(kind: str, head_dim: int, dtype_name: str, cc: int, spec, ptxas: bool = True,
                   window: bool = False) -> dict:
    """One row of the report: the launch ``spec(dtype) -> (kernel, values by argument name, num_warps,
    num_stages)`` compiled for ``sm{cc}`` (kernels of an encoding's own report their launches here too)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    dtype = getattr(torch, dtype_name)
    row = {"kernel": kind, "head_dim": head_dim, "dtype": dtype_name, "target": f"sm{cc}", "window": window}
    try:
        kernel, vals, warps, stages = spec(dtype)
        sig, consts, attrs = {}, {}, {}
        for i, p in enumerate(kernel.params):
            val = vals[p.name]
            if p.is_constexpr:
                sig[p.name], consts[p.name] = "constexpr", val
            elif isinstance(val, torch.Tensor):
                sig[p.name] = "*" + _TY[val.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(val, float):
                sig[p.name] = "fp32"
            else:
                sig[p.name] = "i32"
        src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
        c = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": warps, "num_stages": stages})
        row.update({"BM": vals["BM"], "BN": vals["BN"], "num_warps": warps, "num_stages": stages,
                    "shared_bytes": int(c.metadata.shared), "shared_limit": TARGETS[cc]})
        row.update({"threads": 32 * warps, **ptx_counts(c.asm["ptx"])})
        row.update(_ptxas_usage(c.asm["ptx"], cc) if ptxas else {"registers": -1, "spill_stores": -1,
                                                                  "spill_loads": -1})
        row["ok"] = row["shared_bytes"] <= TARGETS[cc]
        if not row["ok"]:
            row["error"] = f"shared memory {row['shared_bytes']} B > {TARGETS[cc]} B"
    except Exception as e:  # noqa: BLE001 - a compile error is a result to report
        row.update({"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"})
    return row


#: the largest head dim and dtype of every distinct tiling `block_config` picks: a compile test
#: of these covers every (kernel, tile config) pair at its largest shared-memory footprint
WORST_CASES = ((64, "float16"), (128, "float16"), (64, "float32"), (128, "float32"))


def configs(kinds=None, head_dims=HEAD_DIMS, dtypes=DTYPES, targets=tuple(TARGETS), worst_only=False):
    for kind in kinds or all_kinds():
        if worst_only:
            pairs = [(128, "float16")] if kind == "rotate" else list(WORST_CASES)
        else:
            pairs = [(d, dt) for d in head_dims for dt in dtypes]
        for d, dt in pairs:
            for cc in targets:
                yield kind, d, dt, cc


def run_all(jobs: int = 2, ptxas: bool = True, without: tuple[str, ...] = (), window: bool = False,
            **sel) -> list[dict]:
    todo = [(*c, ptxas, tuple(without), None, window) for c in configs(**sel)]
    if jobs <= 1:
        return [compile_one(*c) for c in todo]
    with ProcessPoolExecutor(jobs) as ex:
        return list(ex.map(compile_one, *zip(*todo)))


def format_table(rows: list[dict]) -> str:
    head = f"{'kernel':14} {'D':>4} {'dtype':9} {'target':6} {'BMxBN':>7} {'w/s':>4} {'smem KiB':>9} {'limit':>6} " \
           f"{'regs':>5} {'spill st/ld':>12} {'mma':>5} {'tf32':>5} {'atom':>5} {'ex2':>5}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "shared_bytes" in r:
            lines.append(f"{r['kernel']:14} {r['head_dim']:>4} {r['dtype']:9} {r['target']:6} "
                         f"{str(r['BM']) + 'x' + str(r['BN']):>7} {str(r['num_warps']) + '/' + str(r['num_stages']):>4} "
                         f"{r['shared_bytes'] / 1024:9.1f} {r['shared_limit'] // 1024:6d} {r['registers']:5d} "
                         f"{str(r['spill_stores']) + '/' + str(r['spill_loads']):>12} "
                         f"{r['mma']:5d} {r['tf32']:5d} {r['atomics']:5d} {r['ex2']:5d}  "
                         f"{'ok' if r['ok'] else 'FAIL ' + r['error']}")
        else:
            lines.append(f"{r['kernel']:14} {r['head_dim']:>4} {r['dtype']:9} {r['target']:6} FAIL {r['error']}")
    bad = sum(not r["ok"] for r in rows)
    lines.append(f"{len(rows) - bad} passed, {bad} failed")
    return "\n".join(lines)


def emit(rows: list[dict], json_path: str | None, check: bool) -> int:
    """Print ``rows`` as the report's table, write them as JSON to ``json_path`` (if given).

    Args:
        rows: `compile_launch` rows.
        json_path: where to write them as JSON, or None.
        check: fail on any row that did not compile cleanly.

    Returns:
        The exit status: 1 when ``check`` and a row is not ok, else 0.
    """
    print(format_table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if check and not all(r["ok"] for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 on any compile error or shared memory overflow")
    p.add_argument("--json", help="also write the rows as JSON here")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--kinds", nargs="*", help="default: every kernel, plain and with each example tile")
    p.add_argument("--head-dims", nargs="*", type=int, default=list(HEAD_DIMS))
    p.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    p.add_argument("--worst-only", action="store_true", help="only the largest config of every tiling")
    p.add_argument("--without", nargs="*", default=[], choices=FEATURES, help="features switched off")
    p.add_argument("--no-ptxas", action="store_true", help="skip the register/spill figures (ptxas -v is slow)")
    p.add_argument("--window", action="store_true", help="the kernels of a sliding-window layer (WINDOW)")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the interpreter cannot compile for GPU targets", file=sys.stderr)
        return 2
    rows = run_all(a.jobs, not a.no_ptxas, tuple(a.without), a.window, kinds=tuple(a.kinds or all_kinds()), head_dims=tuple(a.head_dims), dtypes=tuple(a.dtypes),
                   worst_only=a.worst_only)
    return emit(rows, a.json, a.check)


if __name__ == "__main__":
    sys.exit(main())
