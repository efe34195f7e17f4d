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
    kernels = ("fwd", "bwd_dkdv", "bwd_dq", "sb_fwd", "sb_bwd")
    lines = [ln for ln in r.stdout.splitlines() if ln.split()[:1] and ln.split()[0] in
             (*kernels, *(f"{k}_fire" for k in kernels), "rotate")]
    # 5 attention kernels x 3 tilings, again with FIRE's MLP per tile, + the rotation kernel, for both targets
    assert len(lines) == (2 * 5 * 3 + 1) * 2, out
    assert sum(ln.split()[0].endswith("_fire") for ln in lines) == 5 * 3 * 2
    assert {ln.split()[3] for ln in lines} == {"sm80", "sm90"}
    assert all(ln.rstrip().endswith("ok") for ln in lines), out
