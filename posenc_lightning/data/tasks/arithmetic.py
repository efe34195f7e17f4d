"""Addition and counting: answers computed from the whole input.

Multi-digit addition with little-endian digits is a task of Kazemnejad et al. (2023); counting
(the value of a variable after a run of increments hidden among no-ops) follows the counting task
of Golovneva et al. (2024, CoPE), where position must be counted in *content* (increments since the
last assignment), not in tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from posenc_lightning.data.tasks.base import BOS, Task, check_positive

DIGITS = tuple(str(d) for d in range(10))


class Addition(Task):
    """``<bos> a_0 .. a_{m-1} + b_0 .. b_{m-1} = c_0 .. c_m`` with digits least significant
    first and ``c = a + b`` (``m + 1`` digits); ``m = (n - 3) // 3`` for an input of ``n`` tokens.
    The answer is ``c``."""

    name = "addition"
    symbols = (*DIGITS, "+", "=")
    min_len = 6

    def digits(self, value: int, width: int) -> list[int]:
        """``value``'s ``width`` digit ids, least significant first."""
        return [self.id(str((value // 10 ** i) % 10)) for i in range(width)]

    def _build(self, rng: np.random.Generator, total: int) -> tuple[list[int], list[bool]]:
        m = (total - 4) // 3
        a_d, b_d = rng.integers(10, size=m), rng.integers(10, size=m)
        a = sum(int(d) * 10 ** i for i, d in enumerate(a_d))
        b = sum(int(d) * 10 ** i for i, d in enumerate(b_d))
        toks = [BOS, *self.digits(a, m), self.id("+"), *self.digits(b, m), self.id("="), *self.digits(a + b, m + 1)]
        return toks, [False] * (2 * m + 3) + [True] * (m + 1)


class Counting(Task):
    """A stream of ``set d`` (assign the digit ``d``), ``inc`` (add one) and ``pass`` (no-op), then
    ``?`` and the variable's value. After the last ``set`` come at most ``max_inc`` increments
    among ``pass`` tokens; the last ``set`` is anywhere in the stream, so a longer input can hide
    the increments to count in a longer span. Values stay single digits at every length.

    Args:
        max_inc: most increments after the last assignment (1..9; assignments are ``0..9 - max_inc``).
        p_set: probability of an assignment before the last one (per op).
        p_inc: probability of an increment (before the last assignment, and per slot after it).
    """

    name = "counting"
    symbols = (*DIGITS, "set", "inc", "pass", "?")
    min_len = 4

    def __init__(self, max_inc: int = 5, p_set: float = 0.1, p_inc: float = 0.2) -> None:
        check_positive(self.name, max_inc=max_inc)
        if max_inc > 9:
            raise ValueError(f"counting: max_inc={max_inc} must be at most 9 (answers are single digits)")
        for k, p in (("p_set", p_set), ("p_inc", p_inc)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"counting: {k}={p} must be a probability in [0, 1]")
        self.max_inc, self.p_set, self.p_inc = max_inc, p_set, p_inc

    def config(self) -> dict[str, Any]:
        return {"max_inc": self.max_inc, "p_set": self.p_set, "p_inc": self.p_inc}

    def _ops(self, rng: np.random.Generator, length: int) -> list[int]:
        """Exactly ``length`` tokens of random ops (``set d`` takes two)."""
        out: list[int] = []
        while len(out) < length:
            u = rng.random()
            if u < self.p_set and len(out) + 2 <= length:
                out += [self.id("set"), self.id(str(int(rng.integers(10))))]
            else:
                out.append(self.id("inc") if u < self.p_set + self.p_inc else self.id("pass"))
        return out

    def _build(self, rng: np.random.Generator, total: int) -> tuple[list[int], list[bool]]:
        stream = total - 3  # <bos> stream ? answer
        start = int(rng.integers(stream - 1))  # where the last `set d` begins
        after = stream - start - 2
        value = int(rng.integers(10 - self.max_inc))
        k = int(rng.integers(min(self.max_inc, after) + 1))
        tail = [self.id("pass")] * after
        for slot in rng.choice(after, size=k, replace=False):
            tail[int(slot)] = self.id("inc")
        toks = [BOS, *self._ops(rng, start), self.id("set"), self.id(str(value)), *tail, self.id("?"),
                self.id(str(value + k))]
        return toks, [False] * (total - 1) + [True]
