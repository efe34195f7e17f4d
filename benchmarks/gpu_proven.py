"""The (backend, encoding) pairs a recorded GPU run proved, as entries for `proven_on_gpu.PROVEN`.

Reads the JUnit report that benchmarks/gpu_check.sh keeps beside its results page and prints the
custom-kernel pairs (`proven.CUSTOM_KERNELS`) of tests/gpu/test_conformance_cuda.py that passed
in every case they ran (forward and backward, fp32 and bf16, every scenario) and failed
in none; a pair with any failure, with a case the report lacks (a suite cut at its deadline), or
with a dtype or scenario it never passed, is left out.

    python benchmarks/gpu_proven.py benchmarks/results/gpu-<device>-<date>.junit.xml [<rerun>.junit.xml] \\
        --record "benchmarks/results/gpu-<device>-<date>.md (<GPU name>)" \\
        [--times benchmarks/results/gpu-<device>-<date>-perf.json]

``--times``: the JSON of benchmarks/gpu_perf.sh on the same GPU; each proven pair then carries its
forward+backward time at `proven_on_gpu.REFERENCE_CASE` (`proven_on_gpu.Proven`), and the paths that
need no proof (sdpa, blockwise) get entries with their times, so that ``auto`` takes the fastest.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TEST = "test_cuda_backend_equals_eager_reference"
DTYPES, SCENARIOS = {"fp32", "bf16"}, {"arange", "offset", "packed", "decode", "padding"}


def proven_pairs(*junits: Path) -> list[tuple[str, str]]:
    """The pairs of custom kernel and encoding whose every conformance case passed.

    Args:
        *junits: pytest ``--junitxml`` reports of the GPU mode, in the order they ran: a case's
            last outcome counts (``benchmarks/gpu_suite.py --rerun`` runs what an earlier one
            lacked or failed).

    Returns:
        Sorted (backend, encoding) pairs.
    """
    from posenc_lightning.attention.backends.proven import CUSTOM_KERNELS

    outcomes: dict[tuple[str, str, str, str], str] = {}
    for junit in junits:
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = case.get("name", "")
            if not name.startswith(TEST + "["):
                continue
            encoding, backend, dtype, scenario = name[len(TEST) + 1:-1].split("-")
            if backend in CUSTOM_KERNELS:
                tags = {child.tag for child in case}
                outcomes[(backend, encoding, dtype, scenario)] = (
                    "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed")
    ran: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
    passed: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
    failed: set[tuple[str, str]] = set()
    for (backend, encoding, dtype, scenario), outcome in outcomes.items():
        ran[(backend, encoding)].add((dtype, scenario))
        if outcome == "failed":
            failed.add((backend, encoding))
        elif outcome == "passed":
            passed[(backend, encoding)].add((dtype, scenario))
    every_case = {(d, s) for d in DTYPES for s in SCENARIOS}
    return sorted(pair for pair, seen in passed.items() if pair not in failed and ran[pair] == every_case
                  and {d for d, _ in seen} == DTYPES and {s for _, s in seen} == SCENARIOS)


def with_times(pairs: list[tuple[str, str]], record: str, times_json: Path | None) -> dict[tuple[str, str], object]:
    """`PROVEN`'s entries: the proven ``pairs`` with their times from ``times_json`` where it has
    them, and the timed paths that need no proof (not in `proven.CUSTOM_KERNELS`).

    Args:
        pairs: (backend, encoding) pairs the conformance tests proved (`proven_pairs`).
        record: the results page and GPU the entries name.
        times_json: benchmarks/gpu_perf.py's JSON (its ``cases``), or None.

    Returns:
        (backend, encoding) -> ``record``, or `proven_on_gpu.Proven` ``(record, ms)`` where timed.
    """
    from benchmarks.perf_report import path_times
    from posenc_lightning.attention.backends.proven import CUSTOM_KERNELS
    from posenc_lightning.encodings.proven_on_gpu import Proven

    times = path_times(json.loads(times_json.read_text())["cases"]) if times_json is not None else {}
    table: dict[tuple[str, str], object] = {p: Proven(record, times[p]) if p in times else record for p in pairs}
    for (backend, encoding), ms in sorted(times.items()):
        if backend not in CUSTOM_KERNELS:
            table[(backend, encoding)] = Proven(record, ms)
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit", type=Path, nargs="+",
                   help="the run's JUnit reports (gpu-<device>-<date>.junit.xml), a rerun's after the first")
    p.add_argument("--times", type=Path, default=None,
                   help="benchmarks/gpu_perf.py's JSON of the same GPU: entries carry their measured ms")
    p.add_argument("--record", default="<results page> (<GPU>)",
                   help="what each entry records: the results page and the GPU it ran on")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    pairs = proven_pairs(*a.junit)
    table = with_times(pairs, a.record, a.times)
    print("PROVEN: dict[tuple[str, str], str | Proven] = {")
    for (backend, encoding), entry in sorted(table.items()):
        value = repr(entry) if isinstance(entry, str) else f"Proven({entry.record!r}, {entry.ms:.3f})"
        print(f"    ({backend!r}, {encoding!r}): {value},")
    print("}")
    print(f"# {len(pairs)} proven pairs, {len(table) - len(pairs)} timed paths that need no proof", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
