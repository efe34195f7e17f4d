"""GPU speed of every encoding and backend against SDPA's own kernels, with floors (issue 45).

Runs the cases of `benchmarks/perf_cases.py` (baselines; every registered encoding through ``auto``,
``triton`` and ``flex`` at N 4096 and 16384, head dims 64 and 128, B 4, 16 heads, bf16, causal;
the ablations) on one CUDA GPU and writes ``gpu-<device>-<date>-perf.md`` and ``.json`` into
``--out-dir``, rewritten after every case, so a run cut short keeps what it timed.

Timing (/work/.library/device/METHOD.md): ``triton.testing.do_bench``: a warm-up, then repetitions
timed by CUDA events with the L2 cache flushed before each; the median and the 20th/80th
percentiles. The first forward+backward (compilation included) is timed apart on the host clock.
Floors: the matrix rate and the copy bandwidth are measured first on the device (a bf16 GEMM of
8192^3, a 1 GiB device copy counting bytes read and written); a case's floor is the larger of its
FLOPs over the one and its bytes over the other (`perf_cases.attention_flops`, `attention_bytes`).

Budget: each section has a share of ``--budget-s`` (`perf_cases.SECTIONS`, unused time passes on);
a case is not started past its section's share or when the time left is less than its expected
first call, and says so; a case slower than ``--max-ms`` (forward+backward, one call) is timed once
and not at the longer length. benchmarks/gpu_perf.sh adds a hard limit.

``--dry-run`` (no GPU needed): builds every case at tiny sizes on the CPU, runs each once where the
CPU can (Triton cases only under ``TRITON_INTERPRET=1``, flex forward only) or validates it, and
prints the plan with an estimate of the device time.

    python benchmarks/gpu_perf.py [--dry-run] [--budget-s 450] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch

from benchmarks.perf_cases import SECTIONS, Case, NeedsCuda, Unsupported, build, plan

#: the dry run's rates: an H100 SXM's datasheet (bf16 dense tensor cores, HBM3); a device run measures its own
NOMINAL = {"flops_per_s": 989e12, "bytes_per_s": 3.35e12, "source": "nominal (H100 SXM datasheet)"}
#: seconds a case's first call is expected to take (compilation) by section, for the estimate and the
#: start guard: flex compiles a forward and a backward per encoding, Triton a kernel per flag set
FIRST_CALL_S = {"baseline": 1.0, "auto": 3.0, "ablation": 4.0, "triton": 6.0, "flex": 30.0}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(fn: Callable[[], object]) -> tuple[float, float, float]:
    """(median, 20th, 80th percentile) ms of ``fn`` by ``do_bench`` (CUDA events, L2 flushed)."""
    from triton.testing import do_bench

    med, lo, hi = do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
    return med, lo, hi


def measure_ceilings(device: torch.device) -> dict:
    """The device's bf16 GEMM rate and copy bandwidth, measured (METHOD.md: "two numbers first")."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    gemm_ms = bench(lambda: a @ b)[0]
    src = torch.randn(2**28, device=device, dtype=torch.bfloat16)  # 512 MiB, read and written: 1 GiB moved
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))[0]
    return {"flops_per_s": 2 * 8192**3 / (gemm_ms * 1e-3), "bytes_per_s": 2 * src.numel() * 2 / (copy_ms * 1e-3),
            "source": f"measured: bf16 GEMM 8192^3 {gemm_ms:.3f} ms, copy of 512 MiB {copy_ms:.3f} ms"}


