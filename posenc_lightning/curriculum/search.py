"""LongRoPE's evolutionary search of per-dimension rotary rescale factors (Ding et al., 2024,
"LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens", Sec. 3.2, Algorithm 1).

A candidate is a vector ``lambda`` of ``rotary_dim / 2`` factors (frequency ``theta_i / lambda_i``,
dimension 0 = highest frequency). The initial population holds the PI, NTK and YaRN factors
for the same scale plus their mutations; each iteration keeps the ``parents`` best, adds
mutations (each factor moved with probability ``mutation_prob``) and crossovers (each factor
from one of two parents), and rejects children that break the paper's monotonicity
constraint ``lambda_i <= lambda_{i+1}`` (lower frequencies are interpolated at least as much).
Factors live on the paper's grid: ``[lo, hi]`` (default ``[1, 1.25 s]``) in steps of 0.01.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from posenc_lightning.functional.rope import rope_inv_freq
from posenc_lightning.functional.rope_scaling import ntk_inv_freq, yarn_inv_freq

Candidate = tuple[float, ...]


def law_factors(rotary_dim: int, theta: float, factor: float, original_max: int) -> dict[str, Candidate]:
    """``lambda_i = theta_i / theta'_i`` of the PI, NTK-aware and YaRN laws at scale ``factor``."""
    base = rope_inv_freq(rotary_dim, theta).double()
    laws = {"pi": base.float() / factor, "ntk": ntk_inv_freq(rotary_dim, theta, factor),
            "yarn": yarn_inv_freq(rotary_dim, theta, factor, original_max)}
    return {k: tuple(round(float(x), 4) for x in (base / v.double())) for k, v in laws.items()}


def is_monotonic(c: Sequence[float]) -> bool:
    return all(a <= b + 1e-9 for a, b in itertools.pairwise(c))


@dataclass
class SearchResult:
    best: Candidate
    best_score: float
    scores: dict[Candidate, float]
    history: list[dict[str, float]] = field(default_factory=list)  # per iteration: best, mean of parents


class EvolutionarySearch:
    """The search loop; ``score(candidate) -> float`` (lower is better, e.g. perplexity).

    Args:
        n_dims: factors per candidate (``rotary_dim / 2``).
        lo, hi: the factor range; ``step`` the grid.
        population, parents, iterations: the population size, the number kept, the rounds.
        mutation_prob, mutation_sigma: per-factor mutation probability and log-normal size.
        seed: numpy seed (every DDP rank draws the same candidates).
    """

    def __init__(self, n_dims: int, lo: float, hi: float, population: int = 16, parents: int = 4,
                 iterations: int = 4, mutation_prob: float = 0.3, mutation_sigma: float = 0.25,
                 step: float = 0.01, seed: int = 0) -> None:
        if not (0 < lo <= hi) or parents < 2 or population <= parents or iterations < 1 or n_dims < 1:
            raise ValueError(f"EvolutionarySearch: need 0 < lo <= hi, 2 <= parents < population, iterations >= 1 "
                             f"(got lo={lo}, hi={hi}, parents={parents}, population={population}, "
                             f"iterations={iterations})")
        self.n_dims, self.lo, self.hi, self.step = n_dims, lo, hi, step
        self.population, self.parents, self.iterations = population, parents, iterations
        self.mutation_prob, self.mutation_sigma = mutation_prob, mutation_sigma
        self.rng = np.random.default_rng(seed)

    def snap(self, c: Sequence[float]) -> Candidate:
        return tuple(float(min(self.hi, max(self.lo, round(x / self.step) * self.step))) for x in c)

    def mutate(self, c: Candidate) -> Candidate | None:
        for _ in range(20):  # reject children that break the monotonicity constraint
            hit = self.rng.random(self.n_dims) < self.mutation_prob
            if not hit.any():
                hit[self.rng.integers(self.n_dims)] = True
            noise = np.exp(self.rng.normal(0.0, self.mutation_sigma, self.n_dims))
            child = self.snap(np.where(hit, np.asarray(c) * noise, c))
            if is_monotonic(child) and child != c:
                return child
        return None

    def crossover(self, a: Candidate, b: Candidate) -> Candidate | None:
        for _ in range(20):
            pick = self.rng.random(self.n_dims) < 0.5
            child = tuple(float(x) for x in np.where(pick, a, b))
            if is_monotonic(child) and child not in (a, b):
                return child
        return None

    def run(self, score: Callable[[Candidate], float], init: Sequence[Sequence[float]],
            progress: Callable[[int, dict[str, float]], None] | None = None) -> SearchResult:
        seeds = []
        for c in init:
            c = self.snap(c)
            if not is_monotonic(c):
                c = self.snap(np.maximum.accumulate(np.asarray(c)))
            if c not in seeds:
                seeds.append(c)
        pop = list(seeds)
        while len(pop) < self.population:
            child = self.mutate(seeds[self.rng.integers(len(seeds))])
            if child is not None and child not in pop:
                pop.append(child)
        scores: dict[Candidate, float] = {}
        history = []
        for it in range(self.iterations):
            for c in pop:
                if c not in scores:
                    s = float(score(c))
                    scores[c] = s if math.isfinite(s) else math.inf
            ranked = sorted(scores, key=scores.__getitem__)
            parents = ranked[:self.parents]
            row = {"iteration": float(it), "best": scores[parents[0]],
                   "parents_mean": float(np.mean([scores[p] for p in parents])), "evaluated": float(len(scores))}
            history.append(row)
            if progress is not None:
                progress(it, row)
            if it == self.iterations - 1:
                break
            children: list[Candidate] = []
            n_mut = (self.population - self.parents) // 2
            tries = 0
            while len(children) < self.population - self.parents and tries < 50 * self.population:
                tries += 1
                if len(children) < n_mut:
                    child = self.mutate(parents[self.rng.integers(len(parents))])
                else:
                    i, j = self.rng.choice(len(parents), size=2, replace=False)
                    child = self.crossover(parents[i], parents[j])
                if child is not None and child not in scores and child not in children:
                    children.append(child)
            pop = list(parents) + children
        best = min(scores, key=scores.__getitem__)
        return SearchResult(best, scores[best], scores, history)


@torch.no_grad()
def windows_nll(model: torch.nn.Module, tokens: torch.Tensor, seq_len: int, n_windows: int, offset: int = 0,
                batch_size: int = 4) -> float:
    """Mean next-token NLL of ``model`` (``model(x) -> logits``) on ``n_windows`` consecutive
    windows of ``seq_len`` starting at window ``offset`` of ``tokens``."""
    avail = (len(tokens) - 1) // seq_len - offset
    if avail < n_windows:
        raise ValueError(f"the validation text has {max(avail, 0)} windows of {seq_len} tokens after offset "
                         f"{offset}; ask for fewer windows or give more validation text")
    device = next(model.parameters()).device
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        for s in range(0, n_windows, batch_size):
            idx = range(offset + s, offset + min(n_windows, s + batch_size))
            w = torch.stack([tokens[i * seq_len: (i + 1) * seq_len + 1] for i in idx]).long().to(device)
            logits = model(w[:, :-1]).float()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), w[:, 1:], reduction="sum")
            total += float(nll)
            count += w[:, 1:].numel()
    finally:
        model.train(was_training)
    return total / count
