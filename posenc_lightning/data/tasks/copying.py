"""Copy, reverse and selective copy: reproduce a sequence after a separator.

Copy and reverse are the length-generalization tasks of Kazemnejad et al. (2023, "The Impact of
Positional Encoding on Length Generalization in Transformers"); selective copy (copy only the
data tokens, in order, skipping blanks) is the one of Golovneva et al. (2024, CoPE) after Gu & Dao
(2023, Mamba).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from posenc_lightning.data.tasks.base import BOS, SEP, Task, check_positive


def _letters(k: int) -> tuple[str, ...]:
    return tuple(f"s{i}" for i in range(k))


class Copy(Task):
    """``<bos> x_1 .. x_m <sep> x_1 .. x_m``; the answer is the second ``x_1 .. x_m``, with
    ``m = (n - 1) // 2`` for an input of ``n`` tokens.

    Args:
        n_symbols: alphabet size of ``x``.
    """

    name = "copy"
    min_len = 3

    def __init__(self, n_symbols: int = 16) -> None:
        check_positive(self.name, n_symbols=n_symbols)
        self.n_symbols = n_symbols
        self.symbols = _letters(n_symbols)

    def config(self) -> dict[str, Any]:
        return {"n_symbols": self.n_symbols}

    def target(self, x: list[int]) -> list[int]:
        """The answer for the sequence ``x``."""
        return list(x)

    def _build(self, rng: np.random.Generator, total: int) -> tuple[list[int], list[bool]]:
        m = (total - 2) // 2
        x = [self.id("s0") + int(s) for s in rng.integers(self.n_symbols, size=m)]
        return [BOS, *x, SEP, *self.target(x)], [False] * (m + 2) + [True] * m


class Reverse(Copy):
    """``<bos> x_1 .. x_m <sep> x_m .. x_1``: copy in reverse order."""

    name = "reverse"

    def target(self, x: list[int]) -> list[int]:
        return list(reversed(x))


class SelectiveCopy(Task):
    """``<bos>`` a context of ``n_items`` data tokens scattered among blanks ``.``, ``<sep>``, then
    the data tokens in order. Longer inputs have more blanks, the same number of items.

    Args:
        n_items: data tokens to copy.
        n_symbols: alphabet size of the data tokens.
    """

    name = "selective_copy"

    def __init__(self, n_items: int = 4, n_symbols: int = 16) -> None:
        check_positive(self.name, n_items=n_items, n_symbols=n_symbols)
        self.n_items, self.n_symbols = n_items, n_symbols
        self.symbols = (".", *_letters(n_symbols))

    @property
    def min_len(self) -> int:  # type: ignore[override]
        return 2 * self.n_items + 1

    def config(self) -> dict[str, Any]:
        return {"n_items": self.n_items, "n_symbols": self.n_symbols}

    def _build(self, rng: np.random.Generator, total: int) -> tuple[list[int], list[bool]]:
        m = self.n_items
        c = total - 2 - m  # context length: blanks plus the m items
        data = [self.id("s0") + int(s) for s in rng.integers(self.n_symbols, size=m)]
        context = [self.id(".")] * c
        for slot, tok in zip(sorted(rng.choice(c, size=m, replace=False)), data):
            context[int(slot)] = tok
        return [BOS, *context, SEP, *data], [False] * (c + 2) + [True] * m
