"""Pure positional-encoding math: no ``nn.Module``, the papers' names."""

from posenc_lightning.functional.alibi import alibi_slopes
from posenc_lightning.functional.rope import apply_rotary, rope_angles, rope_cos_sin, rope_inv_freq, rotate_half
from posenc_lightning.functional.sinusoidal import sinusoidal_table
from posenc_lightning.functional.t5 import t5_relative_position_bucket

__all__ = ["alibi_slopes", "apply_rotary", "rope_angles", "rope_cos_sin", "rope_inv_freq",
           "rotate_half", "sinusoidal_table", "t5_relative_position_bucket"]
