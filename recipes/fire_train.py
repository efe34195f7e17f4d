"""Train TinyGPT with FIRE (Li et al., 2024, functional interpolation for relative positions) at L,
then measure length generalization: perplexity at 1x..8x the training length. Add a
``ContextCurriculum`` to ``trainer.callbacks`` in the YAML to grow the length while training.

    python recipes/fire_train.py --config configs/fire_train.yaml
    posenc run fire_train [--devices 2] [overrides]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posenc_lightning.recipes import SweepOptions, train_and_sweep


def main(args: list[str] | None = None) -> dict:
    return train_and_sweep("fire_train", SweepOptions, args, description=__doc__)


if __name__ == "__main__":
    main()
