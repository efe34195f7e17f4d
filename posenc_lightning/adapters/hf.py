"""Any encoding into a Hugging Face ``transformers`` causal LM, with no change to its code.

Built on transformers' own extension points (>= 5.0; checked on 5.23): the model-level rotary
module (``model.base_model.rotary_emb``), GPT-2's ``wpe``, ``AttentionInterface`` /
``AttentionMaskInterface`` and ``set_attn_implementation``. Two modes, chosen per encoding:

- **table** — a static rotary law (rope, pi, ntk, yarn, llama3, ...) on a RoPE model: the model's
  rotary module is replaced by one that returns this project's cos/sin (fp32 angles, partial
  rotary kept). Nothing else changes; the attention is the user's.
- **attention** — everything else (biases, normalizers, dynamic rotary laws, rotary on a model
  without RoPE): the model's own positions are neutralized (cos = 1, sin = 0; ``wpe`` = 0), so
  q/k (and cached keys) stay un-rotated, and every stage runs inside the attention function
  (`_hf_attention`). The encoding is a submodule of each attention module (``.posenc``): it is in
  ``state_dict``, the optimizer, checkpoints and DDP like any parameter of the model.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from posenc_lightning.adapters import _hf_attention as attn
from posenc_lightning.attention.backends import resolve_backend
from posenc_lightning.encodings.base import Encoding

MIN_VERSION = (5, 0)
ORIGINALS = "_posenc_hf_originals"


def require_transformers() -> None:
    """transformers >= 5.0 (``rope_parameters``, the attention and mask interfaces)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) < MIN_VERSION:
        raise ValueError(f"posenc's Hugging Face adapter needs transformers >= {'.'.join(map(str, MIN_VERSION))} "
                         f"(found {transformers.__version__}): pip install 'transformers>=5,<6'")


def is_hf_model(module: nn.Module) -> bool:
    if "transformers" not in type(module).__module__ and not any(
            "transformers" in c.__module__ for c in type(module).__mro__):
        return False
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)


def find_hf_models(model: nn.Module) -> list[nn.Module]:
    """The outermost ``PreTrainedModel``s at any depth of ``model``."""
    found: list[nn.Module] = []
    inner: set[int] = set()
    for m in model.modules():
        if id(m) in inner or not is_hf_model(m):
            continue
        found.append(m)
        inner.update(id(s) for s in m.modules())
    return found


def attention_modules(hf: nn.Module) -> list[nn.Module]:
    """Self-attention modules: the ones with a ``layer_idx`` whose class calls the attention interface."""
    out = []
    for m in hf.modules():
        if getattr(m, "layer_idx", None) is None or "Attention" not in type(m).__name__:
            continue
        if getattr(m, "is_cross_attention", False):
            continue
        out.append(m)
    return out


