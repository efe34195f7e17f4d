"""The suite's GPU mode in shards run side by side: ``python -m pytest -m gpu tests`` once per
shard (``POSENC_GPU_SHARD=i/n``, tests/gpu/conftest.py), so the Triton and inductor compilations
of a cold cache spread over the CPU cores while the tests share the one GPU. Merges the shards'
JUnit reports into one (the input of benchmarks/gpu_proven.py) and prints each shard's summary.
Past ``--deadline-s`` the shards are interrupted (pytest still reports what ran) and it fails.
``--rerun REPORT`` runs only the tests that an earlier report lacks or failed (a lease's device
time is short: a second run picks up where the first was cut off).

    python benchmarks/gpu_suite.py --shards 6 --deadline-s 240 --junit gpu.junit.xml
    python benchmarks/gpu_suite.py --rerun gpu.junit.xml --junit gpu-rerun.junit.xml -- -k "not slow"
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def merge_junit(parts: list[Path], out: Path) -> dict[str, int]:
    """One ``<testsuites>`` of every shard's suites, written to ``out``; the totals it holds."""
    merged = ET.Element("testsuites")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for p in parts:
        if not p.is_file():
            continue
        root = ET.parse(p).getroot()
        for suite in [root] if root.tag == "testsuite" else list(root):
            merged.append(suite)
            for k in totals:
                totals[k] += int(suite.get(k, 0))
    merged.attrib.update({k: str(v) for k, v in totals.items()})
    ET.ElementTree(merged).write(out, encoding="utf-8", xml_declaration=True)
    return totals


def node_id(case: ET.Element) -> str:
    """A JUnit ``<testcase>``'s pytest node id (``tests/gpu/x.py::test[param]``)."""
    return f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name', '')}"


def left_by(report: Path, ids: list[str]) -> list[str]:
    """The node ids of ``ids`` that ``report`` lacks or holds as failed (or as an error).

    Args:
        report: a JUnit report of an earlier run (this script's ``--junit``).
        ids: the node ids to run, in collection order.

    Returns:
        The ids to run again, in the same order.
    """
    done = {node_id(c) for c in ET.parse(report).getroot().iter("testcase")
            if not {child.tag for child in c} & {"failure", "error"}}
    return [i for i in ids if i not in done]


def collected(tests: str, pytest_args: list[str]) -> list[str]:
    """The node ids of the GPU tests under ``tests`` (``pytest --collect-only``)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-o", "addopts=", "-q", "-m", "gpu", tests,
                        "-p", "no:cacheprovider", *pytest_args], cwd=ROOT, capture_output=True, text=True, check=False)
    return [ln.strip() for ln in r.stdout.splitlines() if "::" in ln]


def run_shards(a: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="gpu-suite-"))
    targets = [a.tests]
    if a.rerun is not None:
        targets = left_by(a.rerun, collected(a.tests, a.pytest_args))
        print(f"-- rerun: {len(targets)} tests that {a.rerun} lacks or failed")
        if not targets:
            return 0
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = []
    for i in range(a.shards):
        env_i = {**env, "POSENC_GPU_SHARD": f"{i}/{a.shards}"}
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *targets, "-q", "-rfE", "-p", "no:cacheprovider",
               f"--junitxml={tmp / f'shard-{i}.xml'}", *a.pytest_args]
        log = open(tmp / f"shard-{i}.log", "w")  # noqa: SIM115 - closed after the shard ends
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env_i, stdout=log, stderr=subprocess.STDOUT), log))
    deadline, timed_out = time.monotonic() + a.deadline_s, False
    for p, _ in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:  # interrupt: pytest writes its summary and JUnit report for what ran
        for p, _ in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p, _ in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    rc = 0
    for i, (p, log) in enumerate(procs):
        log.close()
        lines = (tmp / f"shard-{i}.log").read_text(errors="replace").splitlines()
        summary = [ln for ln in lines if ln.startswith(("FAILED", "ERROR")) or " passed" in ln or " failed" in ln
                   or " skipped" in ln or "Interrupted" in ln]
        print(f"-- shard {i}/{a.shards}: exit {p.returncode}")
        print("\n".join(summary or lines[-30:]))
        rc = rc or p.returncode not in (0, 5)  # 5: a shard that drew no test
    totals = merge_junit([tmp / f"shard-{i}.xml" for i in range(a.shards)], a.junit)
    print(f"-- GPU suite: {totals['tests']} tests, {totals['failures']} failed, {totals['errors']} errors, "
          f"{totals['skipped']} skipped{' (interrupted at the deadline)' if timed_out else ''}; {a.junit}")
    return 1 if rc or timed_out or totals["tests"] == 0 else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=6, help="pytest processes side by side")
    p.add_argument("--deadline-s", type=float, default=240.0, help="interrupt the shards after this many seconds")
    p.add_argument("--junit", type=Path, required=True, help="the merged JUnit report")
    p.add_argument("--tests", default="tests", help="the test path handed to pytest")
    p.add_argument("--rerun", type=Path, default=None,
                   help="an earlier JUnit report: run only the tests it lacks or failed")
    p.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    a = p.parse_args(argv)
    if a.shards < 1:
        p.error("--shards must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    return run_shards(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
