"""ruff runs in CI: ``python -m ruff check .`` in the repository root finds nothing."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", ".", "--output-format", "concise", "--no-cache"],
                       check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ruff check . found problems (fix them, or `ruff check --fix`):\n{r.stdout}{r.stderr}"
