"""`ContextParallel` with FSDP2 (Lightning's ``ModelParallelStrategy`` on gloo CPU, parameters
sharded over the 2 ranks by `TinyGPT.shard`): the two ranks share each sequence (shards of 8 of 16
tokens) and the mean of their losses equals a 1-process run under the same strategy (its
distributed sampler shuffles the windows alike) at every step. Tolerance 1e-5 (measured 3e-7: the
sharded parameters are gradient-averaged in another summation order, then AdamW steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DIST_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _run(out: Path, devices: int) -> list[list[list[float]]]:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH")))))
    proc = subprocess.run([sys.executable, "-m", "tests.cp_fsdp_worker", str(out), str(devices)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]


@pytest.mark.slow
def test_fsdp2_with_context_parallel_equals_one_process(tmp_path):
    cp = _run(tmp_path / "cp", 2)
    (one,) = _run(tmp_path / "one", 1)
    assert [n for _, n in cp[0]] == [8, 8, 8] and [n for _, n in one] == [16, 16, 16]
    mean = torch.tensor([(a + b) / 2 for (a, _), (b, _) in zip(cp[0], cp[1])])
    torch.testing.assert_close(mean, torch.tensor([x for x, _ in one]), rtol=1e-5, atol=1e-5)
