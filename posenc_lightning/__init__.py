"""posenc-lightning: inject any transformer positional encoding into a LightningModule."""

from posenc_lightning.attention import (
    KVCache,
    LayerKVCache,
    PosEncAttentionMixin,
    PosEncEmbeddingMixin,
    call_flushing_denormals,
    flush_denormals,
)
from posenc_lightning.encodings import (
    Bias,
    BiasSum,
    DecayBias,
    DenseBias,
    Encoding,
    LinearBias,
    RelativeBias,
    available_encodings,
    build_encoding,
)
from posenc_lightning.encodings.presets import available_presets, build_preset
from posenc_lightning.encodings.schedule import LayerSchedule, LayerSpec
from posenc_lightning.inject import inject, injected_spec, restore_from_checkpoint

__version__ = "0.1.0"

_CALLBACKS = ("ContextCurriculum", "ContextParallel", "LMEvalCallback", "LengthEvalCallback", "PosEncCallback",
              "PosEncVisualizer", "Stage", "TaskEvalCallback")


def __getattr__(name: str):
    """The callbacks import Lightning (seconds): load them on first use, so ``inject`` stays fast."""
    if name in _CALLBACKS:
        from posenc_lightning import callbacks

        return getattr(callbacks, name)
    raise AttributeError(f"module 'posenc_lightning' has no attribute {name!r}")

__all__ = [
    "Bias",
    "BiasSum",
    "ContextCurriculum",
    "ContextParallel",
    "DecayBias",
    "DenseBias",
    "Encoding",
    "KVCache",
    "LMEvalCallback",
    "LayerKVCache",
    "LayerSchedule",
    "LayerSpec",
    "LengthEvalCallback",
    "LinearBias",
    "PosEncAttentionMixin",
    "PosEncCallback",
    "PosEncEmbeddingMixin",
    "PosEncVisualizer",
    "RelativeBias",
    "Stage",
    "TaskEvalCallback",
    "available_encodings",
    "available_presets",
    "build_encoding",
    "build_preset",
    "call_flushing_denormals",
    "flush_denormals",
    "inject",
    "injected_spec",
    "restore_from_checkpoint",
]