def kernel_names(fn: Callable[[], object], device: torch.device) -> list[str]:
    """The attention kernels (CUDA) or operators (CPU) one call of ``fn`` runs, by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    want = re.compile(r"flash|fmha|cudnn|attention|sdpa|efficient", re.IGNORECASE)
    names = []
    for e in prof.events():
        on_device = str(getattr(e, "device_type", "")).endswith("CUDA")
        if want.search(e.name) and (on_device or device.type != "cuda") and e.name[:90] not in names:
            names.append(e.name[:90])
    return names[:4]


def _slow_key(c: Case) -> tuple:
    return c.section, c.label, c.backend, c.variant, c.d, c.batch


def run_case(case: Case, device: torch.device, a: argparse.Namespace, memo: dict, too_slow: dict,
             timer: Callable[[Callable[[], object]], tuple[float, float, float]] = bench) -> None:
    """Time ``case`` on the device with ``timer`` (`bench`); fills its times and status."""
    if _slow_key(case) in too_slow:
        case.status = too_slow[_slow_key(case)]
        return
    try:
        runner = build(case, device)
    except Unsupported as e:
        case.status = f"unsupported: {e}"
        return
    except Exception as e:  # noqa: BLE001 - a case that cannot be built is reported, the others still run
        case.status = f"error: building it: {type(e).__name__}: {e}"[:300]
        return
    case.ran = runner.ran
    same = memo.get((case.label, case.ran, case.n, case.d)) if case.section in ("auto", "triton", "flex") else None
    if same is not None and same.fwd_bwd_ms is not None:
        case.fwd_ms, case.fwd_bwd_ms, case.spread = same.fwd_ms, same.fwd_bwd_ms, same.spread
        case.status = f"timed: the same path as {same.section}'s row"
        return
    try:
        t = time.perf_counter()
        runner.fwd_bwd()
        sync(device)
        case.first_s = time.perf_counter() - t
        t = time.perf_counter()
        runner.fwd_bwd()
        sync(device)
        once = 1e3 * (time.perf_counter() - t)
        if once > a.max_ms:
            case.fwd_bwd_ms = once
            case.status = f"timed once: {once:.0f} ms > --max-ms {a.max_ms:g}"
            too_slow[_slow_key(case)] = f"not timed: {once:.0f} ms fwd+bwd at N={case.n} (> --max-ms {a.max_ms:g})"
        else:
            med, lo, hi = timer(runner.fwd)
            case.fwd_ms, case.spread["fwd"] = med, (lo, hi)
            med, lo, hi = timer(runner.fwd_bwd)
            case.fwd_bwd_ms, case.spread["fwd_bwd"] = med, (lo, hi)
            case.status = "timed"
        if case.section == "baseline":
            case.note = "; ".join(kernel_names(runner.fwd, device))
        if case.section in ("auto", "triton", "flex"):
            memo[(case.label, case.ran, case.n, case.d)] = case
    except torch.cuda.OutOfMemoryError:
        case.status = "out of memory"
        too_slow[_slow_key(case)] = f"not timed: out of memory at N={case.n}"
    except RuntimeError as e:
        # SDPA refusing a forced kernel on this device/build (cuDNN attention absent) is no failure of ours
        word = "unsupported" if "No available kernel" in str(e) else "error"
        case.status = f"{word}: {type(e).__name__}: {e}"[:300]
    except Exception as e:  # noqa: BLE001 - a failing case is reported, the others still run
        case.status = f"error: {type(e).__name__}: {e}"[:300]
    finally:
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()


def dry_case(case: Case, interpret: bool) -> None:
    """Build ``case`` at tiny sizes on the CPU and run it once where the CPU can."""
    cpu = torch.device("cpu")
    try:
        runner = build(case, cpu, tiny=True)
    except NeedsCuda as e:
        case.status = f"ok: validated, inputs built ({e})"
        return
    except Unsupported as e:
        case.status = f"unsupported: {e}"
        return
    except Exception as e:  # noqa: BLE001 - reported in the plan; the dry run then fails
        case.status = f"error: {type(e).__name__}: {e}"[:300]
        return
    case.ran = runner.ran
    if case.backend == "triton" and not interpret:
        case.status = "ok: validated (the Triton kernels run on CUDA, here only with TRITON_INTERPRET=1)"
        return
    try:
        runner.fwd_bwd()
        case.status = "ok: ran fwd+bwd on CPU"
    except ValueError as e:
        if "backward" not in str(e):
            case.status = f"error: {type(e).__name__}: {e}"[:300]
            return
        runner.fwd()
        case.status = "ok: ran fwd on CPU (no CPU backward)"
    except Exception as e:  # noqa: BLE001
        case.status = f"error: {type(e).__name__}: {e}"[:300]


def estimate_s(case: Case, rates: dict, first_seen: set) -> float:
    """A rough device time of ``case``, taking 3 x its floor per call: the first call
    (`FIRST_CALL_S`, once per section, label and head dim; 0.5 s after), a second call, and per mode
    ``do_bench``'s 125 ms of warm-up and repetitions, or its 7 calls at least."""
    key = (case.section, case.label, case.backend, case.d)
    first = FIRST_CALL_S[case.section] if key not in first_seen else 0.5
    first_seen.add(key)
    fl = case.floors(rates["flops_per_s"], rates["bytes_per_s"])
    call = {m: 3 * fl[m]["floor_ms"] / 1e3 for m in ("fwd", "fwd_bwd")}
    return first + call["fwd_bwd"] + sum(max(0.125, 7 * t) for t in call.values())


def section_deadlines(t0: float, budget: float) -> dict[str, float]:
    out, cum = {}, 0.0
    for name, share in SECTIONS:
        cum += share
        out[name] = t0 + cum * budget
    return out


