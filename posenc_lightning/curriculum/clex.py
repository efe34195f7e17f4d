"""`CLEXCurriculum`: CLEX-style training with a sampled continuous scale (Chen et al., 2023, Sec. 3.3).

Each step draws ``t`` in ``[1, t_max]`` from ``(seed, step)`` alone (so DDP ranks and resumed runs
agree), calls the encoding's ``set_scale(t)`` and, with ``length_follows_scale``, trains at the
matching length ``t * train_length`` (rounded up to ``multiple_of``, capped at ``max_seq_len``).
Evaluation at length ``n`` uses ``t = n / train_length`` (at least 1), as the paper does at
inference.
"""

from __future__ import annotations

import numpy as np

from posenc_lightning.curriculum.context import ContextCurriculum, Stage, round_to


class CLEXCurriculum(ContextCurriculum):
    """Samples the CLEX scale t (and the sequence length) every step.

    Args:
        train_length: the base training length L (clex's ``original_max_position_embeddings``).
        t_max: the largest scale sampled (clex's ``max_scale``).
        integer_scales: sample t from {1, ..., floor(t_max)} instead of the interval.
        length_follows_scale: train at ``t * L`` (True) or always at L (False).
        max_seq_len: cap on the sampled length (memory); default ``t_max * L``.
        multiple_of: round sampled lengths up to a multiple of this.
        keep_tokens_per_batch: longer samples get proportionally smaller batches.
        seed: the scale draw's seed.
    """

    def __init__(self, train_length: int, t_max: float, integer_scales: bool = False,
                 length_follows_scale: bool = True, max_seq_len: int | None = None, multiple_of: int = 8,
                 keep_tokens_per_batch: bool = True, seed: int = 0) -> None:
        if t_max < 1 or train_length < 1:
            raise ValueError(f"CLEXCurriculum: need t_max >= 1 and train_length >= 1 (got {t_max}, {train_length})")
        super().__init__([Stage(0, train_length, scale=1.0)], keep_tokens_per_batch=keep_tokens_per_batch, seed=seed)
        self.train_length, self.t_max, self.integer_scales = train_length, float(t_max), integer_scales
        self.length_follows_scale, self.multiple_of = length_follows_scale, multiple_of
        self.max_seq_len = max_seq_len or round(self.t_max * train_length)

    def scale_at(self, step: int) -> float:
        rng = np.random.default_rng([self.seed, int(step), 0xC1E])
        if self.integer_scales:
            return float(rng.integers(1, int(self.t_max) + 1))
        return float(1.0 + (self.t_max - 1.0) * rng.random())

    def stage_index(self, step: int) -> int:
        return 0

    def stage_at(self, step: int) -> Stage:
        t = self.scale_at(step)
        n = self.train_length
        if self.length_follows_scale:
            n = min(self.max_seq_len, round_to(t * self.train_length, self.multiple_of))
        return Stage(int(step), n, None, t)

    def eval_scale(self, seq_len: int, step: int) -> float:
        return max(1.0, seq_len / self.train_length)
