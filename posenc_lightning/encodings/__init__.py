"""Every encoding family; importing this package registers them all.

Each family is one module in this package that registers its classes with
``@register(...)``; the modules are discovered here, so adding a family needs no edit.
"""

import importlib
import pkgutil

from posenc_lightning.encodings.base import (
    AttentionContext,
    Bias,
    BiasSum,
    DecayBias,
    DenseBias,
    Encoding,
    LinearBias,
    RelativeBias,
)
from posenc_lightning.encodings.registry import available_encodings, build_encoding, register

for _m in pkgutil.iter_modules(__path__):
    if _m.name not in ("base", "registry") and not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["AttentionContext", "Bias", "BiasSum", "DecayBias", "DenseBias", "Encoding", "LinearBias",
           "RelativeBias", "available_encodings", "build_encoding", "from_hf", "register"]
from posenc_lightning.encodings.hf import from_hf
