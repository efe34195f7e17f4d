"""``inject(model, encoding)``: build an encoding and hand it to every mixin module, or a
`LayerSchedule` (a preset's name) and hand each attention module its layer's encoding and window."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from posenc_lightning.attention.backends import BACKENDS, resolve_backend
from posenc_lightning.attention.mask import local_kinds
from posenc_lightning.attention.mixin import PosEncAttentionMixin, PosEncEmbeddingMixin
from posenc_lightning.encodings.base import Encoding
from posenc_lightning.encodings.presets import PRESETS, build_preset
from posenc_lightning.encodings.registry import build_encoding, encoding_class
from posenc_lightning.encodings.schedule import LayerSchedule
from posenc_lightning.plain import plain

SPEC_ATTR = "_posenc_spec"
CHECKPOINT_KEY = "posenc_lightning"
#: model attributes that fill an encoding argument of the same name when the user gave none
_FROM_MODEL = ("max_seq_len",)


def _module_device(m: nn.Module) -> torch.device:
    for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
        return t.device
    for t in m.parameters():
        return t.device
    return torch.device("cpu")


def _module_dtype(m: nn.Module) -> torch.dtype | None:
    """The floating dtype of ``m``'s own weights (else its submodules'), None if it has none."""
    for ts in (list(m.parameters(recurse=False)), list(m.parameters())):
        for t in ts:
            if t.is_floating_point():
                return t.dtype
    return None


def _defaults_from_model(model: nn.Module, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(encoding_class(name).__init__).parameters
    out = dict(cfg)
    for key in _FROM_MODEL:
        if key in params and key not in out and isinstance(getattr(model, key, None), int):
            out[key] = getattr(model, key)
    return out


def find_mixin_modules(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    attn = [m for m in model.modules() if isinstance(m, PosEncAttentionMixin)]
    emb = [m for m in model.modules() if isinstance(m, PosEncEmbeddingMixin)]
    return attn, emb


def inject(model: nn.Module, encoding: str | Encoding | LayerSchedule, backend: str = "auto",
           share_across_layers: bool = True, reset: bool = False, **cfg: Any) -> Encoding:
    """Put ``encoding`` into every `PosEncAttentionMixin` / `PosEncEmbeddingMixin` of ``model``.

    A `LayerSchedule` (or a preset's name, `posenc_lightning.encodings.presets`, with its arguments
    as ``cfg``) gives each attention module, in the order ``model.modules()`` walks them, its layer's
    encoding (built per layer; with ``share_across_layers`` the layers of one spec share an
    instance) and its sliding window or chunk (``posenc_window``, ``posenc_chunk``).

    Injecting what is already there (same name, same resolved config, same sharing; or the very
    `Encoding` instance already held) is a no-op that returns the injected encoding with its
    (possibly trained) parameters; when only ``backend`` differs the backend is switched and the
    parameters are kept. Anything else replaces whatever was injected before (all four stages
    together: no table of an earlier encoding stays behind).

    Args:
        model: any ``nn.Module`` whose attention (and optionally embedding) modules use the mixins.
        encoding: a registered name (``posenc list``), an `Encoding` instance, a preset's name or
            a `LayerSchedule`.
        backend: ``auto``, ``eager``, ``sdpa``, ``flex``, ``triton`` or ``blockwise``.
        share_across_layers: one encoding (and its parameters) for every layer, or one per layer.
        reset: build a fresh encoding (new initialisation) even when the same one is injected.
        **cfg: the encoding's ``__init__`` arguments when ``encoding`` is a name.

    Returns:
        The injected encoding (the first layer's when not shared).

    Raises:
        ValueError: an unknown backend or encoding name, or a model with neither a mixin module
            nor a Hugging Face ``PreTrainedModel``.
        TypeError: ``encoding`` is neither a name nor an `Encoding`, or an instance came with
            extra arguments.

    Examples:
        >>> from posenc_lightning.models import TinyGPT
        >>> enc = inject(TinyGPT(d_model=32, n_layers=1, n_heads=2), "alibi")
        >>> enc.name
        'alibi'
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {('auto',) + BACKENDS}")
    cfg = plain(cfg)  # OmegaConf containers (Hydra) as dicts and lists: the spec is compared and saved
    if isinstance(encoding, str) and encoding in PRESETS:
        encoding = build_preset(encoding, **cfg)
        cfg = {}
    if isinstance(encoding, LayerSchedule):
        if cfg:
            raise TypeError(f"got a LayerSchedule and extra arguments {sorted(cfg)}: put them in its rules")
        return _inject_schedule(model, encoding, backend, share_across_layers, reset)
    if not isinstance(encoding, (str, Encoding)):
        raise TypeError(f"encoding must be a name, an Encoding or a LayerSchedule, got {type(encoding).__name__}")
    if isinstance(encoding, Encoding) and cfg:
        raise TypeError(f"got an Encoding instance and extra arguments {sorted(cfg)}: "
                        f"configure the instance itself, or pass its name")
    attn, emb = find_mixin_modules(model)
    models: list[nn.Module] = []
    if not attn and not emb:
        from posenc_lightning.adapters import hf

        models = hf.find_hf_models(model)
        if not models:
            raise ValueError(f"{type(model).__name__} has no module that inherits PosEncAttentionMixin or "
                             f"PosEncEmbeddingMixin, and holds no Hugging Face PreTrainedModel: inherit the "
                             f"mixins in your attention / embedding modules")
    if isinstance(encoding, str) and models and hf.own_schedule(models[0]) is not None:
        # a model whose layers differ (NoPE layers, chunks): the encoding takes the place of the
        # positions of the layers that have them, the others stay as they are (`hf.with_law`)
        encoding_class(encoding)  # an unknown name fails here, naming the registered ones
        return _inject_schedule(model, hf.with_law(models[0], encoding, cfg), backend, share_across_layers, reset)
    if isinstance(encoding, Encoding):
        proto = encoding
    elif models:
        proto = build_encoding(encoding, **hf.defaults_for(models[0], encoding_class(encoding), cfg))
    else:
        proto = build_encoding(encoding, **_defaults_from_model(model, encoding, cfg))
    kept = None if reset else _same_spec(model, proto, share_across_layers, by_name=isinstance(encoding, str))
    if kept is not None:
        return _switch_backend(model, kept, backend)
    if models:
        return _inject_adapted(model, models, proto, backend, share_across_layers)
    _clear(attn, emb)

    stages = proto.stages
    d_model = next((int(m.d_model) for m in emb if getattr(m, "d_model", None)), None)
    if d_model is None:
        d_model = next((int(m.d_model) for m in attn if getattr(m, "d_model", None)), None)

    encs: list[Encoding] = []
    use_attn = bool(stages & {"rotate", "bias", "normalize"})
    for i, m in enumerate(attn if use_attn else []):
        for attr in ("n_heads", "head_dim"):
            if not isinstance(getattr(m, attr, None), int):
                raise ValueError(f"{type(m).__name__} inherits PosEncAttentionMixin but does not declare "  # noqa: TRY004
                                 f"an integer `{attr}` attribute; set self.{attr} in its __init__")
        enc = proto if (share_across_layers or i == 0) else _fresh_copy(proto)
        enc.bind(n_heads=m.n_heads, head_dim=m.head_dim, d_model=d_model)
        enc.to(device=_module_device(m), dtype=_module_dtype(m))
        resolve_backend(backend, enc, _module_device(m), requires_grad=False)
        m.posenc = enc
        m.posenc_backend = backend
        encs.append(enc)
    if "embed" in stages:
        if not emb:
            raise ValueError(f"{proto.name} adds positions to the embeddings (stage 1) but no module of "
                             f"{type(model).__name__} inherits PosEncEmbeddingMixin")
        for m in emb:
            enc = encs[0] if encs else proto
            enc.bind(d_model=int(getattr(m, "d_model", d_model) or d_model))
            enc.to(device=_module_device(m), dtype=_module_dtype(m))
            m.posenc = enc
            encs.append(enc)
    if not encs:
        encs.append(proto)
    setattr(model, SPEC_ATTR, _spec(proto, backend, share_across_layers))
    return encs[0]


def _clear(attn: list[nn.Module], emb: list[nn.Module]) -> None:
    """Remove every injected encoding and window (an injection replaces all of them)."""
    for m in attn + emb:
        if getattr(m, "posenc", None) is not None:
            del m.posenc
        m.posenc = None
    for m in attn:
        m.posenc_window = m.posenc_chunk = None


def _inject_schedule(model: nn.Module, schedule: LayerSchedule, backend: str, share_across_layers: bool,
                     reset: bool) -> Encoding:
    """`inject` of a `LayerSchedule`: each attention module its layer's encoding and window."""
    attn, emb = find_mixin_modules(model)
    spec = {"encoding": schedule.name, "schedule": schedule.to_dict(), "backend": backend,
            "share_across_layers": share_across_layers}
    held = injected_spec(model)
    same = not reset and held is not None and _normalized({**held, "backend": backend}) == _normalized(spec)
    if not attn:
        from posenc_lightning.adapters import hf

        models = hf.find_hf_models(model)
        if not models:
            raise ValueError(f"a layer schedule needs attention modules that inherit PosEncAttentionMixin, or a "
                             f"Hugging Face PreTrainedModel; {type(model).__name__} has neither")
        if same:
            return _switch_backend(model, next(m.posenc for m in model.modules()
                                               if isinstance(getattr(m, "posenc", None), Encoding)), backend)
        first = None
        for m in models:
            placed = hf.adapt_schedule(m, schedule, backend, share_across_layers)
            first = first or placed[0]
            if m is not model:
                setattr(m, SPEC_ATTR, spec)
        setattr(model, SPEC_ATTR, spec)
        return first
    layers = schedule.resolve(len(attn), getattr(model, "layer_types", None))
    if same:
        return _switch_backend(model, attn[0].posenc, backend)
    _clear(attn, emb)
    d_model = next((int(m.d_model) for m in emb + attn if getattr(m, "d_model", None)), None)
    built: dict[Any, Encoding] = {}
    first: Encoding | None = None
    for i, (m, layer) in enumerate(zip(attn, layers)):
        key = layer.key()
        enc = built.get(key) if share_across_layers else None
        if enc is None:
            enc = build_encoding(layer.encoding, **_defaults_from_model(model, layer.encoding, layer.config))
            if "embed" in enc.stages:
                raise ValueError(f"layer {i}: {layer.encoding} adds positions to the embeddings (stage 1), "
                                 f"which is not per layer; schedule attention encodings only")
            for attr in ("n_heads", "head_dim"):
                if not isinstance(getattr(m, attr, None), int):
                    raise ValueError(f"{type(m).__name__} inherits PosEncAttentionMixin but does not declare "  # noqa: TRY004
                                     f"an integer `{attr}` attribute; set self.{attr} in its __init__")
            enc.bind(n_heads=m.n_heads, head_dim=m.head_dim, d_model=d_model)
            enc.to(device=_module_device(m), dtype=_module_dtype(m))
            built[key] = enc
        resolve_backend(backend, enc, _module_device(m), False, local_kinds(layer.window, layer.chunk))
        m.posenc, m.posenc_backend = enc, backend
        m.posenc_window, m.posenc_chunk = layer.window, layer.chunk
        first = first or enc
    setattr(model, SPEC_ATTR, spec)
    return first


def _inject_adapted(model: nn.Module, models: list[nn.Module], proto: Encoding, backend: str,
                    share_across_layers: bool) -> Encoding:
    """`inject` into Hugging Face models found inside ``model`` (`posenc_lightning.adapters.hf`)."""
    from posenc_lightning.adapters import hf

    first: Encoding | None = None
    for i, m in enumerate(models):
        encs = hf.adapt(m, proto if i == 0 else _fresh_copy(proto), backend, share_across_layers, _fresh_copy)
        first = first or encs[0]
        if m is not model:
            setattr(m, SPEC_ATTR, _spec(encs[0], backend, share_across_layers))
    setattr(model, SPEC_ATTR, _spec(first, backend, share_across_layers))
    return first


def _spec(proto: Encoding, backend: str, share_across_layers: bool) -> dict[str, Any]:
    return {"encoding": proto.name, "config": proto.config(), "backend": backend,
            "share_across_layers": share_across_layers}


def _normalized(v: Any) -> Any:
    """Config values as a checkpoint or YAML round trip may give them back (tuples as lists)."""
    if isinstance(v, (list, tuple)):
        return [_normalized(x) for x in v]
    if isinstance(v, dict):
        return {k: _normalized(x) for k, x in v.items()}
    return v


def _same_spec(model: nn.Module, proto: Encoding, share_across_layers: bool, by_name: bool) -> Encoding | None:
    """The encoding ``model`` already holds when ``proto`` is the same spec, else None: the same
    instance, or (``by_name``: the user gave a name) the same name, resolved config and sharing."""
    held = [m.posenc for m in model.modules() if isinstance(getattr(m, "posenc", None), Encoding)]
    spec = injected_spec(model)
    if not held or spec is None or "schedule" in spec:
        return None
    if any(h is proto for h in held):
        return held[0]
    if by_name and spec.get("encoding") == proto.name \
            and spec.get("share_across_layers", True) == share_across_layers \
            and _normalized(spec.get("config", {})) == _normalized(proto.config()) \
            and all(type(h) is type(proto) for h in held):
        return held[0]
    return None


def _switch_backend(model: nn.Module, enc: Encoding, backend: str) -> Encoding:
    """Keep ``enc`` (and its parameters); point the attention modules at ``backend``."""
    spec = injected_spec(model)
    if spec.get("backend") == backend:
        return enc
    attn = [m for m in model.modules() if isinstance(getattr(m, "posenc", None), Encoding)
            and not isinstance(m, PosEncEmbeddingMixin)]
    for m in attn:
        resolve_backend(backend, m.posenc, _module_device(m), False,
                        local_kinds(getattr(m, "posenc_window", None), getattr(m, "posenc_chunk", None)))
    for m in attn:
        m.posenc_backend = backend
    setattr(model, SPEC_ATTR, {**spec, "backend": backend})
    return enc


def _fresh_copy(proto: Encoding) -> Encoding:
    """A new instance with the same arguments (own parameters, own initialisation)."""
    if hasattr(proto, "_init_args"):
        fresh = type(proto)(**proto._init_args)
        for attr in ("n_heads", "head_dim", "d_model"):
            if getattr(fresh, attr) is None and getattr(proto, attr) is not None:
                setattr(fresh, attr, getattr(proto, attr))
        return fresh
    return proto.replicate()


def injected_spec(model: nn.Module) -> dict[str, Any] | None:
    """What `inject` last put into ``model``.

    Args:
        model: a module `inject` (or `PosEncCallback`) was given.

    Returns:
        ``{"encoding", "config", "backend", "share_across_layers"}`` (a schedule: ``"schedule"``,
        its `LayerSchedule.to_dict`, in place of ``"config"``), or None when nothing was injected.
    """
    return getattr(model, SPEC_ATTR, None)


def restore_from_checkpoint(model: nn.Module, checkpoint: dict[str, Any]) -> Encoding | None:
    """Re-inject the encoding a checkpoint was saved with.

    Call it in your module's ``on_load_checkpoint``: Lightning runs that hook before loading the
    state dict, so the encoding's parameters exist when their values arrive.

    Args:
        model: the module being restored.
        checkpoint: the checkpoint dict Lightning passes to ``on_load_checkpoint``.

    Returns:
        The re-injected encoding, or None when the checkpoint has none or ``model`` already holds it.
    """
    spec = checkpoint.get(CHECKPOINT_KEY)
    if not spec:
        return None
    if injected_spec(model) == spec:
        return None
    if "schedule" in spec:
        return inject(model, LayerSchedule.from_dict(spec["schedule"]), backend=spec.get("backend", "auto"),
                      share_across_layers=spec.get("share_across_layers", True))
    return inject(model, spec["encoding"], backend=spec.get("backend", "auto"),
                  share_across_layers=spec.get("share_across_layers", True), **spec.get("config", {}))
