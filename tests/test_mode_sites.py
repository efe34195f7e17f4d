"""Traced-or-eager is asked in one place (`functional.mode.Mode.tracing`), and a host read is allowed
by `Mode` alone: a change to either rule is one edit, and code that asks around it is caught here."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import posenc_lightning
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.positions import host_reads_ok

PACKAGE = Path(posenc_lightning.__file__).resolve().parent


def _calls(attr: str) -> list[str]:
    """``file:line`` of every call whose callee's last name is ``attr`` in the package."""
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr:
                hits.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return hits


def test_is_compiling_is_called_once_in_the_package():
    sites = _calls("is_compiling")
    assert len(sites) == 1 and sites[0].startswith("functional/mode.py:"), sites


def test_no_code_reads_the_device_type_to_decide_a_host_read():
    """The rule "a host read is free eagerly on CPU" is written once (`Mode.host_reads`)."""
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if 'device.type == "cpu" and not' in text and path.name != "mode.py":
            hits.append(str(path.relative_to(PACKAGE)))
    assert not hits


def test_host_reads_follow_the_mode():
    t = torch.zeros(3, dtype=torch.long)
    assert host_reads_ok(t) is Mode.of(t).host_reads is True
    assert Mode(True, "cpu").host_reads is False  # traced on CPU: a read would break the graph
    assert Mode(False, "cuda").host_reads is False  # a GPU read is a device sync


def test_tracing_is_true_inside_a_compiled_function_only():
    seen = []

    def f(x):
        seen.append(Mode.tracing())
        return x + 1

    assert Mode.tracing() is False
    torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(2))
    assert seen == [True]
    assert host_reads_ok(torch.zeros(1))
