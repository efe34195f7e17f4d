"""Every kernel configuration, FIRE's per-tile MLP included, compiles for real GPU targets (sm80,
sm90) on this CPU-only machine and fits the target's shared memory
(``posenc_lightning.kernels.resource_report``, run in a subprocess because the interpreter, on for the
other tests, cannot compile). Triton caches the compiled kernels (``TRITON_CACHE_DIR``, default
``~/.triton/cache``), so a rerun only reads them back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_every_kernel_config_compiles_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "posenc_lightning.kernels.resource_report", "--check", "--worst-only", "--no-ptxas",
           "--jobs", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    kernels = ("fwd", "bwd_dkdv", "bwd_dq", "sb_fwd", "sb_bwd", "sb_bwd_dkdv")
    lines = [ln for ln in r.stdout.splitlines() if ln.split()[:1] and ln.split()[0] in
             (*kernels, *(f"{k}_fire" for k in kernels), "rotate")]
    # 6 attention kernels x 4 tilings, again with FIRE's MLP per tile, + the rotation kernel, for both targets
    assert len(lines) == (2 * 6 * 4 + 1) * 2, out
    assert sum(ln.split()[0].endswith("_fire") for ln in lines) == 6 * 4 * 2
    assert {ln.split()[3] for ln in lines} == {"sm80", "sm90"}
    assert all(ln.rstrip().endswith("ok") for ln in lines), out


SOFTMAX_KINDS = ("fwd", "bwd_dkdv", "bwd_dq")
SB_KINDS = ("sb_fwd", "sb_bwd", "sb_bwd_dkdv")


def _report(*args: str, kinds: tuple[str, ...] = SOFTMAX_KINDS) -> list[dict]:
    """Rows of ``resource_report`` for ``kinds`` (a subprocess: the interpreter is on here)."""
    import json
    import tempfile

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "posenc_lightning.kernels.resource_report", "--check", "--kinds", *kinds,
               "--jobs", "2", "--json", path, *args]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500, check=False)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        with open(path) as f:
            return json.load(f)


#: loop bodies in the PTX of each softmax kernel: the unmasked and the masked (diagonal) tiles
BODIES = {"fwd": 2, "bwd_dkdv": 2, "bwd_dq": 2}
#: matrix products per tile: forward S = QK^T, PV; dK/dV: S, dV += P^T dO, dP = dO V^T, dK += dS^T Q;
#: dQ: S, dP, dQ += dS K (FlashAttention-2's count)
PRODUCTS = {"fwd": 2, "bwd_dkdv": 4, "bwd_dq": 3}
#: global atomics of the dK/dV kernel besides the relative table's per-score scatter (issued only on
#: tiles that straddle the table's clamp): one add per program for each of the table's two edges
EDGE_ADDS = 2


def test_softmax_kernels_never_spill():
    """fp16, bf16 and fp32, head_dim 64 and 128, sm80 and sm90, every feature on, at the tiles
    of `tile_table.SOFTMAX_CONFIGS`: 0 bytes of register spills (ptxas -v) in every kernel."""
    rows = _report("--head-dims", "64", "128", "--dtypes", "float16", "bfloat16", "float32")
    assert len(rows) == 3 * 2 * 3 * 2
    for r in rows:
        what = f"{r['kernel']} D={r['head_dim']} {r['dtype']} {r['target']} {r['BM']}x{r['BN']}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (what, r["spill_stores"], r["spill_loads"])


def test_softmax_kernels_compile_to_flash_attention_2_instructions():
    """bf16, head_dim 64 and 128, sm80 and sm90, every feature on (packed documents, padding, all
    four bias kinds), at the tiles of `tile_table.SOFTMAX_CONFIGS`:

    - no 3xTF32: no ``cvt.rna.tf32`` splitting, and on sm80 FlashAttention-2's matrix work,
      ``PRODUCTS * BM * BN * D / (16 * 8 * 16)`` bf16 ``mma.sync`` m16n8k16 per tile shared by the
      warps, up to half again where a tile is narrower than the warps' layout (16 x 16 tiles on 4
      warps repeat a product on two warps); 3xTF32 would be three times the gradient products (a
      static count: one per instruction in the PTX, so per loop body; sm90's ``wgmma`` shapes vary
      with the layout and are only checked for the absence of tf32);
    - at most one ``ex2`` per score: a tile's ``BM * BN`` scores are spread over ``threads``, so a
      loop body holds ``BM * BN / threads`` ``ex2`` for the weights (twice that on a tile of at
      most two scores per thread, 16 x 16 on 4 warps, whose layout repeats it on two warps); the
      forward adds one per row a thread holds for the running maximum's rescale (at most 4 rows
      per thread in these layouts);
    - atomics only for the relative table's gradient: one scatter per score in the dK/dV kernel
      (masked off on tiles wholly past the table's clamp) and `EDGE_ADDS` per program; without the
      table, none in any softmax kernel (the dense-bias gradient is stored, the slope and
      tile-bias sums are one plain store per program).
    """
    rows = _report("--head-dims", "64", "128", "--dtypes", "bfloat16")
    assert len(rows) == 3 * 2 * 2
    for r in rows:
        what = f"{r['kernel']} D={r['head_dim']} {r['target']} {r['BM']}x{r['BN']}"
        kind, bm, bn, threads = r["kernel"], r["BM"], r["BN"], r["threads"]
        assert r["tf32"] == 0 and r["mma"] > 0, what
        scores = BODIES[kind] * bm * bn // threads
        repeat = 2 if bm * bn <= 2 * threads else 1
        assert r["atomics"] in ([scores * k + EDGE_ADDS for k in range(1, repeat + 1)] if kind == "bwd_dkdv"
                                else [0]), (what, r["atomics"])
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (what, r["spill_stores"], r["spill_loads"])
        if r["target"] == "sm80":
            want = BODIES[kind] * PRODUCTS[kind] * bm * bn * r["head_dim"] // (16 * 8 * 16) // (threads // 32)
            assert want <= r["mma"] <= want * 3 // 2, (what, r["mma"], want)
        if kind == "fwd":
            assert scores < r["ex2"] <= scores * repeat + 4 * BODIES[kind], (what, r["ex2"], scores)
        else:
            assert r["ex2"] in (scores, scores * repeat), (what, r["ex2"], scores)
    for r in _report("--head-dims", "64", "128", "--dtypes", "bfloat16", "--no-ptxas", "--without", "table"):
        assert r["atomics"] == 0, r


def test_recorded_softmax_report_has_no_spills():
    """The recorded report (``benchmarks/results/triton_compile_softmax_after_issue45.txt``,
    regenerated by ``resource_report --kinds fwd bwd_dkdv bwd_dq --head-dims 64 128``) lists every
    softmax kernel, dtype and target at head dims 64 and 128, each at 0 spilled bytes and the
    tiles `tile_table.SOFTMAX_CONFIGS` pins now (a stale file fails)."""
    import torch

    from posenc_lightning.kernels.fused import block_config

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                        "triton_compile_softmax_after_issue45.txt")
    with open(path) as f:
        rows = [ln.split() for ln in f if ln.split()[:1] and ln.split()[0] in BODIES]
    assert len(rows) == 3 * 2 * 3 * 2
    for kind, d, dtype, target, tile, warps_stages, *_, spills, mma, tf32, atom, ex2, status in rows:
        cfg = block_config(kind, int(d), getattr(torch, dtype), gpu=True, arch=int(target[2:]))
        assert tile == f"{cfg['BM']}x{cfg['BN']}" and warps_stages == f"{cfg['num_warps']}/{cfg['num_stages']}", \
            (kind, d, dtype, target, tile)
        assert spills == "0/0" and status == "ok" and tf32 == "0", (kind, d, dtype, target, spills)


def _sb_spills(kind: str, d, dtype: str, target: str) -> tuple[int, int]:
    """The spilled bytes (stores, loads) allowed: 0, but for `tile_table.SB_SPILLS`' two fp32 entries."""
    from posenc_lightning.kernels.tile_table import SB_SPILLS

    return SB_SPILLS.get((kind, int(d), dtype, target), (0, 0))


def test_stick_breaking_kernels_never_spill():
    """fp16, bf16 and fp32, head_dim 64 and 128, sm80 and sm90, every feature on, at the tiles
    of `tile_table.SB_CONFIGS`: 0 bytes of register spills (ptxas -v) in the stick-breaking forward,
    its query-major backward (dQ) and its key-major backward (dK, dV), but for the fp32 head-dim-128
    entries that `tile_table.SB_SPILLS` names, which stay at most at its bytes."""
    rows = _report("--head-dims", "64", "128", "--dtypes", "float16", "bfloat16", "float32", kinds=SB_KINDS)
    assert len(rows) == 3 * 2 * 3 * 2
    for r in rows:
        what = f"{r['kernel']} D={r['head_dim']} {r['dtype']} {r['target']} {r['BM']}x{r['BN']}"
        st, ld = _sb_spills(r["kernel"], r["head_dim"], r["dtype"], r["target"])
        assert r["spill_stores"] <= st and r["spill_loads"] <= ld, (what, r["spill_stores"], r["spill_loads"])


def test_stick_breaking_kernels_instructions():
    """bf16, head_dim 64 and 128, sm80 and sm90, every feature on, at the tiles of
    `tile_table.SB_CONFIGS`:

    - no 3xTF32 (``cvt.rna.tf32``): A and dS enter their products in the operand dtype, and
      tensor-core products (``mma``) are there;
    - at most two ``ex2`` per score (the base-2 softplus's and A's; the softplus's log is one
      ``lg2``; the seed's softplus made it three): a loop body holds ``BM * BN / threads`` scores
      per thread, and a tile of at most four scores per thread may repeat its layout on two warps
      (32 x 16 and 16 x 16 on 4 warps do: 16 ``ex2`` for 4 scores, 8 for 2);
    - no atomics in the forward or the dK/dV kernel; in the dQ kernel only the relative table's:
      one scatter per score (masked off on tiles wholly past its clamp) and `EDGE_ADDS` per
      program; none without the table (the dense bias's gradient is stored).
    """
    rows = _report("--head-dims", "64", "128", "--dtypes", "bfloat16", kinds=SB_KINDS)
    assert len(rows) == 3 * 2 * 2
    for r in rows:
        what = f"{r['kernel']} D={r['head_dim']} {r['target']} {r['BM']}x{r['BN']}"
        scores = r["BM"] * r["BN"] // r["threads"]
        repeat = 2 if r["BM"] * r["BN"] <= 4 * r["threads"] else 1
        assert r["tf32"] == 0 and r["mma"] > 0, (what, r["tf32"], r["mma"])
        assert 0 < r["ex2"] <= 2 * scores * repeat, (what, r["ex2"], scores)
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (what, r["spill_stores"], r["spill_loads"])
        want = [scores * k + EDGE_ADDS for k in range(1, repeat + 1)] if r["kernel"] == "sb_bwd" else [0]
        assert r["atomics"] in want, (what, r["atomics"], want)
    for r in _report("--head-dims", "64", "128", "--dtypes", "bfloat16", "--no-ptxas", "--without", "table",
                     kinds=SB_KINDS):
        assert r["atomics"] == 0, r


def test_recorded_stick_breaking_report_has_no_spills():
    """The recorded report (``benchmarks/results/triton_compile_sb_after_issue45.txt``, regenerated
    by ``resource_report --kinds sb_fwd sb_bwd sb_bwd_dkdv --head-dims 64 128``) lists every
    stick-breaking kernel, dtype and target at head dims 64 and 128, each at 0 spilled bytes (but
    `tile_table.SB_SPILLS`), no tf32 conversion, no atomics outside the dQ sweep, and the tiles
    `tile_table.SB_CONFIGS` pins now (a stale file fails)."""
    import torch

    from posenc_lightning.kernels.fused import block_config

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                        "triton_compile_sb_after_issue45.txt")
    with open(path) as f:
        rows = [ln.split() for ln in f if ln.split()[:1] and ln.split()[0] in SB_KINDS]
    assert len(rows) == 3 * 2 * 3 * 2
    for kind, d, dtype, target, tile, warps_stages, *_, spills, mma, tf32, atom, ex2, status in rows:
        cfg = block_config(kind, int(d), getattr(torch, dtype), gpu=True, arch=int(target[2:]))
        assert tile == f"{cfg['BM']}x{cfg['BN']}" and warps_stages == f"{cfg['num_warps']}/{cfg['num_stages']}", \
            (kind, d, dtype, target, tile)
        st, ld = (int(x) for x in spills.split("/"))
        allowed = _sb_spills(kind, d, dtype, target)
        assert st <= allowed[0] and ld <= allowed[1] and status == "ok" and tf32 == "0", (kind, d, dtype, target, spills)
        if kind != "sb_bwd":
            assert atom == "0", (kind, d, dtype, target, atom)
        else:  # the relative table's scatter, one per score a thread holds, and its two edges
            assert 0 < int(atom) <= 2 * int(tile.split("x")[0]) * int(tile.split("x")[1]) // (
                32 * int(warps_stages.split("/")[0])) + EDGE_ADDS, (kind, d, dtype, target, atom)


