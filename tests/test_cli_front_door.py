"""The ``posenc`` command's front door (issue 46): ``posenc train --help`` reads as one truthful
page (examples on lines of their own, one way to choose the encoding, ``--posenc.encoding`` with
its default and not "required"), and ``posenc run RECIPE ... --dry-run`` stays posenc's own."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.helpers import run_posenc


@pytest.fixture(scope="module")
def train_help() -> str:
    from posenc_lightning.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        main(["train", "--help"])
    return buf.getvalue()


def test_train_help_puts_each_example_on_a_line_of_its_own(train_help):
    lines = train_help.splitlines()
    examples = [line for line in lines if line.lstrip().startswith("posenc train --posenc.encoding=")]
    assert len(examples) == 2 and all(line.startswith("    ") for line in examples)
    assert "--posenc.config='{init_L: 64}' --trainer.max_steps=500" in examples[1]  # not broken up
    before = lines[lines.index(examples[0]) - 1]
    assert before == ""  # a block of its own, after the prose


def test_train_help_offers_one_way_to_choose_the_encoding(train_help):
    assert "--model.encoding" not in train_help and "--model.encoding_cfg" not in train_help
    text = " ".join(train_help.split())
    option = text.split("--posenc.encoding ENCODING a registered name")[1][:200]
    assert "default: rope" in option and "required" not in option
    usage = text.split("options:")[0]
    assert "[--posenc.encoding ENCODING]" in usage  # optional in the usage line too


@pytest.mark.parametrize("where", ["first", "last", "middle"])
def test_dry_run_is_accepted_anywhere(where):
    args = {"first": ["run", "--dry-run", "fire_train", "--trainer.max_steps=3"],
            "last": ["run", "fire_train", "--trainer.max_steps=3", "--dry-run"],
            "middle": ["run", "fire_train", "--dry-run", "--trainer.max_steps=3"]}[where]
    code, out = run_posenc(*args)
    assert code == 0
    printed = out.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("+ ")  # the command, not the recipe's output
    assert printed[0].endswith("fire_train.yaml --trainer.max_steps=3") and "--dry-run" not in printed[0]
