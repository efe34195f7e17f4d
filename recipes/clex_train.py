"""Train TinyGPT with CLEX (Chen et al., 2023): every step samples a scale t in [1, t_max] and the
matching length (`CLEXCurriculum`, configured in the YAML's ``trainer.callbacks``); then perplexity
at 1x..8x the training length with t = length / training length.

    python recipes/clex_train.py --config configs/clex_train.yaml
    posenc run clex_train [--devices 2] [overrides]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posenc_lightning.curriculum.context import ContextCurriculum, encodings_of
from posenc_lightning.recipes import SweepOptions, train_and_sweep


def set_eval_scale(cli, n: int) -> None:
    """t = n / L through the curriculum's own rule (falls back to it when none is configured)."""
    cur = next((c for c in cli.trainer.callbacks if isinstance(c, ContextCurriculum)), None)
    L = cli.datamodule.seq_len
    t = cur.eval_scale(n, cli.trainer.global_step) if cur is not None else max(1.0, n / L)
    for enc in encodings_of(cli.model):
        enc.set_scale(t)


def main(args: list[str] | None = None) -> dict:
    return train_and_sweep("clex_train", SweepOptions, args, set_eval_scale, " with t ~ U[1, t_max] per step", __doc__)


if __name__ == "__main__":
    main()
