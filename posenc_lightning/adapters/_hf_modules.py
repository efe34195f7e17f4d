"""The modules the Hugging Face adapter puts in place of a model's own positions."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from posenc_lightning.encodings.base import Encoding


def arrange(t: Tensor, layout: str) -> Tensor:
    """``[..., R/2]`` -> ``[..., R]`` in transformers' ``half`` (cat) or ``interleaved`` (repeat) layout."""
    return torch.cat((t, t), dim=-1) if layout == "half" else t.repeat_interleave(2, dim=-1)


class RotaryTable(nn.Module):
    """Stands in for ``model.base_model.rotary_emb``: cos/sin of this project's rotary law in the
    model's layout ``[*position_ids.shape, rotary_dim]``, angles in fp32; one encoding per layer
    type where the model's rope parameters are per layer type (``posenc_<type>``)."""

    def __init__(self, encoding: Encoding, layout: str = "half",
                 per_type: dict[str, Encoding] | None = None) -> None:
        super().__init__()
        self.posenc = encoding
        self.layout = layout
        self.types = list(per_type or {})
        for name, enc in (per_type or {}).items():
            if enc is not encoding:
                self.add_module(f"posenc_{name}", enc)

    def encoding_for(self, layer_type: str | None) -> Encoding:
        if layer_type is None or not self.types or layer_type == self.types[0]:
            return self.posenc
        return getattr(self, f"posenc_{layer_type}")

    @torch.no_grad()
    def forward(self, x: Tensor, position_ids: Tensor, layer_type: str | None = None, *args: Any,
                **kwargs: Any) -> tuple[Tensor, Tensor]:
        pos = position_ids.to(x.device)
        cos, sin = self.encoding_for(layer_type).cos_sin(pos if pos.dim() == 2 else pos.reshape(1, -1))
        cos, sin = arrange(cos, self.layout), arrange(sin, self.layout)
        return cos.reshape(*pos.shape, -1).to(x.dtype), sin.reshape(*pos.shape, -1).to(x.dtype)


class NoRotation(nn.Module):
    """Stands in for the rotary module: cos = 1, sin = 0 (q and k pass through exactly)."""

    def __init__(self, rotary_dim: int) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim

    def forward(self, x: Tensor, position_ids: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        shape = (*position_ids.shape, self.rotary_dim)
        one = torch.ones((), dtype=x.dtype, device=x.device)
        return one.expand(shape), torch.zeros((), dtype=x.dtype, device=x.device).expand(shape)


class EmbeddingPositions(nn.Module):
    """Stands in for GPT-2's ``wpe``: the encoding's stage 1 (sinusoidal, learned) or zero."""

    def __init__(self, d_model: int, encoding: Encoding | None = None) -> None:
        super().__init__()
        self.d_model = d_model
        self.posenc = encoding

    def forward(self, position_ids: Tensor) -> Tensor:
        zeros = torch.zeros((*position_ids.shape, self.d_model), device=position_ids.device)
        if self.posenc is None:
            return zeros
        return self.posenc.embed(zeros, position_ids.expand(position_ids.shape[0], -1))


def zero_table_forward(table: nn.Embedding, *args: Any, **kwargs: Any) -> Tensor:
    """The forward an absolute position table gets while an encoding is injected (OPT's learned
    table with its offset, BioGPT's, BERT's ``position_embeddings``): zeros shaped
    ``[*position_ids.shape, embedding_dim]``, so the injected encoding replaces the positions the
    model adds to its token embeddings, at any position (the table is never indexed)."""
    pos = kwargs.get("position_ids")
    if pos is None:
        pos = next(a for a in args if isinstance(a, Tensor))
    return torch.zeros(*pos.shape, table.embedding_dim, dtype=table.weight.dtype, device=table.weight.device)
