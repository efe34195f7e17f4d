from posenc_lightning.models.tinygpt import CausalSelfAttention, TinyGPT, TokenEmbedding

__all__ = ["CausalSelfAttention", "TinyGPT", "TokenEmbedding"]