def test_stick_breaking_table_shares_the_key_block():
    """The dK/dV sweep reads the row sums the dQ sweep leaves per key block: every entry of
    `tile_table.SB_CONFIGS` gives both the same BN (and `fused` refuses a table that does not)."""
    from posenc_lightning.kernels.fused import SB_CONFIGS

    keys = [k for k in SB_CONFIGS if k[3] == "sb_bwd"]
    assert len(keys) == 2 * 2 * 2
    for arch, d, width, _ in keys:
        assert SB_CONFIGS[(arch, d, width, "sb_bwd")][1] == SB_CONFIGS[(arch, d, width, "sb_bwd_dkdv")][1], \
            (arch, d, width)


def _allowed_spills(kind: str, d, dtype: str, target: str) -> tuple[int, int]:
    return _sb_spills(kind, d, dtype, target) if kind in SB_KINDS else (0, 0)


def test_windowed_kernels_never_spill():
    """A sliding-window layer's kernels (``WINDOW``: the loop bounds, the edge tiles folded into the
    masked loop, the window's mask term; `tile_table.WINDOW_CONFIGS` where a tile needed changing),
    fp16, bf16 and fp32, head_dim 64 and 128, sm80 and sm90, every feature on: 0 bytes of register
    spills but for the fp32 entries of `tile_table.SB_SPILLS` (at most their bytes), and as many
    matrix instructions per softmax kernel as without a window (the same two loop bodies)."""
    rows = _report("--window", "--head-dims", "64", "128", "--dtypes", "float16", "bfloat16", "float32",
                   kinds=SOFTMAX_KINDS + SB_KINDS)
    assert len(rows) == 6 * 2 * 3 * 2 and all(r["window"] for r in rows)
    for r in rows:
        what = f"{r['kernel']} D={r['head_dim']} {r['dtype']} {r['target']} {r['BM']}x{r['BN']}"
        st, ld = _allowed_spills(r["kernel"], r["head_dim"], r["dtype"], r["target"])
        assert r["spill_stores"] <= st and r["spill_loads"] <= ld, (what, r["spill_stores"], r["spill_loads"])
        assert r["tf32"] == 0 and (r["mma"] > 0) == (r["dtype"] != "float32"), what
        if r["kernel"] in SOFTMAX_KINDS and r["dtype"] == "bfloat16" and r["target"] == "sm80":
            bm, bn, threads = r["BM"], r["BN"], r["threads"]
            want = BODIES[r["kernel"]] * PRODUCTS[r["kernel"]] * bm * bn * r["head_dim"] // (16 * 8 * 16) // (threads // 32)
            assert want <= r["mma"] <= want * 3 // 2, (what, r["mma"], want)


