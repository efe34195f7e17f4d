"""The modules the Hugging Face adapter puts in place of a model's own positions."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from posenc_lightning.encodings.base import Encoding


def model_form(cos: Tensor, sin: Tensor, form: str) -> tuple[Tensor, Tensor] | Tensor:
    """``[..., R/2]`` cos and sin as the model's rotary module returns them (`_hf_arch.FORMS`)."""
    if form == "sin_cos_pairs":
        return sin, cos
    if form == "half_cos_sin":
        return cos, sin
    if form == "complex":
        return torch.complex(cos.float(), sin.float())
    if form == "half":
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


class RotaryTable(nn.Module):
    """Stands in for ``model.base_model.rotary_emb``: cos/sin of this project's rotary law in the
    model's form (`model_form`), angles in fp32; one encoding per layer type where the model's
    rope parameters are per layer type (``posenc_<type>``)."""

    def __init__(self, encoding: Encoding, form: str = "half",
                 per_type: dict[str, Encoding] | None = None) -> None:
        super().__init__()
        self.posenc = encoding
        self.form = form
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
        out = model_form(cos, sin, self.form)
        if isinstance(out, Tensor):  # complex: kept in complex64, as the model's own table
            return out.reshape(*pos.shape, -1)
        a, b = out
        return a.reshape(*pos.shape, -1).to(x.dtype), b.reshape(*pos.shape, -1).to(x.dtype)


class NoRotation(nn.Module):
    """Stands in for the rotary module: cos = 1, sin = 0 in the model's form (q and k pass through exactly)."""

    #: plain attributes of the model's module that its model reads (Ergo iterates ``rope_type``'s layer types)
    MIRRORED = ("rope_type", "layer_types")

    def __init__(self, rotary_dim: int, form: str = "half", like: nn.Module | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.form = form
        for name in self.MIRRORED if like is not None else ():
            if name in like.__dict__:
                setattr(self, name, like.__dict__[name])

    def forward(self, x: Tensor, position_ids: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor] | Tensor:
        shape = (*position_ids.shape, self.rotary_dim // 2)
        if self.form == "complex":
            return torch.ones(shape, dtype=torch.complex64, device=x.device)
        one = torch.ones((), dtype=x.dtype, device=x.device).expand(shape)
        return model_form(one, torch.zeros((), dtype=x.dtype, device=x.device).expand(shape), self.form)


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
