"""Every encoding family; importing this package registers them all."""

from posenc_lightning.encodings import absolute, alibi, relative_bias, rope  # noqa: F401  (register)
from posenc_lightning.encodings.base import (
    AttentionContext, Bias, BiasSum, DecayBias, DenseBias, Encoding, LinearBias, RelativeBias,
)
from posenc_lightning.encodings.registry import available_encodings, build_encoding, register

__all__ = ["AttentionContext", "Bias", "BiasSum", "DecayBias", "DenseBias", "Encoding", "LinearBias",
           "RelativeBias", "available_encodings", "build_encoding", "register"]