def test_recorded_window_report_has_no_spills():
    """The recorded report of the windowed kernels (``benchmarks/results/triton_compile_window_issue47.txt``,
    regenerated by ``resource_report --window --kinds fwd bwd_dkdv bwd_dq sb_fwd sb_bwd sb_bwd_dkdv
    --head-dims 64 128``): every kernel, dtype and target at 0 spilled bytes (but `SB_SPILLS`), at
    the tiles `block_config` picks for a window now (a stale file fails)."""
    import torch

    from posenc_lightning.kernels.fused import block_config

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "triton_compile_window_issue47.txt")
    with open(path) as f:
        rows = [ln.split() for ln in f if ln.split()[:1] and ln.split()[0] in SOFTMAX_KINDS + SB_KINDS]
    assert len(rows) == 6 * 2 * 3 * 2
    for kind, d, dtype, target, tile, warps_stages, *_, spills, mma, tf32, atom, ex2, status in rows:
        cfg = block_config(kind, int(d), getattr(torch, dtype), gpu=True, arch=int(target[2:]), window=True)
        assert tile == f"{cfg['BM']}x{cfg['BN']}" and warps_stages == f"{cfg['num_warps']}/{cfg['num_stages']}", \
            (kind, d, dtype, target, tile)
        st, ld = (int(x) for x in spills.split("/"))
        allowed = _allowed_spills(kind, d, dtype, target)
        assert st <= allowed[0] and ld <= allowed[1] and status == "ok" and tf32 == "0", (kind, d, dtype, target, spills)
