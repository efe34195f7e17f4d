"""benchmarks/gpu_perf.sh (issue 45) on this CPU machine: its dry run, a real subprocess, builds every
case at tiny sizes and runs it once where the CPU can; the plan names every registered encoding
through every backend at every shape with a status (run, validated, or unsupported with the
backend's reason); the FLOP and byte floors are the formulas'; and the per-path times of a results
record become `proven_on_gpu.Proven` entries (`gpu_proven.py --times`)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_perf, gpu_proven, perf_cases, perf_report
from posenc_lightning.encodings.proven_on_gpu import Proven
from posenc_lightning.encodings.registry import available_encodings

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_perf.sh"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[str, dict]:
    """The dry run's output and plan; the Triton interpreter off (its cases are validated, not run)."""
    plan = tmp_path_factory.mktemp("perf") / "plan.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--json", str(plan)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, check=False, env={**env, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout, json.loads(plan.read_text())


def test_the_plan_names_every_encoding_through_every_backend_with_a_status(dry_run):
    out, plan = dry_run
    rows = plan["cases"]
    shapes = {(n, d) for n in perf_cases.LENGTHS for d in perf_cases.HEAD_DIMS}
    for name in available_encodings():
        for backend in perf_cases.ENCODING_BACKENDS:
            got = {(r["n"], r["d"]): r["status"] for r in rows if r["section"] == backend and r["label"] == name}
            assert set(got) == shapes, (name, backend, got)
            for status in got.values():
                assert status.startswith(("ok: ", "unsupported: ")) and len(status) > 15, (name, backend, status)
            assert f"| {name} | {backend} |" in out
    assert not [r for r in rows if not r["status"].startswith(("ok: ", "unsupported: "))]
    # the refusals are the backends' own reasons
    status = {(r["section"], r["label"]): r["status"] for r in rows if r["section"] in perf_cases.ENCODING_BACKENDS}
    assert "replaces softmax" in status[("flex", "sba")] and "N x N" in status[("triton", "path")]
    assert status[("auto", "rope")].startswith("ok: ran fwd+bwd on CPU")
    sections = {r["section"] for r in rows}
    assert sections == {s for s, _ in perf_cases.SECTIONS}
    variants = " ".join(r["variant"] for r in rows if r["section"] == "ablation")
    for word in ("precision=highest", "precision=high", "fwd=pinned", "bwd_dkdv=", "in-kernel", "pre-rotated",
                 "cuda-graph=on", "cuda-graph=off"):
        assert word in variants, word
    assert {r["label"] for r in rows if r["section"] == "baseline"} == {"sdpa-default", "sdpa-flash", "sdpa-cudnn"}
    assert "would run: timeout -k 10 480 " in out  # the hard limit: 8 minutes
    assert f"estimated device time {plan['estimate_s']:.0f} s" in out


def test_the_floors_are_the_formulas(dry_run):
    _, plan = dry_run
    row = next(r for r in plan["cases"] if r["section"] == "baseline" and r["label"] == "sdpa-flash"
               and (r["n"], r["d"]) == (16384, 128))
    b, h, n, d = 4, 16, 16384, 128
    fwd = 2 * 2 * b * h * n * n * d / 2  # QK^T and PV, 2 flops per multiply-add, half of them causal
    assert row["floors"]["fwd"]["flops"] == fwd
    assert row["floors"]["fwd_bwd"]["flops"] == fwd + 2 * fwd  # four backward products
    assert row["floors"]["fwd"]["bytes"] == 4 * b * h * n * d * 2  # q, k, v read, o written, bf16
    assert row["floors"]["fwd_bwd"]["bytes"] == 12 * b * h * n * d * 2
    rates = plan["meta"]["rates"]
    assert rates["flops_per_s"] == 989e12
    want = 1e3 * max(fwd / rates["flops_per_s"], 4 * b * h * n * d * 2 / rates["bytes_per_s"])
    assert row["floors"]["fwd"]["floor_ms"] == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(4.446, abs=1e-3)  # compute-bound: 4.4 TFLOP at 989 TFLOP/s
    assert perf_cases.attention_flops(1, 1, 8, 4, causal=False) == 2 * perf_cases.attention_flops(1, 1, 8, 4)


def test_gpu_perf_refuses_an_unknown_argument():
    r = subprocess.run(["bash", str(SCRIPT), "--dryrun"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 2 and "--dryrun" in r.stderr


def _row(section, label, ran, n, d, ms, status="timed"):
    return {"section": section, "label": label, "ran": ran, "n": n, "d": d, "fwd_bwd_ms": ms, "status": status}


def test_recorded_times_become_proven_entries(tmp_path):
    rows = [_row("auto", "alibi", "triton", 4096, 128, 2.0), _row("triton", "alibi", "triton", 4096, 128, 2.0,
                                                                    "timed: the same path as auto's row"),
            _row("flex", "alibi", "flex", 4096, 128, 2.5), _row("auto", "rope", "sdpa", 4096, 128, 1.5),
            _row("triton", "rope", "triton", 4096, 64, 1.0),  # not the reference shape
            _row("auto", "cope", "sdpa", 4096, 128, 900.0, "timed once: 900 ms > --max-ms 400")]
    times = perf_report.path_times(rows)
    assert times == {("triton", "alibi"): 2.0, ("flex", "alibi"): 2.5, ("sdpa", "rope"): 1.5}
    record = tmp_path / "gpu-x-perf.json"
    record.write_text(json.dumps({"cases": rows}))
    table = gpu_proven.with_times([("triton", "alibi"), ("triton", "rope")], "r.md (GPU)", record)
    # flex/alibi was timed but its conformance tests did not prove it: no entry for a custom kernel
    assert table == {("triton", "alibi"): Proven("r.md (GPU)", 2.0), ("triton", "rope"): "r.md (GPU)",
                     ("sdpa", "rope"): Proven("r.md (GPU)", 1.5)}


def _host_timer(fn):
    """(median, lowest, highest) ms of three calls on the host clock: the CPU stand-in of `gpu_perf.bench`."""
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t))
    ts.sort()
    return ts[1], ts[0], ts[2]


def _small_cases():
    cases = perf_cases.plan(["nope", "rope", "cope"], lengths=(48, 96), head_dims=(16,))
    cases = [c for c in cases if c.section in ("baseline", "auto") and c.label != "sdpa-cudnn"]
    for c in cases:
        c.batch, c.heads = 1, 2
    return cases


@pytest.mark.parametrize("spent, want", [(0.0, "timed"), (40.0, "section"), (100.0, "budget")])
def test_the_run_stops_itself_within_its_budget(spent, want):
    """budget 100 s: baseline's share ends at 5 s, auto's at 30 s; ``spent`` of it gone before the first case."""
    cases, writes = _small_cases(), []
    a = argparse.Namespace(budget_s=100.0, max_ms=1e4, elapsed_s=spent)
    gpu_perf.run_all(cases, torch.device("cpu"), a, lambda: writes.append(1), timer=_host_timer)
    assert len(writes) == len(cases)  # the results are rewritten after every case
    for c in cases:
        if want == "timed":
            assert c.status.startswith("timed") and c.fwd_ms > 0 and c.fwd_bwd_ms > 0, (c.label, c.status)
        elif want == "section":
            assert c.status == f"skipped: section {c.section}'s share of the budget ran out" and c.fwd_ms is None
        else:
            assert c.status == "skipped: the 100 s budget ran out" and c.fwd_ms is None


def test_a_case_slower_than_max_ms_is_timed_once_and_not_at_the_longer_length():
    cases = [c for c in _small_cases() if c.section == "auto" and c.label == "cope"]
    assert [c.n for c in cases] == [48, 96]
    a = argparse.Namespace(budget_s=100.0, max_ms=1e-6, elapsed_s=0.0)
    gpu_perf.run_all(cases, torch.device("cpu"), a, lambda: None, timer=_host_timer)
    assert cases[0].status.startswith("timed once: ") and cases[0].fwd_bwd_ms > 0 and cases[0].fwd_ms is None
    assert cases[1].status.startswith("not timed: ") and "N=48" in cases[1].status and cases[1].fwd_bwd_ms is None
