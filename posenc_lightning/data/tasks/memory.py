"""Recall tasks: flip-flop, multi-query associative recall (MQAR) and passkey retrieval.

Flip-flop language modelling is Liu et al. (2023, "Exposing Attention Glitches with Flip-Flop
Language Modeling"); MQAR is Arora et al. (2023, "Zoology"); passkey retrieval is Mohtashami &
Jaggi (2023, "Landmark Attention"), the usual probe of context extension (YaRN, LongRoPE).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from posenc_lightning.data.tasks.base import BOS, SEP, Task, check_positive


class FlipFlop(Task):
    """Instructions ``w b`` (write bit b), ``i b`` (ignore) and ``r b`` (read: b is the last
    written bit); the first is a write, the last a read. Every read's bit is an answer.

    Args:
        p_ignore: probability of an ignore (the paper's FFL(p) sparsity; the rest split evenly
            between writes and reads).
    """

    name = "flip_flop"
    symbols = ("w", "r", "i", "0", "1")
    min_len = 4

    def __init__(self, p_ignore: float = 0.8) -> None:
        if not 0.0 <= p_ignore < 1.0:
            raise ValueError(f"flip_flop: p_ignore={p_ignore} must be in [0, 1)")
        self.p_ignore = p_ignore

    def config(self) -> dict[str, Any]:
        return {"p_ignore": self.p_ignore}

    def _build(self, rng: np.random.Generator, total: int) -> tuple[list[int], list[bool]]:
        k = (total - 1) // 2  # instructions
        p_rw = (1.0 - self.p_ignore) / 2
        kinds = ["w", *rng.choice(["w", "r", "i"], size=k - 2, p=[p_rw, p_rw, self.p_ignore]).tolist(), "r"]
        toks, ans, memory = [BOS], [False], 0
        for kind in kinds:
            bit = memory if kind == "r" else int(rng.integers(2))
            if kind == "w":
                memory = bit
            toks += [self.id(kind), self.id(str(bit))]
            ans += [False, kind == "r"]
        return toks, ans


class MQAR(Task):
    """``n_pairs`` key-value pairs ``k v``, then ``n_pairs`` queries ``k v``, each at a random
    place in the rest of the sequence (blanks ``.`` between them). The queried values are the
    answers. Longer inputs put more blanks between the pairs and queries.

    In Zoology (Arora et al. 2023) a query is the key alone, its value a label the input never
    shows. Here the answer is the next input token, so with every key queried once
    (``distinct_queries``) an answer is partly given away by the values already answered (the
    last query has one value left): a 2-layer model settles on that shortcut (about half the
    answers right with 4 pairs) instead of recall. ``distinct_queries=False`` draws the queried
    keys with replacement, which removes the shortcut as Zoology's hidden labels do.

    Args:
        n_pairs: key-value pairs (distinct keys).
        n_keys: key vocabulary.
        n_values: value vocabulary.
        distinct_queries: query every key once, in random order (else keys drawn with replacement).
    """

    name = "mqar"

    def __init__(self, n_pairs: int = 6, n_keys: int = 32, n_values: int = 32, distinct_queries: bool = True) -> None:
        check_positive(self.name, n_pairs=n_pairs, n_keys=n_keys, n_values=n_values)
        self.distinct_queries = bool(distinct_queries)
        if n_pairs > n_keys:
            raise ValueError(f"mqar: n_pairs={n_pairs} needs n_keys >= n_pairs (keys are distinct); got n_keys={n_keys}")
        self.n_pairs, self.n_keys, self.n_values = n_pairs, n_keys, n_values
        self.symbols = (".", *(f"k{i}" for i in range(n_keys)), *(f"v{i}" for i in range(n_values)))

    @property
    def min_len(self) -> int:  # type: ignore[override]
        return 4 * self.n_pairs

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"n_pairs": self.n_pairs, "n_keys": self.n_keys, "n_values": self.n_values}
        if not self.distinct_queries:  # the default stays out of the record: earlier cells keep their signature
            cfg["distinct_queries"] = False
        return cfg

    def _build(self, rng: np.random.Generator, total: int) -> tuple[list[int], list[bool]]:
        d = self.n_pairs
        keys = [self.id(f"k{int(i)}") for i in rng.choice(self.n_keys, size=d, replace=False)]
        values = [self.id(f"v{int(i)}") for i in rng.integers(self.n_values, size=d)]
        rest = total - 1 - 2 * d
        slots = sorted(int(s) for s in rng.choice(rest // 2, size=d, replace=False))
        body = [self.id(".")] * rest
        ans = [False] * rest
        order = rng.permutation(d) if self.distinct_queries else rng.integers(d, size=d)
        for slot, q in zip(slots, order):
            body[2 * slot], body[2 * slot + 1] = keys[q], values[q]
            ans[2 * slot + 1] = True
        pairs = [t for kv in zip(keys, values) for t in kv]
        return [BOS, *pairs, *body], [False] * (1 + 2 * d) + ans


class Passkey(Task):
    """Filler (a repeated ``f0 f1 .. f{p-1}`` pattern), the passkey ``<sep> d_1 .. d_k`` at a
    random place in it, and at the end ``? d_1 .. d_k``: the digits after ``?`` are the answer.

    Args:
        n_digits: digits of the passkey.
        period: length of the repeated filler pattern.
    """

    name = "passkey"

    def __init__(self, n_digits: int = 3, period: int = 5) -> None:
        check_positive(self.name, n_digits=n_digits, period=period)
        self.n_digits, self.period = n_digits, period
        self.symbols = (*(str(d) for d in range(10)), "?", *(f"f{i}" for i in range(period)))

    @property
    def min_len(self) -> int:  # type: ignore[override]
        return 2 * self.n_digits + 2

    def config(self) -> dict[str, Any]:
        return {"n_digits": self.n_digits, "period": self.period}

    def _build(self, rng: np.random.Generator, total: int) -> tuple[list[int], list[bool]]:
        k = self.n_digits
        key = [self.id(str(int(d))) for d in rng.integers(10, size=k)]
        n_fill = total - 3 - 2 * k
        at = int(rng.integers(n_fill + 1))
        fill = [self.id(f"f{i % self.period}") for i in range(n_fill)]
        toks = [BOS, *fill[:at], SEP, *key, *fill[at:], self.id("?"), *key]
        return toks, [False] * (total - k) + [True] * k
