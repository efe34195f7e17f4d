"""``posenc train`` with a misspelt encoding or encoding argument fails at parse time (issue 46):
one line on stderr, exit status 2, nothing written, before Lightning is imported.

How the time is bounded: the check imports the encoding registry (torch) and nothing of Lightning,
so the process costs a bare ``import posenc_lightning.encodings`` plus the check itself. The test
times that import in its own process as the baseline and asserts the failing command takes less
than 2 s beyond it (measured: within 0.2 s of it on a shared 2-core machine, 1.6-2.0 s in all;
before the check the typo failed 9 s in, inside the Trainer, after creating ``runs/firee/version_0``);
it also asserts, in process, that Lightning was never imported."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _timed(cmd: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=120, check=False)
    return out, time.perf_counter() - start


def _train(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    return _timed([sys.executable, "-m", "posenc_lightning.cli", "train", *args], cwd)


@pytest.mark.parametrize("args, message", [
    (["--posenc.encoding=firee"], "--posenc.encoding: Unknown encoding 'firee'. Did you mean 'fire'"),
    (["--encoding", "firee"], "--posenc.encoding: Unknown encoding 'firee'. Did you mean 'fire'"),
    (["--posenc.encoding=fire", "--posenc.config={init_LL: 64}"],
     "--posenc.config: fire takes no argument 'init_LL'. Did you mean 'init_L'"),
])
def test_typo_fails_at_parse_time_in_one_line_writing_nothing(tmp_path, args, message):
    out, seconds = _train(*args, "--trainer.max_steps=1", cwd=tmp_path)
    _, baseline = _timed([sys.executable, "-c", "import posenc_lightning.encodings"], tmp_path)
    print(f"typo exit: {seconds:.2f} s; python + import posenc_lightning.encodings: {baseline:.2f} s")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"posenc train: error: {message}"), out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no runs/firee/version_0
    assert seconds - baseline < 2.0


def test_typo_in_a_config_file_fails_the_same_way(tmp_path):
    (tmp_path / "job.yaml").write_text("posenc:\n  encoding: fire\n  config:\n    init_LL: 64\n")
    out, _ = _train("--config", "job.yaml", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "fire takes no argument 'init_LL'. Did you mean 'init_L'" in out.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["job.yaml"]


def test_the_check_runs_before_lightning_is_imported(tmp_path):
    code = ("import sys\nfrom posenc_lightning.cli import main\n"
            "rc = main(['train', '--posenc.encoding=firee'])\n"
            "print(rc, sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))")
    out, _ = _timed([sys.executable, "-c", code], tmp_path)
    assert out.stdout.split("\n")[0] == "2 []", out.stdout + out.stderr


def test_a_correct_encoding_passes_the_check():
    from posenc_lightning.cli_checks import encoding_from_args, precheck_train

    assert precheck_train(["--posenc.encoding=fire", "--posenc.config={init_L: 64}"]) is None
    assert precheck_train([]) is None  # the default, rope
    assert precheck_train(["--posenc.encoding=posenc_lightning.encodings.rope.RoPE"]) is None  # a class path
    assert encoding_from_args(["--encoding=alibi", "--posenc.encoding", "nope"]) == ("nope", None)  # last wins
