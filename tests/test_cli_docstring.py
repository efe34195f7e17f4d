"""The ``posenc`` command's module docstring names every subcommand its parser has, and no other."""

from __future__ import annotations

import argparse
import re

from posenc_lightning import cli


def test_the_module_docstring_lists_every_subcommand():
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    listed = re.findall(r"``posenc ([\w-]+)", cli.__doc__)
    assert sorted(set(listed)) == sorted(sub.choices) == ["check-serving", "export", "list", "report", "run", "train"]
