"""The Python snippets of the README and of every documentation page run as written (in order, one
namespace per page, as a reader would paste them), except those marked
``<!-- readme-test: skip (reason) -->`` on the line before the fence: code that stands for the
user's own (their model, their data) or needs a long run, which a named test runs small instead."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
SKIP = re.compile(r"<!-- readme-test: skip \((.+?)\) -->\s*$")


def snippets(path: Path = README) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason or None)`` of every ```python block of ``path``."""
    lines = path.read_text().splitlines()
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


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_every_skip_names_its_reason_and_most_snippets_run():
    found = snippets()
    assert len(found) >= 4
    skipped = [s for s in found if s[2] is not None]
    assert all(len(reason) > 20 for _, _, reason in skipped)
    assert len(found) - len(skipped) >= 3  # the mixins, the Hugging Face and the curricula snippets run


def test_every_guide_is_checked_and_its_skips_give_reasons():
    guides = {p.stem for p in PAGES if p.parent.name == "guides"}
    assert {"own-model", "huggingface", "curricula", "evaluation", "multi-device", "compile",
            "adding-an-encoding"} <= guides
    for page in PAGES:
        for line, code, reason in snippets(page):
            assert code.strip(), f"{_name(page)}:{line}: an empty python block"
            assert reason is None or len(reason) > 20, f"{_name(page)}:{line}: give the skip a reason"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_page_python_snippets_run(page, tmp_path, monkeypatch):
    from posenc_lightning.encodings import registry

    monkeypatch.chdir(tmp_path)  # anything a snippet writes stays in tmp
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # a page's example encoding stays there
    ns: dict = {"__name__": "__readme__"}
    ran = 0
    for line, code, skip in snippets(page):
        if skip is not None:
            continue
        try:
            exec(compile(code, f"{_name(page)}:{line}", "exec"), ns)  # noqa: S102  the snippets are the test
        except Exception as e:  # noqa: BLE001  the snippet's line in the message
            pytest.fail(f"{_name(page)} snippet at line {line} failed: {type(e).__name__}: {e}")
        ran += 1
    if page == README:
        assert ran >= 3
    assert list(tmp_path.iterdir()) == []  # the snippets write nothing (logger=False, no checkpoints)
