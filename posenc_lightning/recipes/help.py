"""The ``--help`` layout of ``posenc train`` and the recipes: the description's prose paragraphs are
reflowed to the terminal's width, its examples (indented lines) and lists keep their lines."""

from __future__ import annotations

import re
import textwrap

from jsonargparse import DefaultHelpFormatter

_LIST_ITEM = re.compile(r"^(\d+\.|[-*])\s")


class ExamplesHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help formatter, except for the description: a paragraph of indented lines
    (command examples) or a list keeps its lines, each example on a line of its own, indented;
    prose is reflowed as usual."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        blocks = re.split(r"\n\s*\n", textwrap.dedent(text).strip("\n"))
        out = []
        for block in blocks:
            lines = block.splitlines()
            if lines and (lines[0].startswith((" ", "\t")) or _LIST_ITEM.match(lines[0])):
                out.append("\n".join(indent + line.rstrip() for line in lines))
            else:
                out.append(super()._fill_text(block, width, indent))
        return "\n\n".join(out)
