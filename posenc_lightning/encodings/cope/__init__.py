"""CoPE (Golovneva et al., 2024, "Contextual Position Encoding: Learning to Count What's
Important"), everything it owns: the encoding and its search for clamped keys and bands
(`encoding`), and its rows' autograd Functions (`rows`). The formulas are `functional.cope`'s;
the run form's hooks (`Bias.constant_before`, `Bias.rows_past`) are how the generic backends use
its bands (docs/architecture.md)."""

from posenc_lightning.encodings.cope.encoding import CoPE

__all__ = ["CoPE"]
