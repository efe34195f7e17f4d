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
    shows. Here, by default, the answer is the next input token, so with every key queried once
    (``distinct_queries``) an answer is partly given away by the values already answered (the
    last query has one value left): a 2-layer model settles on that shortcut (about half the
    answers right with 4 pairs) instead of recall. ``distinct_queries=False`` draws the queried
    keys with replacement, which removes the shortcut as Zoology's hidden labels do.

    Zoology's own format (``zoology/data/associative_recall.py``, ``_mqar``) is three options:
    ``hidden_values`` (the value is the answer at the query key, and the input after the key shows
    a filler token instead), ``power_a`` (the query slots are drawn without replacement with
    probability proportional to ``slot ** (power_a - 1)``, slot 1 right after the pairs: Zoology's
    0.01 puts most queries close to the pairs; 1 is uniform) and ``random_filler`` (every token
    outside the pairs and queries is drawn uniformly from the keys and values, Zoology's
    ``random_non_queries``; else ``.``).

    Args:
        n_pairs: key-value pairs (distinct keys).
        n_keys: key vocabulary.
        n_values: value vocabulary.
        distinct_queries: query every key once, in random order (else keys drawn with replacement).
        hidden_values: the queried values are labels only, never read (Zoology).
        power_a: the query slots' power law (1: uniform; Zoology: 0.01).
        random_filler: random keys and values between the queries (Zoology) instead of ``.``.
    """

    name = "mqar"

    def __init__(self, n_pairs: int = 6, n_keys: int = 32, n_values: int = 32, distinct_queries: bool = True,
                 hidden_values: bool = False, power_a: float = 1.0, random_filler: bool = False) -> None:
        check_positive(self.name, n_pairs=n_pairs, n_keys=n_keys, n_values=n_values)
        if not 0.0 < power_a <= 1.0:
            raise ValueError(f"mqar: power_a={power_a} must be in (0, 1] (1 is uniform; Zoology uses 0.01)")
        if n_pairs > n_keys:
            raise ValueError(f"mqar: n_pairs={n_pairs} needs n_keys >= n_pairs (keys are distinct); got n_keys={n_keys}")
        self.n_pairs, self.n_keys, self.n_values = n_pairs, n_keys, n_values
        self.distinct_queries, self.hidden_values = bool(distinct_queries), bool(hidden_values)
        self.power_a, self.random_filler = float(power_a), bool(random_filler)
        self.symbols = (".", *(f"k{i}" for i in range(n_keys)), *(f"v{i}" for i in range(n_values)))

    @property
    def min_len(self) -> int:  # type: ignore[override]
        return 4 * self.n_pairs

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"n_pairs": self.n_pairs, "n_keys": self.n_keys, "n_values": self.n_values}
        # options at their defaults stay out of the record: earlier cells keep their signature
        extra = {"distinct_queries": (self.distinct_queries, True), "hidden_values": (self.hidden_values, False),
                 "power_a": (self.power_a, 1.0), "random_filler": (self.random_filler, False)}
        cfg.update({k: v for k, (v, default) in extra.items() if v != default})
        return cfg

    def slot_probabilities(self, n_slots: int) -> np.ndarray:
        """The probability of each of ``n_slots`` query slots (the first right after the pairs)."""
        p = np.arange(1, n_slots + 1, dtype=np.float64) ** (self.power_a - 1.0)
        return p / p.sum()

    def _build(self, rng: np.random.Generator,
               total: int) -> tuple[list[int], list[bool]] | tuple[list[int], list[bool], list[int]]:
        d = self.n_pairs
        keys = [self.id(f"k{int(i)}") for i in rng.choice(self.n_keys, size=d, replace=False)]
        values = [self.id(f"v{int(i)}") for i in rng.integers(self.n_values, size=d)]
        rest = total - 1 - 2 * d
        if self.power_a == 1.0:  # uniform (the default's own draws: its examples stay as they were)
            picked = rng.choice(rest // 2, size=d, replace=False)
        else:
            picked = rng.choice(rest // 2, size=d, replace=False, p=self.slot_probabilities(rest // 2))
        slots = sorted(int(s) for s in picked)
        if self.random_filler:  # ids of every key and value: the symbols after "."
            body = [int(t) for t in rng.integers(self.id("k0"), self.vocab_size, size=rest)]
        else:
            body = [self.id(".")] * rest
        shown = list(body)
        ans = [False] * rest
        order = rng.permutation(d) if self.distinct_queries else rng.integers(d, size=d)
        for slot, q in zip(slots, order):
            body[2 * slot], body[2 * slot + 1] = keys[q], values[q]
            shown[2 * slot] = keys[q]
            ans[2 * slot + 1] = True
        pairs = [t for kv in zip(keys, values) for t in kv]
        head = [BOS, *pairs]
        flags = [False] * (1 + 2 * d) + ans
        if not self.hidden_values:
            return head + body, flags
        return head + body, flags, head + shown


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
