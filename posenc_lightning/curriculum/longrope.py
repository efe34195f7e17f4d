"""`LongRoPECurriculum`: progressive extension with LongRoPE's factor search (Ding et al., 2024).

Stages double the length from ``start_length`` to ``target_length``; a stage longer than the
pre-training length ``original_length`` has scale ``s = seq_len / original_length``. At its first
step the evolutionary search (`posenc_lightning.curriculum.search`) finds the ``long_factor``
that minimises validation perplexity at the stage length (with the candidate set on the model),
then, when ``n_hat_candidates`` are given (the paper's set: `N_HAT_CANDIDATES`), ``n_hat``, the
initial positions kept un-interpolated, is chosen among them with those factors (the paper
searches both together; here one after the other), and the stage fine-tunes with them. The
``n_hat`` search is off by default: with a few search windows the candidates differ by less than
the windows' noise, so the choice can fit them rather than the text. After training the
``short_factor`` is re-searched at ``original_length``. Found factors are logged, kept in the
callback's ``state_dict`` (so they are in the checkpoint and a resume never searches again) and
written into the model's injected encoding config (so ``TinyGPT.load_from_checkpoint`` rebuilds long_rope with them).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from posenc_lightning.curriculum.context import ContextCurriculum, Stage, encodings_of
from posenc_lightning.curriculum.search import EvolutionarySearch, SearchResult, law_factors, windows_nll
from posenc_lightning.inject import injected_spec


def long_rope_encodings(module: torch.nn.Module) -> list[Any]:
    encs = [e for e in encodings_of(module) if e.searchable]
    if not encs:
        names = sorted({e.name for e in encodings_of(module)})
        raise ValueError(f"LongRoPECurriculum searches long_rope's rescale factors but the model has {names}; "
                         f"inject it with PosEncCallback('long_rope', original_max_position_embeddings=...)")
    return encs


#: LongRoPE's search space for n_hat (Ding et al., 2024, sec. 3.2)
N_HAT_CANDIDATES = (0, 1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 64, 128, 256)


def set_factors(module: torch.nn.Module, short: Any = None, long: Any = None, n_hat: int | None = None) -> None:
    """Set long_rope factors (and ``n_hat``) on every long_rope encoding of ``module`` and in its
    checkpoint spec."""
    for e in long_rope_encodings(module):
        e.set_factors(short_factor=short, long_factor=long, n_hat=n_hat)
    spec = injected_spec(module)
    if spec is not None:
        cfg = spec.setdefault("config", {})
        if n_hat is not None:
            cfg["n_hat"] = int(n_hat)
        if short is not None:
            cfg["short_factor"] = [float(x) for x in short]
        if long is not None:
            cfg["long_factor"] = [float(x) for x in long]


class LongRoPECurriculum(ContextCurriculum):
    """LongRoPE-style progressive extension.

    Args:
        original_length: the length the model was pre-trained at (long_rope's
            ``original_max_position_embeddings``).
        target_length: the final training length.
        steps_per_stage: optimizer steps per stage.
        start_length: first stage length (default ``original_length``; give ``target_length``
            for a single extension stage).
        growth: length ratio between stages.
        population: candidates per search iteration (paper: 64; the default is sized for a CPU).
        parents: candidates kept as parents each iteration (paper: 16).
        iterations: search iterations (paper: 40).
        mutation_prob: probability that a factor of a child is mutated (paper: 0.3).
        search_windows: validation windows scored per candidate (the first ones; evaluate on others).
        max_factor_ratio: factors searched in ``[1, max_factor_ratio * s]`` (paper: 1.25).
        research_short: re-search ``short_factor`` at ``original_length`` after training.
        n_hat_candidates: the ``n_hat`` values tried after each long search (those below the
            stage length), e.g. `N_HAT_CANDIDATES`; None or ``[]``: no search, ``n_hat`` as injected.
        keep_tokens_per_batch: as in `ContextCurriculum`.
        lr_warmup_steps: as in `ContextCurriculum`.
        seed: as in `ContextCurriculum`; also seeds the search's random candidates.
    """

    def __init__(self, original_length: int, target_length: int, steps_per_stage: int, start_length: int | None = None,
                 growth: int = 2, population: int = 12, parents: int = 4, iterations: int = 3,
                 mutation_prob: float = 0.3, search_windows: int = 4, max_factor_ratio: float = 1.25,
                 research_short: bool = True, n_hat_candidates: list[int] | None = None,
                 keep_tokens_per_batch: bool = False, lr_warmup_steps: int = 0, seed: int = 0) -> None:
        start = start_length or original_length
        lengths = [start]
        while lengths[-1] < target_length:
            lengths.append(min(lengths[-1] * growth, target_length))
        stages = [Stage(i * steps_per_stage, n, None, max(1.0, n / original_length), lr_warmup_steps if i else 0)
                  for i, n in enumerate(lengths)]
        super().__init__(stages, keep_tokens_per_batch=keep_tokens_per_batch, seed=seed)
        self.original_length = original_length
        self.search_kw = {"population": population, "parents": parents, "iterations": iterations,
                          "mutation_prob": mutation_prob, "seed": seed}
        self.search_windows, self.max_factor_ratio = search_windows, max_factor_ratio
        self.research_short = research_short
        cands = n_hat_candidates or []
        if any(int(n) != n or n < 0 for n in cands):
            raise ValueError(f"LongRoPECurriculum: n_hat_candidates must be whole numbers >= 0, got {cands}")
        self.n_hat_candidates = sorted({int(n) for n in cands})
        self.found: dict[int, list[float]] = {}  # stage index -> long factors
        self.found_n_hat: dict[int, int] = {}  # stage index -> n_hat
        self.short: list[float] | None = None
        self.histories: dict[str, list[dict[str, float]]] = {}

    # ---------------------------------------------------------------- the search
    def _tokens(self, trainer: pl.Trainer) -> torch.Tensor:
        dm = getattr(trainer, "datamodule", None)
        tokens = getattr(dm, "val_tokens", None)
        if tokens is None and dm is not None and hasattr(dm, "setup"):
            dm.setup("validate")
            tokens = getattr(dm, "val_tokens", None)
        if tokens is None:
            raise ValueError("LongRoPECurriculum scores candidates on validation text: use a datamodule with "
                             "`val_tokens` (CorpusDataModule) or set `curriculum.search_tokens`")
        return getattr(self, "search_tokens", None) if getattr(self, "search_tokens", None) is not None else tokens

    def search(self, pl_module: pl.LightningModule, tokens: torch.Tensor, seq_len: int, scale: float,
               which: str = "long", log: Any = None) -> SearchResult:
        """Search ``which`` ("long" or "short") factors scored by perplexity at ``seq_len``."""
        enc = long_rope_encodings(pl_module)[0]
        n = enc.rotary_dim // 2
        for e in long_rope_encodings(pl_module):
            e.set_scale(scale)
        if which == "long":
            laws = law_factors(enc.rotary_dim, enc.theta, scale, self.original_length)
            init = list(laws.values()) + ([self.found[max(self.found)]] if self.found else [])
            hi = self.max_factor_ratio * scale
        else:
            init = [[1.0] * n] + [list(law_factors(enc.rotary_dim, enc.theta, 2.0, self.original_length)["yarn"])]
            hi = max(2.0, self.max_factor_ratio * scale)
        es = EvolutionarySearch(n, 1.0, hi, **self.search_kw)
        before = (enc.short_factor, enc.long_factor)

        def score(c: tuple[float, ...]) -> float:
            set_factors(pl_module, **{which: c})
            return math.exp(windows_nll(pl_module, tokens, seq_len, self.search_windows))

        def progress(it: int, row: dict[str, float]) -> None:
            rank_zero_info(f"LongRoPE search ({which}, length {seq_len}, s={scale:g}) iteration {it}: "
                           f"best ppl {row['best']:.4f}, parents mean {row['parents_mean']:.4f}, "
                           f"{int(row['evaluated'])} evaluated")
            if log is not None:
                log({f"longrope/{which}_{seq_len}/best_ppl": row["best"],
                     f"longrope/{which}_{seq_len}/parents_mean_ppl": row["parents_mean"]}, it)

        try:
            res = es.run(score, init, progress)
        finally:
            set_factors(pl_module, short=before[0], long=before[1])
        self.histories[f"{which}_{seq_len}"] = res.history
        return res

    def search_n_hat(self, pl_module: pl.LightningModule, tokens: torch.Tensor, seq_len: int,
                     long: list[float]) -> tuple[int, dict[int, float]]:
        """``n_hat`` with the least perplexity at ``seq_len`` given the ``long`` factors (ties: the
        smallest), and the perplexity of every candidate tried."""
        enc = long_rope_encodings(pl_module)[0]
        before = (enc.long_factor, enc.n_hat)
        ppl: dict[int, float] = {}
        try:
            set_factors(pl_module, long=long)
            for n in [c for c in self.n_hat_candidates if c < seq_len] or [0]:
                set_factors(pl_module, n_hat=n)
                ppl[n] = math.exp(windows_nll(pl_module, tokens, seq_len, self.search_windows))
        finally:
            set_factors(pl_module, long=before[0], n_hat=before[1])
        best = min(ppl, key=lambda n: (ppl[n], n))
        rank_zero_info(f"LongRoPE n_hat at length {seq_len}: {best} (ppl {ppl[best]:.4f}; n_hat=0: "
                       f"{ppl.get(0, float('nan')):.4f})")
        return best, ppl

    def _logger_fn(self, trainer: pl.Trainer) -> Any:
        def log(metrics: dict[str, float], step: int) -> None:
            if trainer.is_global_zero:
                for lg in trainer.loggers:
                    lg.log_metrics(metrics, step=step)
        return log

    def _log_factors(self, trainer: pl.Trainer, tag: str, factors: list[float]) -> None:
        rank_zero_info(f"LongRoPE {tag} factors: {[round(x, 2) for x in factors]}")
        if not trainer.is_global_zero:
            return
        for lg in trainer.loggers:
            exp = getattr(lg, "experiment", None)
            if hasattr(exp, "add_text"):
                exp.add_text(f"longrope/{tag}", str([round(x, 3) for x in factors]), trainer.global_step)
            lg.log_metrics({f"longrope/{tag}/{i}": x for i, x in enumerate(factors)}, step=trainer.global_step)

    def _search_stage(self, trainer: pl.Trainer, pl_module: pl.LightningModule, k: int) -> None:
        stage = self.stages[k]
        res = self.search(pl_module, self._tokens(trainer), stage.seq_len, float(stage.scale or 1.0),
                          "long", self._logger_fn(trainer))
        best = trainer.strategy.broadcast(list(res.best), src=0)
        self.found[k] = [float(x) for x in best]
        self._log_factors(trainer, f"long_factor_stage{k}", self.found[k])
        if not self.n_hat_candidates:
            return
        n_hat, ppl = self.search_n_hat(pl_module, self._tokens(trainer), stage.seq_len, self.found[k])
        self.histories[f"n_hat_{stage.seq_len}"] = [{"n_hat": float(n), "ppl": p} for n, p in ppl.items()]
        self.found_n_hat[k] = int(trainer.strategy.broadcast(n_hat, src=0))
        if trainer.is_global_zero:
            for lg in trainer.loggers:
                lg.log_metrics({f"longrope/n_hat_stage{k}": float(self.found_n_hat[k])}, step=trainer.global_step)

    # ---------------------------------------------------------------- hooks
    def _apply_factors(self, pl_module: pl.LightningModule, step: int) -> None:
        k = self.stage_index(step)
        done = [i for i in self.found if i <= k]
        if done:
            set_factors(pl_module, long=self.found[max(done)], n_hat=self.found_n_hat.get(max(done)))
        if self.short is not None:
            set_factors(pl_module, short=self.short)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        long_rope_encodings(pl_module)
        super().on_train_start(trainer, pl_module)
        self._apply_factors(pl_module, trainer.global_step)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        k = self.stage_index(trainer.global_step)
        if self.stages[k].seq_len > self.original_length and k not in self.found:
            self._search_stage(trainer, pl_module, k)
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._apply_factors(pl_module, trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.research_short or self.short is not None:
            return
        scale = float(self.stage_at(max(0, trainer.global_step - 1)).scale or 1.0)
        res = self.search(pl_module, self._tokens(trainer), self.original_length, scale, "short",
                          self._logger_fn(trainer))
        self.short = [float(x) for x in trainer.strategy.broadcast(list(res.best), src=0)]
        set_factors(pl_module, short=self.short)
        self._log_factors(trainer, "short_factor", self.short)

    def state_dict(self) -> dict[str, Any]:
        return {"found": {int(k): v for k, v in self.found.items()}, "short": self.short,
                "found_n_hat": {int(k): v for k, v in self.found_n_hat.items()}, "histories": self.histories}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.found = {int(k): list(v) for k, v in state_dict.get("found", {}).items()}
        self.short = state_dict.get("short")
        self.found_n_hat = {int(k): int(v) for k, v in state_dict.get("found_n_hat", {}).items()}
        self.histories = dict(state_dict.get("histories", {}))
