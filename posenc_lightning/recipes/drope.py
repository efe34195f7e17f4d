"""The DroPE recipe's helpers (``recipes/drope_extend.py``): DroPE as a two-phase entry (`DROPE`, with
the recalibration's step fraction and learning rate), the trained weights kept apart from the
encoding, so every method starts from the same pre-trained model, and the paper's expectations
checked against a perplexity-by-length table. The synthetic-task grid (``recipes/compare_tasks.py``)
runs `DROPE` as its ``drope`` entry.

DroPE (Gelberg et al., Sakana AI, 2025, "Extending the Context of Pretrained LLMs by Dropping Their
Positional Embeddings"): pre-train with RoPE, drop the positional embedding (the model becomes NoPE,
every weight kept), then recalibrate briefly at the training length; the recalibrated model is
reported to keep its in-length quality and to extend past the training length better than RoPE
scaling (PI, NTK, YaRN), zero-shot or fine-tuned.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from posenc_lightning.recipes.phases import TwoPhase

__all__ = ["DROPE", "EXPECTATIONS", "RECALIBRATE_FRACTION", "RECALIBRATE_LR", "check_expectations",
           "restore_weights", "trained_weights"]

SOURCE = "Gelberg et al. 2025, Extending the Context of Pretrained LLMs by Dropping Their Positional Embeddings"
#: recalibration steps as a fraction of the pre-training steps that ran: a short recalibration at the
#: training length, this project's setting for its small models (the paper recalibrates pretrained
#: LLMs with a small fraction of their pre-training budget)
RECALIBRATE_FRACTION = 0.1
#: the recalibration's peak learning rate (a third of the pre-training peak of configs/drope_extend.yaml)
RECALIBRATE_LR = 1e-3
#: DroPE as a two-phase entry: RoPE for the pre-training steps, then NoPE (every weight kept),
#: recalibrated for `RECALIBRATE_FRACTION` of them at `RECALIBRATE_LR`
DROPE = TwoPhase("rope", "nope", RECALIBRATE_FRACTION, RECALIBRATE_LR, SOURCE)
EXPECTATIONS = (
    ("drop_hurts", "dropping RoPE without recalibration hurts at the training length"),
    ("recal_recovers", "recalibration recovers the training length: DroPE within 5% of RoPE at L"),
    ("beats_scaling", "recalibrated DroPE beats every RoPE scaling (zero-shot and fine-tuned) beyond L"),
)


def _is_encoding_key(key: str) -> bool:
    return ".posenc." in key or key.startswith("posenc.")


def trained_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s weights without its injected encoding's (parameters and buffers).

    Args:
        model: the trained model.

    Returns:
        ``{state dict key: cloned tensor}`` for every key outside the encoding.
    """
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not _is_encoding_key(k)}


def restore_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Load `trained_weights` back into ``model``, whatever encoding it holds now.

    Args:
        model: the model (any encoding injected).
        weights: from `trained_weights`.

    Raises:
        ValueError: ``weights`` lacks one of the model's own (non-encoding) keys or has a key the
            model does not: they come from another model.
    """
    result = model.load_state_dict(dict(weights), strict=False)
    missing = [k for k in result.missing_keys if not _is_encoding_key(k)]
    if missing or result.unexpected_keys:
        raise ValueError(f"restore_weights: the weights are not this model's (missing {missing[:4]}, unexpected "
                         f"{list(result.unexpected_keys)[:4]}); pass trained_weights() of the same model")


def _beyond(row: Mapping[int, float], L: int) -> float:
    """The geometric mean of a row's perplexities at lengths > L."""
    vals = [v for n, v in row.items() if n > L]
    return float(torch.tensor(vals, dtype=torch.float64).log().mean().exp()) if vals else float("nan")


def check_expectations(ppl: Mapping[str, Mapping[int, float]], L: int, bigram_ppl: float,
                       pretrain_complete: bool = True) -> list[dict[str, Any]]:
    """The paper's expectations (`EXPECTATIONS`) checked on a perplexity-by-length table.

    Args:
        ppl: ``{row: {length: perplexity}}`` with rows ``"rope"``, ``"drope zero-shot"``,
            ``"drope"`` (recalibrated) and any ``"<law> zero-shot"`` / ``"<law> fine-tuned"``.
        L: the training length (a key of every row).
        bigram_ppl: a byte bigram's perplexity: a RoPE model that does not beat it at L has learned
            too little for any verdict.
        pretrain_complete: False when pre-training stopped short (no verdict either).

    Returns:
        One ``{"id", "expectation", "source", "verdict": "held" | "not held" | "no verdict",
        "measured"}`` per expectation.
    """
    rope_L = ppl["rope"][L]
    why_none = (None if pretrain_complete else "pre-training stopped short")
    if why_none is None and not rope_L < bigram_ppl:
        why_none = f"rope at L ({rope_L:.3f}) does not beat a byte bigram ({bigram_ppl:.3f}): not learned"
    drop, drope = ppl["drope zero-shot"], ppl["drope"]
    scaling = {k: _beyond(v, L) for k, v in ppl.items() if k not in ("rope", "drope", "drope zero-shot")}
    d_beyond = _beyond(drope, L)
    measured = {
        "drop_hurts": (drop[L] > rope_L, f"at L: drope zero-shot {drop[L]:.3f} vs rope {rope_L:.3f}"),
        "recal_recovers": (drope[L] <= 1.05 * rope_L, (f"at L: drope {drope[L]:.3f} vs rope {rope_L:.3f} "
                                                       f"({100 * (drope[L] / rope_L - 1):+.1f}%)")),
        "beats_scaling": (bool(scaling) and all(d_beyond < v for v in scaling.values()),
                          f"beyond L (geometric mean): drope {d_beyond:.3f}; "
                          + ", ".join(f"{k} {v:.3f}" for k, v in scaling.items())),
    }
    out = []
    for key, text in EXPECTATIONS:
        held, numbers = measured[key]
        verdict = "no verdict" if why_none else ("held" if held else "not held")
        out.append({"id": key, "expectation": text, "source": SOURCE, "verdict": verdict,
                    "measured": numbers + (f"; {why_none}" if why_none else "")})
    return out
