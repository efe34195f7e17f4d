from posenc_lightning.attention.denormals import call_flushing_denormals, flush_denormals
from posenc_lightning.attention.kv_cache import KVCache, LayerKVCache
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.attention.mixin import PosEncAttentionMixin, PosEncEmbeddingMixin

__all__ = ["AttentionMask", "KVCache", "LayerKVCache", "PosEncAttentionMixin", "PosEncEmbeddingMixin",
           "call_flushing_denormals", "flush_denormals"]
