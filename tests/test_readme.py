"""The README's Python snippets run as written (in order, one namespace, as a reader would paste
them), except those marked ``<!-- readme-test: skip (reason) -->`` on the line before the fence."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP = re.compile(r"<!-- readme-test: skip \((.+?)\) -->\s*$")


def snippets() -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason or None)`` of every ```python block."""
    lines = README.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            i += 1
            body = []
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            m = SKIP.search(lines[start - 1]) if start > 0 else None
            out.append((start + 1, "\n".join(body), m.group(1) if m else None))
        i += 1
    return out


def test_every_skip_names_its_reason_and_most_snippets_run():
    found = snippets()
    assert len(found) >= 4
    skipped = [s for s in found if s[2] is not None]
    assert all(len(reason) > 20 for _, _, reason in skipped)
    assert len(found) - len(skipped) >= 2  # the "Your own model" and curricula snippets run


def test_readme_python_snippets_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # anything a snippet writes stays in tmp
    ns: dict = {"__name__": "__readme__"}
    ran = 0
    for line, code, skip in snippets():
        if skip is not None:
            continue
        try:
            exec(compile(code, f"README.md:{line}", "exec"), ns)  # noqa: S102  the README snippets are the test
        except Exception as e:  # noqa: BLE001  the snippet's line in the message
            pytest.fail(f"README.md snippet at line {line} failed: {type(e).__name__}: {e}")
        ran += 1
    assert ran >= 2
    assert list(tmp_path.iterdir()) == []  # the snippets write nothing (logger=False, no checkpoints)
