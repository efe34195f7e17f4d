"""FIRE (Li et al., 2024, "Functional Interpolation for Relative Positions Improves Long Context
Transformers"), everything it owns: the encoding (`encoding`), its bias kind `FireBias` (`bias`),
the autograd Functions of its rows (`functions`), their traced and compiled form (`compiled`) and
where it is a function of ``i - j`` (`template`). Its fast paths plug into the `Bias` hooks
(docs/architecture.md, section 3); no generic backend names it."""

from posenc_lightning.encodings.fire.bias import FireBias
from posenc_lightning.encodings.fire.encoding import FIRE

__all__ = ["FIRE", "FireBias"]
