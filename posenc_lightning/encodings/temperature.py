"""``log_temperature``: Llama 4's query temperature of its NoPE layers (`functional.temperature`)."""

from __future__ import annotations

from torch import Tensor

from posenc_lightning.encodings.base import AttentionContext, Encoding
from posenc_lightning.encodings.registry import register
from posenc_lightning.functional.temperature import log_temperature


@register("log_temperature", "rotate", "NoPE with Llama 4's query temperature log(floor((pos+1)/s)+1)*a+1 "
          "(Meta, Llama 4, 2025)")
class LogTemperature(Encoding):
    """No rotation; the queries are scaled by ``log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1``
    (Llama 4's ``attn_temperature_tuning`` in the layers without RoPE; the `irope` preset's global
    layers). The keys are unchanged, so a KV cache holds them as they are.

    Args:
        floor_scale: positions per step of the scale (Llama 4: 8192).
        attn_scale: the scale's slope per log step (Llama 4: 0.1).
    """

    def __init__(self, floor_scale: float = 8192.0, attn_scale: float = 0.1) -> None:
        super().__init__()
        if floor_scale <= 0:
            raise ValueError(f"log_temperature: floor_scale must be positive, got {floor_scale}")
        self.floor_scale = float(floor_scale)
        self.attn_scale = float(attn_scale)

    def rotate(self, q: Tensor, k: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        if ctx.q_pos.dim() != 2:
            raise ValueError(f"log_temperature takes [B, N] positions, got {tuple(ctx.q_pos.shape)}")
        scale = log_temperature(ctx.q_pos, self.floor_scale, self.attn_scale)  # [B, Nq]
        return (q * scale[:, None, :, None]).to(q.dtype), k
