"""CoPE (Golovneva et al., 2024, "Contextual Position Encoding: Learning to Count What's
Important"), everything it owns: the encoding and its search for clamped keys and bands
(`encoding`), its rows' autograd Functions (`rows`) and its bias kind (`bias`: rows, or the gated
counts the Triton kernels compute in their tile). The formulas are `functional.cope`'s;
the run form's hooks (`Bias.constant_before`, `Bias.rows_past`) are how the generic backends use
its bands (docs/architecture.md)."""

from posenc_lightning.encodings.cope.encoding import CoPE

__all__ = ["CoPE"]