def head_dim_of(m: nn.Module, config: Any) -> int:
    for attr in ("head_dim", "head_size"):
        if isinstance(getattr(m, attr, None), int):
            return int(getattr(m, attr))
    return int(config.hidden_size // config.num_attention_heads)


def rope_parameters(config: Any) -> dict[str, Any] | None:
    p = getattr(config, "rope_parameters", None)
    return dict(p) if p else None


def rotary_module(hf: nn.Module) -> nn.Module | None:
    return getattr(hf.base_model, "rotary_emb", None)


def model_defaults(hf: nn.Module) -> dict[str, Any]:
    """Encoding arguments the model implies, used when the user gave none: its RoPE base and
    partial rotary fraction, and its training length as the original length of a scaling law."""
    cfg = hf.config
    out: dict[str, Any] = {}
    p = rope_parameters(cfg) or {}
    if "rope_theta" in p:
        out["theta"] = float(p["rope_theta"])
    if p.get("partial_rotary_factor") is not None:
        out["partial_rotary_factor"] = float(p["partial_rotary_factor"])
    n = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if isinstance(n, int):
        out["original_max_position_embeddings"] = int(p.get("original_max_position_embeddings") or n)
        out["max_seq_len"] = n
    return out


def defaults_for(hf: nn.Module, encoding_cls: type, cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` completed with `model_defaults` for the arguments ``encoding_cls`` takes."""
    params = inspect.signature(encoding_cls.__init__).parameters
    out = dict(cfg)
    implied = model_defaults(hf)
    for key, value in implied.items():
        if key in params and key not in out:
            out[key] = value
    if "max_position_embeddings" in params and "max_position_embeddings" not in out and "factor" in out:
        base = out.get("original_max_position_embeddings", implied.get("original_max_position_embeddings"))
        if base is not None and out["factor"] is not None:
            out["max_position_embeddings"] = round(float(out["factor"]) * int(base))
    return out


# ------------------------------------------------------------------------------------------------
# the modules that replace the model's own positions
# ------------------------------------------------------------------------------------------------
class RotaryTable(nn.Module):
    """Stands in for ``model.base_model.rotary_emb``: cos/sin of this project's rotary law in
    transformers' half layout ``[*position_ids.shape, rotary_dim]``, angles in fp32."""

    def __init__(self, encoding: Encoding) -> None:
        super().__init__()
        self.posenc = encoding

    @torch.no_grad()
    def forward(self, x: Tensor, position_ids: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        pos = position_ids.to(x.device)
        cos, sin = self.posenc.cos_sin(pos if pos.dim() == 2 else pos.reshape(1, -1))
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
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


# ------------------------------------------------------------------------------------------------
# the adapter
# ------------------------------------------------------------------------------------------------
def uses_table(hf: nn.Module, enc: Encoding) -> bool:
    """A static rotary law that transformers' own rotary module can carry (half layout, one
    table for all heads, the model's partial rotary fraction)."""
    from posenc_lightning.encodings.rope import RotaryEncoding

    if rotary_module(hf) is None or not isinstance(enc, RotaryEncoding) or enc.dynamic:
        return False
    # per-head laws (multiscale_rope) need n_heads to give their table
    enc.bind(head_dim=head_dim_of(attention_modules(hf)[0], hf.config), n_heads=int(hf.config.num_attention_heads))
    if enc.stages != frozenset({"rotate"}) or enc.layout != "half" or enc.frequencies_key(None) is None:
        return False
    if type(enc).rotate is not RotaryEncoding.rotate or type(enc).cos_sin is not RotaryEncoding.cos_sin:
        return False
    cos, _ = enc.cos_sin(torch.arange(2)[None])
    inv = rotary_module(hf).inv_freq
    return cos.dim() == 3 and cos.shape[-1] == inv.numel()


def restore(hf: nn.Module) -> None:
    """Undo an earlier adaptation: the original rotary module, ``wpe`` and attention function."""
    orig = getattr(hf, ORIGINALS, None)
    if orig is None:
        return
    if "rotary_emb" in orig:
        hf.base_model.rotary_emb = orig["rotary_emb"]
    if "wpe" in orig:
        hf.base_model.wpe = orig["wpe"]
    for m in attention_modules(hf):
        for h in getattr(m, "_posenc_hooks", []):
            h.remove()
        m._posenc_hooks = []
        if getattr(m, "posenc", None) is not None:
            del m.posenc
        m.posenc = None
    hf.set_attn_implementation(orig["attn_implementation"])
    object.__setattr__(hf, ORIGINALS, None)


def adapt(hf: nn.Module, proto: Encoding, backend: str, share_across_layers: bool,
          copy: Any) -> list[Encoding]:
    """Put ``proto`` into ``hf`` (after `restore`); returns the encodings placed (the first is ``proto``)."""
    require_transformers()
    restore(hf)
    cfg = hf.config
    base = hf.base_model
    rotary = rotary_module(hf)
    wpe = getattr(base, "wpe", None)
    impl = cfg._attn_implementation or "sdpa"
    orig: dict[str, Any] = {"attn_implementation": impl}
    if rotary is not None:
        orig["rotary_emb"] = rotary
    if isinstance(wpe, nn.Embedding):
        orig["wpe"] = wpe
    d_model = int(cfg.hidden_size)
    layers = attention_modules(hf)
    if not layers:
        raise ValueError(f"{type(hf).__name__}: found no self-attention module with a layer_idx; "
                         f"posenc's adapter supports transformers decoder models (Llama, Mistral, Qwen2, "
                         f"GPT-NeoX, GPT-2, Phi, ...)")
    stages = proto.stages
    if "embed" in stages and wpe is None:
        raise ValueError(f"{proto.name} adds positions to the token embeddings (stage 1); {type(hf).__name__} "
                         f"has no position-embedding table (wpe) to carry it. Use a rotary or bias encoding "
                         f"(e.g. 'rope', 'alibi', 'fire') on this model")
    encs: list[Encoding] = []
    if uses_table(hf, proto):
        proto.to(rotary.inv_freq.device)
        base.rotary_emb = RotaryTable(proto)
        encs.append(proto)
    else:
        if rotary is not None:
            base.rotary_emb = NoRotation(2 * rotary.inv_freq.numel())
        if wpe is not None:
            base.wpe = EmbeddingPositions(d_model, proto if "embed" in stages else None)
        attn_stages = stages & {"rotate", "bias", "normalize"}
        for i, m in enumerate(layers if attn_stages else []):
            enc = proto if (share_across_layers or i == 0) else copy(proto)
            enc.bind(n_heads=int(cfg.num_attention_heads), head_dim=head_dim_of(m, cfg), d_model=d_model)
            weight = next(m.parameters())
            enc.to(device=weight.device, dtype=weight.dtype if weight.is_floating_point() else None)
            resolve_backend(backend, enc, weight.device, requires_grad=False)
            m.posenc = enc
            m.posenc_backend = backend
            m._posenc_hooks = [m.register_forward_pre_hook(attn.record_call, with_kwargs=True)]
            encs.append(enc)
        if "embed" in stages:
            proto.bind(d_model=d_model)
            proto.to(device=base.wte.weight.device, dtype=base.wte.weight.dtype)
            base.wpe.posenc = proto
            if proto not in encs:
                encs.insert(0, proto)
        if attn_stages:
            name = attn.register(attn.FUSED if attn_stages - {"rotate"} else impl)
            hf.set_attn_implementation(name)
    object.__setattr__(hf, ORIGINALS, orig)
    return encs or [proto]