MOD_KINDS = ("fwd_mod", "bwd_dkdv_mod", "bwd_dq_mod")


def test_modulated_softmax_kernels_never_spill():
    """The softmax kernels with a normalizer's distance modulation on top (``<kernel>_mod``: every
    feature on, plus `Plan.modulation`): fp16, bf16 and fp32, head_dim 64 and 128, sm80 and sm90, at
    the tiles `block_config` gives them (`tile_table.MOD_CONFIGS` over `SOFTMAX_CONFIGS`): 0 bytes of
    register spills, no 3xTF32, and one ``ex2`` per score more than the kernel without it (the
    modulation's exponential; the backward multiplies dS by the logits' tile), but fp32's
    rematerialized one."""
    rows = _report("--head-dims", "64", "128", "--dtypes", "float16", "bfloat16", "float32", kinds=MOD_KINDS)
    assert len(rows) == 3 * 2 * 3 * 2
    for r in rows:
        what = f"{r['kernel']} D={r['head_dim']} {r['dtype']} {r['target']} {r['BM']}x{r['BN']}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (what, r["spill_stores"], r["spill_loads"])
        assert r["tf32"] == 0, what
        if r["kernel"] != "fwd_mod":  # the forward's count also holds the running maximum's rescale
            # a tile of at most two scores per thread repeats its layout over the warps: twice on 4
            # warps (as above), four times for 16 x 16 on 8 (`MOD_CONFIGS`' sm80 dK/dV)
            # fp32 at head dim 64 (32 x 32, products on the CUDA cores) recomputes the modulation in
            # dS's layout instead of converting the logits' tile: one more there (measured 3 per score)
            scores = BODIES[r["kernel"][:-4]] * r["BM"] * r["BN"] // r["threads"]
            repeats = (1, 2, 4) if r["BM"] * r["BN"] <= 2 * r["threads"] else (1,)
            allowed = [2 * scores * k for k in repeats] + ([3 * scores] if r["dtype"] == "float32" else [])
            assert r["ex2"] in allowed, (what, r["ex2"], scores)
