"""FSDP2 on CPU: 2 gloo processes under Lightning's ``ModelParallelStrategy`` train TinyGPT with
fire / relative_bias / cope injected by `PosEncCallback`, the encoding's parameters sharded over
the ranks (`TinyGPT.shard`), save a distributed checkpoint at step 3, resume from it, and equal a
1-process run with the same global batch. (Lightning's ``FSDPStrategy``, FSDP1, refuses CPU.)

The 2-process runs are tests/fsdp_worker.py, run once for the three encodings (the strategy
launches rank 1 by running that script again). Tolerances, measured on CPU:
- resumed vs uninterrupted 2-process run: bitwise equal losses and final parameters;
- mean of the ranks' losses vs the 1-process run: step 0 to 1e-5 (the same parameters and
  windows; only the loss mean's summation order differs), later steps to 1e-4 (measured: at most
  2.4e-7 for all three): gradients are reduce-scattered in another summation order, and AdamW
  divides each by its own RMS, so float32 rounding in near-zero gradients can become lr-sized
  update differences (see test_hf_ddp.py).
- the encoding's parameters: equal at the start (seeded alike), within 5e-3 after 5 steps
  (measured: fire's MLP output bias 4.7e-4, its other parameters <= 1e-4, relative_bias and cope
  <= 1e-8; AdamW moves an element by about lr <= 3e-3 per step, which bounds the difference).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fsdp_worker import SAVE_AT, STEPS, one_process_fit

ENCODINGS = ("fire", "relative_bias", "cope")
ROOT = Path(__file__).resolve().parents[1]
DIST_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH")))))
    proc = subprocess.run([sys.executable, "-m", "tests.fsdp_worker", str(out), *ENCODINGS], cwd=ROOT, env=env, check=False,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


def _read(d: Path, rank: int) -> dict:
    return json.loads((d / f"rank{rank}.json").read_text())


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_fsdp_two_processes_shard_resume_and_equal_one(fsdp_runs, tmp_path, encoding):
    run = [_read(fsdp_runs / encoding / "run", r) for r in (0, 1)]
    resume = [_read(fsdp_runs / encoding / "resume", r) for r in (0, 1)]
    one_process_fit(encoding, tmp_path)
    one = _read(tmp_path, 0)

    # sharded: every encoding parameter is a DTensor split over the 2 ranks on one dim
    assert run[0]["world"] == 2 and one["world"] == 1
    shards = [r["shards"] for r in run]
    assert shards[0] and shards[0].keys() == shards[1].keys()
    assert all(n.startswith("blocks.0.attn.posenc.") for n in shards[0])  # one module, shared by both blocks
    for name, s0 in shards[0].items():
        s1 = shards[1][name]
        assert s0["dtensor"] and s0["mesh"] == 2 and s0["placements"] == s1["placements"], (name, s0, s1)
        dim = int(s0["placements"][0][2:-1])  # "S(d)"
        assert s0["placements"] == [f"S({dim})"] and s0["shape"] == s1["shape"], (name, s0)
        assert s0["local"][dim] + s1["local"][dim] == s0["shape"][dim], (name, s0, s1)  # split, not copied
        if s0["shape"][dim] > 1:
            assert s0["local"][dim] < s0["shape"][dim] and s1["local"][dim] > 0, (name, s0, s1)
    assert any(s["shape"][int(s["placements"][0][2:-1])] > 1 for s in shards[0].values())
    assert one["start"].keys() == run[0]["start"].keys()

    # the resumed run (a model seeded otherwise, restored from the step-3 checkpoint) continues exactly
    for r in (0, 1):
        assert run[r]["step"] == list(range(STEPS)) and resume[r]["step"] == list(range(SAVE_AT, STEPS))
        assert resume[r]["loss"] == run[r]["loss"][SAVE_AT:], (r, resume[r]["loss"], run[r]["loss"])
        assert resume[r]["end"] == run[r]["end"]

    # the mean of the ranks equals 1 process with the same global batch
    assert run[0]["loss"] != run[1]["loss"]  # the ranks saw different windows
    fsdp = (torch.tensor(run[0]["loss"], dtype=torch.float64) + torch.tensor(run[1]["loss"], dtype=torch.float64)) / 2
    ref = torch.tensor(one["loss"], dtype=torch.float64)
    print(f"{encoding}: |mean FSDP loss - 1-process loss| per step {(fsdp - ref).abs().tolist()}")
    torch.testing.assert_close(fsdp[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fsdp, ref, rtol=0, atol=1e-4)
    for n, v in one["start"].items():
        assert run[0]["start"][n] == run[1]["start"][n] == v, n  # gathered full values: the same init
        worst = (torch.tensor(run[0]["end"][n]) - torch.tensor(one["end"][n])).abs().max()
        print(f"  {n}: max |FSDP - 1-process| after {STEPS} steps {worst:.3g}")
        torch.testing.assert_close(torch.tensor(run[0]["end"][n]), torch.tensor(one["end"][n]), rtol=0, atol=5e-3)
        assert run[0]["end"][n] != v  # trained


def test_fire_scalars_are_one_element_vectors_and_old_scalar_checkpoints_load():
    """FSDP2 refuses 0-d parameters ("fully_shard doesn't support scalar parameters"): FIRE's ``c``
    and ``L_multiplier`` are ``[1]``; a state dict saved when they were 0-d loads into them."""
    from posenc_lightning.encodings.registry import build_encoding

    enc = build_encoding("fire", init_c=0.3, init_L=20.0).bind(n_heads=2)
    assert enc.c.shape == enc.L_multiplier.shape == (1,) and float(enc.threshold) == 20.0
    old = {k: (v.reshape(()) if k in ("c", "L_multiplier") else v) for k, v in enc.state_dict().items()}
    old["c"], old["L_multiplier"] = torch.tensor(0.7), torch.tensor(-2.0)
    assert old["c"].dim() == 0
    enc.load_state_dict(old)
    assert torch.equal(enc.c, torch.tensor([0.7])) and torch.equal(enc.L_multiplier, torch.tensor([-2.0]))
    assert float(enc.threshold) == 40.0  # |L_multiplier * init_L|


def test_tinygpt_pickles_after_a_fit_with_posenc_callback(tmp_path):
    """TinyGPT overrides ``configure_model`` (to shard itself), so `PosEncCallback` wraps it during
    the run; the wrap is undone at teardown so the model still pickles (ddp_spawn, torch.save)."""
    import pickle

    from posenc_lightning import PosEncCallback
    from tests.curriculum_helpers import tiny_data, tiny_model, trainer

    model = tiny_model(None)
    trainer(1, [PosEncCallback("fire")]).fit(model, tiny_data())
    assert "configure_model" not in model.__dict__ and model.device_mesh is None
    x = torch.randint(0, 256, (1, 8))
    again = pickle.loads(pickle.dumps(model))
    assert again.blocks[0].attn.posenc.name == "fire"
    torch.testing.assert_close(again(x), model(x), rtol=0, atol=0)
