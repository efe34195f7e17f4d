"""The (backend, encoding) pairs a recorded GPU run proved, as entries for `proven.PROVEN`.

Reads the JUnit report that benchmarks/gpu_check.sh keeps beside its results page and prints the
custom-kernel pairs (`proven.CUSTOM_KERNELS`) of tests/gpu/test_conformance_cuda.py that passed
in every case they ran (forward and backward, fp32 and bf16, every scenario) and failed
in none; a pair with any failure, or with a dtype or scenario it never passed, is left out.

    python benchmarks/gpu_proven.py benchmarks/results/gpu-<device>-<date>.junit.xml \\
        --record "benchmarks/results/gpu-<device>-<date>.md (<GPU name>)"
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TEST = "test_cuda_backend_equals_eager_reference"
DTYPES, SCENARIOS = {"fp32", "bf16"}, {"arange", "offset", "packed", "decode", "padding"}


def proven_pairs(junit: Path) -> list[tuple[str, str]]:
    """The pairs of custom kernel and encoding whose every conformance case in ``junit`` passed.

    Args:
        junit: a pytest ``--junitxml`` report of the GPU mode.

    Returns:
        Sorted (backend, encoding) pairs.
    """
    from posenc_lightning.attention.backends.proven import CUSTOM_KERNELS

    passed: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
    failed: set[tuple[str, str]] = set()
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        if not name.startswith(TEST + "["):
            continue
        encoding, backend, dtype, scenario = name[len(TEST) + 1:-1].split("-")
        if backend not in CUSTOM_KERNELS:
            continue
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            failed.add((backend, encoding))
        elif "skipped" not in outcome:
            passed[(backend, encoding)].add((dtype, scenario))
    return sorted(pair for pair, seen in passed.items() if pair not in failed
                  and {d for d, _ in seen} == DTYPES and {s for _, s in seen} == SCENARIOS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit", type=Path, help="the run's JUnit report (gpu-<device>-<date>.junit.xml)")
    p.add_argument("--record", default="<results page> (<GPU>)",
                   help="what each entry records: the results page and the GPU it ran on")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    pairs = proven_pairs(a.junit)
    print("PROVEN: dict[tuple[str, str], str] = {")
    for backend, encoding in pairs:
        print(f"    ({backend!r}, {encoding!r}): {a.record!r},")
    print("}")
    print(f"# {len(pairs)} pairs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