def run_all(cases: list[Case], device: torch.device, a: argparse.Namespace, write: Callable[[], None],
            timer: Callable[[Callable[[], object]], tuple[float, float, float]] = bench) -> None:
    """Run ``cases`` in order within ``a.budget_s`` (``a.elapsed_s`` of it already spent), calling
    ``write`` after each; what the budget leaves out is marked skipped with the reason."""
    t0 = time.monotonic() - a.elapsed_s
    deadlines, memo, too_slow = section_deadlines(t0, a.budget_s), {}, {}
    for case in cases:
        now = time.monotonic()
        left = t0 + a.budget_s - now
        first = FIRST_CALL_S[case.section]
        if left <= 0:
            case.status = f"skipped: the {a.budget_s:.0f} s budget ran out"
        elif now > deadlines[case.section]:
            case.status = f"skipped: section {case.section}'s share of the budget ran out"
        elif left < first:
            case.status = f"skipped: {left:.0f} s left, its first call may take {first:.0f} s"
        else:
            run_case(case, device, a, memo, too_slow, timer)
        print(f"{time.monotonic() - t0:6.1f}s {case.section:8s} {case.label:16s} {case.backend:8s} N={case.n:<6d} "
              f"D={case.d:<4d} {case.variant:30s} {case.status[:60]} {case.fwd_bwd_ms or ''}", flush=True)
        write()


def device_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100-80gb-hbm3`` (benchmarks/gpu_check.sh's rule)."""
    s = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", ""))
    return s.strip("-") or "no-cuda"


def meta(a: argparse.Namespace, device: torch.device, rates: dict) -> dict:
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = "unknown"
    sdpa = {k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")() for k in ("flash", "mem_efficient", "math", "cudnn")
            if hasattr(torch.backends.cuda, f"{k}_sdp_enabled")}
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
            "command": "benchmarks/gpu_perf.py " + " ".join(a.argv),
            "versions": f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}",
            "budget_s": a.budget_s, "max_ms": a.max_ms, "sdpa_backends_enabled": sdpa, "rates": rates}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.perf_report import render, write_results
    from posenc_lightning.encodings.registry import available_encodings

    a = parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    a.elapsed_s = 0.0
    names = a.encodings or available_encodings()
    cases = plan(names)
    if a.dry_run:
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        for case in cases:
            dry_case(case, interpret)
        seen: set = set()
        total = sum(estimate_s(c, NOMINAL, seen) for c in cases)
        info = meta(a, torch.device("cpu"), NOMINAL)
        print(render(cases, info, dry=True))
        by_section = {name: 0.0 for name, _ in SECTIONS}
        seen = set()
        for c in cases:
            by_section[c.section] += estimate_s(c, NOMINAL, seen)
        print(f"plan: {len(cases)} cases; estimated device time {total:.0f} s at nominal H100 rates "
              f"({', '.join(f'{k} {v:.0f} s' for k, v in by_section.items())}); budget {a.budget_s:.0f} s: "
              f"a section past its share, and every case past the budget, is skipped and listed as such")
        if a.json:
            a.json.write_text(json.dumps({"meta": info, "estimate_s": total,
                                          "cases": [_row(c, NOMINAL) for c in cases]}, indent=1))
        return 1 if any(c.status.startswith("error") for c in cases) else 0
    if not torch.cuda.is_available():
        print("gpu_perf needs a CUDA GPU (or --dry-run); none here", file=sys.stderr)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)
    device = torch.device("cuda")
    t0 = time.monotonic()
    rates = measure_ceilings(device)
    info = meta(a, device, rates)
    a.elapsed_s = time.monotonic() - t0
    base = a.out_dir / f"gpu-{device_slug(info['device'])}-{time.strftime('%Y%m%d-%H%M', time.gmtime())}-perf"
    a.out_dir.mkdir(parents=True, exist_ok=True)
    run_all(cases, device, a, lambda: write_results(base, cases, info, [_row(c, rates) for c in cases]))
    print(render(cases, info))
    print(f"wrote {base}.md and {base}.json")
    return 1 if any(c.status.startswith("error") for c in cases) else 0


def _row(c: Case, rates: dict) -> dict:
    return {**dataclasses.asdict(c), "floors": c.floors(rates["flops_per_s"], rates["bytes_per_s"])}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="the plan at tiny sizes on the CPU; no GPU needed")
    p.add_argument("--budget-s", type=float, default=450.0, help="no case starts past this many seconds")
    p.add_argument("--max-ms", type=float, default=400.0, help="fwd+bwd ms of one call above which a case is timed once")
    p.add_argument("--encodings", nargs="+", default=None, help="default: every registered encoding")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--json", type=Path, default=None, help="--dry-run: write the plan here as JSON")
    a = p.parse_args(argv)
    if a.budget_s <= 0 or a.max_ms <= 0:
        p.error("--budget-s and --max-ms must be positive")
    return a


if __name__ == "__main__":
    sys.exit(main())
