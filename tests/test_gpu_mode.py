"""The GPU mode of the suite and its one command, checked where there is no GPU (issue 28):
the GPU tests are collected and skipped with their reason, the mark expression that turns the
Triton interpreter off, ``benchmarks/gpu_check.sh --dry-run``, every Python step it lists parses
its arguments here, and `gpu_proven` reads a JUnit report into `proven_on_gpu.PROVEN` entries."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from posenc_lightning.encodings.registry import available_encodings
from tests.conftest import gpu_mode

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
#: the conformance matrix on CUDA: every registered encoding x 4 backends x 2 dtypes x 5 scenarios
N_CONFORMANCE = len(available_encodings()) * 4 * 2 * 5


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the GPU tests run instead")
def test_the_gpu_tests_are_collected_in_shards_and_skipped_with_their_reason_on_cpu(tmp_path):
    """benchmarks/gpu_suite.py as gpu_check.sh runs it, in two shards over tests/gpu: every GPU
    test lands in exactly one shard, and each is skipped with the reason."""
    junit = tmp_path / "gpu.xml"
    r = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--shards", "2", "--tests", "tests/gpu",
                        "--junit", str(junit)], check=False, cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"^-- GPU suite: (\d+) tests, 0 failed, 0 errors, \1 skipped;", r.stdout, re.MULTILINE), r.stdout
    suites = ET.parse(junit).getroot().findall("testsuite")
    cases = [(s, c) for s in suites for c in s.iter("testcase")]
    assert len(suites) == 2 and all(int(s.get("tests")) for s in suites)
    names = [(c.get("classname"), c.get("name")) for _, c in cases]
    assert len(names) == len(set(names))
    files = {cls.rsplit(".", 1)[-1] for cls, _ in names}
    assert files == {f"test_{m}_cuda" for m in ("conformance", "kernels", "compile", "trainer", "auto_plan")}
    conformance = [n for cls, n in names if cls.endswith("test_conformance_cuda")]
    assert len(conformance) == N_CONFORMANCE
    reasons = {c.find("skipped").get("message") for _, c in cases}
    assert reasons == {"no CUDA device: the GPU mode runs on a GPU machine (python -m pytest -m gpu tests)"}


def test_only_a_gpu_only_mark_expression_on_cuda_turns_the_interpreter_off():
    assert gpu_mode("gpu", cuda=True) and gpu_mode("gpu and not slow", cuda=True) and gpu_mode("(gpu)", cuda=True)
    assert not gpu_mode("gpu", cuda=False)
    for expr in ("", "not gpu", "slow", "gpu or slow", "slow and not gpu"):
        assert not gpu_mode(expr, cuda=True), expr
    assert os.environ.get("TRITON_INTERPRET") == "1"  # this (CPU) session


def _dry_run() -> str:
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run"], check=False, cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_gpu_check_dry_run_lists_its_steps_within_eight_minutes_and_every_python_step_parses():
    out = _dry_run()
    assert re.search(r"would write: benchmarks/results/gpu-[a-z0-9-]+-\d{8}-\d{4}\.md$", out, re.MULTILINE), out
    steps = re.findall(r"^step (\S+) \(limit (\d+)s\): (.*)$", out, re.MULTILINE)
    assert [s[0] for s in steps] == ["suite", "bench_triton", "overhead"], out
    assert sum(int(s[1]) for s in steps) <= 8 * 60
    for _, _, cmd in steps:
        argv = shlex.split(cmd)
        script = Path(argv[1])
        assert (ROOT / script).is_file(), script
        mod = importlib.import_module(f"benchmarks.{script.stem}")
        mod.parse_args(argv[2:])  # argparse exits on an unknown or malformed argument


def test_gpu_check_refuses_an_unknown_argument():
    r = subprocess.run(["bash", str(SCRIPT), "--dryrun"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--dryrun" in r.stderr


def test_gpu_proven_takes_only_pairs_that_passed_every_case(tmp_path):
    from benchmarks.gpu_proven import main, proven_pairs

    def case(enc, backend, dtype, scenario, outcome=""):
        name = f"test_cuda_backend_equals_eager_reference[{enc}-{backend}-{dtype}-{scenario}]"
        return f'<testcase classname="tests.gpu.test_conformance_cuda" name="{name}">{outcome}</testcase>'

    scenarios = ("arange", "offset", "packed", "decode", "padding")
    full = lambda enc, backend: [case(enc, backend, d, s) for d in ("fp32", "bf16") for s in scenarios]
    cases = (full("rope", "triton") + full("alibi", "flex") + full("alibi", "sdpa")
             + full("fire", "triton") + [case("fire", "triton", "bf16", "decode", '<failure message="x"/>')]
             + full("fox", "triton")[:-1]  # never passed padding in bf16: ...
             + [case("fox", "triton", "bf16", "padding", '<skipped message="x"/>')]  # ... but fp32 did
             + [case("cope", "triton", d, s, '<skipped message="refused"/>') for d in ("fp32", "bf16") for s in scenarios]
             + full("sba", "triton")[:-1])  # its last case never ran: the suite was cut at its deadline
    junit = tmp_path / "r.xml"
    junit.write_text(f'<testsuites><testsuite name="pytest">{"".join(cases)}</testsuite></testsuites>')
    assert proven_pairs(junit) == [("flex", "alibi"), ("triton", "fox"), ("triton", "rope")]
    assert main([str(junit), "--record", "benchmarks/results/x.md (H100)"]) == 0


def _report(path: Path, cases: list[tuple[str, str]]) -> Path:
    """A JUnit report of ``(test name, outcome element)`` cases of the conformance module."""
    body = "".join(f'<testcase classname="tests.gpu.test_conformance_cuda" name="{n}">{o}</testcase>' for n, o in cases)
    path.write_text(f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return path


def test_a_rerun_report_completes_the_first_and_its_outcomes_count(tmp_path):
    from benchmarks.gpu_proven import proven_pairs

    scenarios = ("arange", "offset", "packed", "decode", "padding")
    name = "test_cuda_backend_equals_eager_reference[{}-{}-{}-{}]".format
    full = lambda enc, backend: [(name(enc, backend, d, s), "") for d in ("fp32", "bf16") for s in scenarios]
    fail = '<failure message="x"/>'
    first = _report(tmp_path / "a.xml", full("rope", "triton")[:4] + full("alibi", "flex")
                    + [(name("fox", "flex", "fp32", "arange"), fail)] + full("fox", "flex")[1:])
    assert proven_pairs(first) == [("flex", "alibi")]  # rope was cut short, fox failed once
    rerun = _report(tmp_path / "b.xml", full("rope", "triton")[4:] + [(name("fox", "flex", "fp32", "arange"), "")]
                    + [(name("alibi", "flex", "bf16", "decode"), fail)])
    assert proven_pairs(first, rerun) == [("flex", "fox"), ("triton", "rope")]  # the last outcome counts


def test_gpu_suite_reruns_the_tests_a_report_lacks_or_failed(tmp_path):
    from benchmarks.gpu_suite import left_by

    report = _report(tmp_path / "r.xml", [("t[a]", ""), ("t[b]", '<failure message="x"/>'),
                                          ("t[c]", '<skipped message="x"/>'), ("t[d]", '<error message="x"/>')])
    ids = [f"tests/gpu/test_conformance_cuda.py::t[{x}]" for x in "abcde"]
    assert left_by(report, ids) == [ids[1], ids[3], ids[4]]


def test_the_gpu_benchmarks_build_every_case_and_report_the_issue_bars(monkeypatch):
    """Their cases run here at a small size (forward and backward; the Triton ones under the
    interpreter), and the report flags the bars: fused kernels within 1.2x flash SDPA at 4k and
    16k, FIRE's forward overhead vs nope against the seed guide's 4.1%."""
    from benchmarks import bench_triton, gpu_overhead
    from tests.helpers import fast_triton_interpreter

    fast_triton_interpreter(monkeypatch)
    names = [name for name, fn in bench_triton.cases(1, 2, 20, 16, torch.float32, dev="cpu")
             if fn().sum().backward() is None]
    assert names == ["sdpa", "sdpa+rope", "triton:nope", "triton:rope", "triton:alibi", "triton:fox", "triton:sba"]
    a = gpu_overhead.parse_args(["--dtype", "float32", "--heads", "2", "--head-dim", "16"])
    ran = []
    for label, backend, chosen, fn in gpu_overhead.cases(["nope", "rope", "fire", "sba", "sinusoidal"],
                                                         a.backends, a, 20, device="cpu"):
        if label != "sdpa-flash":  # the flash kernel is CUDA's
            fn().backward(gpu_overhead.GRAD[0])
        ran.append((label, backend, chosen))
    assert ran == [("sdpa-flash", "nope", "flash"), ("nope", "auto", "sdpa"), ("rope", "auto", "sdpa"),
                   ("rope", "triton", "triton"), ("fire", "auto", "sdpa"), ("fire", "triton", "triton"),
                   ("sba", "auto", "blockwise"), ("sba", "triton", "triton"), ("sinusoidal", "auto", "sdpa")]
    rows = [{"n": 4096, "encoding": "sdpa-flash", "backend": "nope", "ran": "flash", "fwd": 1.0, "fwd_bwd": 3.0},
            {"n": 4096, "encoding": "nope", "backend": "auto", "ran": "sdpa", "fwd": 1.0, "fwd_bwd": 3.0},
            {"n": 4096, "encoding": "fire", "backend": "auto", "ran": "sdpa", "fwd": 1.5, "fwd_bwd": 6.0},
            {"n": 4096, "encoding": "fire", "backend": "triton", "ran": "triton", "fwd": 1.04, "fwd_bwd": 3.3},
            {"n": 4096, "encoding": "sba", "backend": "triton", "ran": "triton", "note": "out of memory"}]
    text = gpu_overhead.render(rows, a, "a GPU")
    assert "| 4096 | fire triton fwd+bwd x flash | 1.10 | 1.2 | yes |" in text
    assert "| 4096 | fire auto (sdpa) fwd vs nope | +50.0% | 4.1% | no |" in text
    assert "| 4096 | fire triton (triton) fwd vs nope | +4.0% | 4.1% | yes |" in text
    assert "| 4096 | sba triton fwd+bwd x flash | - | 1.2 | - |" in text
    assert "| 4096 | sba | triton | triton | out of memory |" in text
