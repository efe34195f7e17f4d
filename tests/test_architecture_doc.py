"""docs/architecture.md names only files that exist (issue 46): every path in backticks is checked,
relative to ``posenc_lightning/`` unless it starts with a top-level folder of the repository (the
page's own convention); a bare file name must exist somewhere in the package or the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "posenc_lightning"
DOC = ROOT / "docs" / "architecture.md"
TOP = ("posenc_lightning/", "docs/", "tests/", "benchmarks/", "recipes/", "configs/", ".ci/")
#: a path-like token in backticks: folders with a slash, or a file with an extension the repo uses
PATH = re.compile(r"`([A-Za-z0-9_./<>-]+(?:/|\.(?:py|md|yaml|yml|sh|toml|txt)))`")


def named_paths(text: str) -> list[str]:
    """The path-like tokens of ``text`` (templates such as ``<name>.py`` left out)."""
    return sorted({m for m in PATH.findall(text) if "<" not in m and "*" not in m})


def missing(text: str) -> list[str]:
    out = []
    files = {p.name for p in ROOT.rglob("*") if ".git" not in p.parts}
    for p in named_paths(text):
        if "/" not in p.rstrip("/"):
            if p.rstrip("/") not in files:
                out.append(p)
            continue
        base = ROOT if p.startswith(TOP) else PKG
        if not (base / p).exists():
            out.append(p)
    return out


def test_the_check_finds_a_missing_path():
    assert missing("see `attention/pipeline.py`, `tests/test_kernel_names.py` and `gone.py`") == [
        "gone.py", "tests/test_kernel_names.py"]


def test_every_path_the_architecture_page_names_exists():
    assert missing(DOC.read_text()) == []
