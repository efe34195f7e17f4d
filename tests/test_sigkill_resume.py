"""Crash safety (issue 16): a curriculum run killed with SIGKILL (no clean stop, no last
checkpoint) resumes from its last periodic checkpoint with the stage (length, batch size,
encoding scale), the LR (warm restart included) and the learned CLEX parameters of the step it
resumes at, lm-eval's history, and its losses and evaluations equal an uninterrupted run's. Each run is its own process
(tests/sigkill_run.py), one thread each, as a crashed job and its restart would be."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.sigkill_run import CKPT_EVERY, EVAL_EVERY, MAX_STEPS, curriculum

ROOT = Path(__file__).resolve().parents[1]
HANG_AT = CKPT_EVERY + 2  # killed two steps past the checkpoint: those two steps are lost


def _start(out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "tests.sigkill_run", str(out), *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def _finish(p: subprocess.Popen, timeout: float = 120) -> None:
    _, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-3000:]


def test_sigkill_mid_curriculum_then_resume_equals_uninterrupted(tmp_path):
    full = _start(tmp_path / "full")
    crash = _start(tmp_path / "crash", "--hang-at", str(HANG_AT))
    ckpt = tmp_path / "crash" / "ckpt" / f"epoch=0-step={CKPT_EVERY}.ckpt"
    deadline = time.monotonic() + 120
    while not ((tmp_path / "crash" / "hung").exists() and ckpt.exists()):
        assert crash.poll() is None, f"the run ended before it could be killed: {crash.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint / no hang marker after 120 s"
        time.sleep(0.2)
    os.kill(crash.pid, signal.SIGKILL)
    crash.communicate(timeout=30)
    assert crash.returncode == -signal.SIGKILL
    resume = _start(tmp_path / "resume", "--resume", str(ckpt))
    _finish(full)

    ref, killed = _steps(tmp_path / "full"), _steps(tmp_path / "crash")
    assert [r["step"] for r in ref] == list(range(MAX_STEPS))
    assert [r["step"] for r in killed] == list(range(HANG_AT))  # it trained past the checkpoint
    assert sorted(p.name for p in ckpt.parent.iterdir()) == [ckpt.name]  # nothing saved at the kill
    assert killed == ref[:HANG_AT]  # the same run until the kill (deterministic)

    _finish(resume)
    rest = _steps(tmp_path / "resume")
    assert [r["step"] for r in rest] == list(range(CKPT_EVERY, MAX_STEPS))
    stages = {(r["seq_len"], r["batch"], r["scale"]) for r in rest}
    assert len(stages) == 2, stages  # the resumed steps cross a stage boundary
    for a, b in zip(ref[CKPT_EVERY:], rest):
        assert (b["seq_len"], b["batch"], b["scale"]) == (a["seq_len"], a["batch"], a["scale"]), b["step"]
        assert b["lr"] == a["lr"], b["step"]  # the schedule and the warm restart at the step
    assert 0 < curriculum().lr_factor(CKPT_EVERY) < 1 and rest[0]["scale"] == 2.0  # resumed inside a warm restart
    got = torch.tensor([r["loss"] for r in rest], dtype=torch.float64)
    want = torch.tensor([r["loss"] for r in ref[CKPT_EVERY:]], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)

    # the learned encoding at the resumed step: the checkpoint's, equal to the uninterrupted run's
    start = torch.load(tmp_path / "full" / "enc-0.pt")
    at_ref = torch.load(tmp_path / "full" / f"enc-{CKPT_EVERY}.pt")
    at_resume = torch.load(tmp_path / "resume" / f"enc-{CKPT_EVERY}.pt")
    lost = torch.load(tmp_path / "crash" / f"enc-{HANG_AT}.pt")  # what the killed process held
    assert at_ref.keys() == at_resume.keys() and any(k.startswith("ode_") for k in at_ref)
    for k in at_ref:
        assert torch.equal(at_resume[k], at_ref[k]), k
    assert any(not torch.equal(at_ref[k], start[k]) for k in at_ref)  # it trained before the checkpoint
    assert any(not torch.equal(lost[k], at_ref[k]) for k in at_ref)  # and after it (lost by the kill)

    # lm-eval's history: the evaluations before the checkpoint come from it, the later ones are
    # redone and equal. The one due at the checkpoint's own step is not: the checkpoint is written
    # at that step's train-batch end, before its validation, and Lightning's loop, restarting
    # there, fast-forwards past that validation (TrainingEpochLoop.advance ->
    # increment_progress_to_evaluation_end): no validation callback runs at that step.
    hist_ref = json.loads((tmp_path / "full" / "lm_eval.json").read_text())
    hist = json.loads((tmp_path / "resume" / "lm_eval.json").read_text())
    assert [h["step"] for h in hist_ref] == list(range(EVAL_EVERY, MAX_STEPS + 1, EVAL_EVERY))
    assert [h["step"] for h in hist] == [h["step"] for h in hist_ref if h["step"] != CKPT_EVERY]
    for a, b in zip([h for h in hist_ref if h["step"] != CKPT_EVERY], hist):
        assert a["metrics"].keys() == b["metrics"].keys()
        for k, v in a["metrics"].items():
            assert b["metrics"][k] == pytest.approx(v, rel=1e-6), (a["step"], k)
