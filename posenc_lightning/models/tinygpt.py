"""TinyGPT: a small decoder-only LightningModule built on the mixins (the reference model)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from posenc_lightning.attention.denormals import call_flushing_denormals
from posenc_lightning.attention.kv_cache import KVCache
from posenc_lightning.attention.mixin import PosEncAttentionMixin, PosEncEmbeddingMixin
from posenc_lightning.encodings.base import Encoding
from posenc_lightning.functional.mode import Mode
from posenc_lightning.inject import inject
from posenc_lightning.models.lm import CausalLMSteps


class TokenEmbedding(nn.Module, PosEncEmbeddingMixin):
    def __init__(self, vocab_size: int, d_model: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.tok = nn.Embedding(vocab_size, d_model)

    def forward(self, input_ids: Tensor, positions: Tensor | None = None, offset: int = 0) -> Tensor:
        return self.embed_positions(self.tok(input_ids), positions, offset)


class CausalSelfAttention(nn.Module, PosEncAttentionMixin):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, (n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, positions: Tensor | None = None, cache: Any = None,
                segment_ids: Tensor | None = None) -> Tensor:
        b, n, _ = x.shape
        hq, hk, d = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([hq * d, hk * d, hk * d], dim=-1)
        q = q.view(b, n, hq, d).transpose(1, 2)
        k = k.view(b, n, hk, d).transpose(1, 2)
        v = v.view(b, n, hk, d).transpose(1, 2)
        y = self.attend(q, k, v, positions=positions, causal=True, hidden=x, cache=cache, segment_ids=segment_ids)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(b, n, hq * d)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, n_kv_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x: Tensor, positions: Tensor | None, cache: Any, segment_ids: Tensor | None) -> Tensor:
        x = x + self.attn(self.ln1(x), positions, cache, segment_ids)
        return x + self.mlp(self.ln2(x))


class TinyGPT(CausalLMSteps, pl.LightningModule):
    """A pre-LayerNorm decoder-only transformer over bytes.

    Batches are ``(input_ids, targets)`` pairs of ``[B, seq_len]`` LongTensors. The encoding
    named here is injected at construction; a `PosEncCallback` replaces it at ``setup``.

    Args:
        vocab_size: 256 for the byte-level corpus.
        d_model: hidden size.
        n_layers: transformer blocks.
        n_heads: attention heads.
        n_kv_heads: key/value heads (< n_heads is GQA; None = n_heads).
        max_seq_len: the training length (also the learned table size when ``encoding="learned"``).
        mlp_ratio: MLP width / d_model.
        dropout: dropout probability.
        encoding: the encoding injected at construction (a registered name; None for none: use a
            PosEncCallback in trainer.callbacks instead).
        encoding_cfg: the encoding's arguments.
        backend: attention backend: auto, eager, sdpa, flex, triton or blockwise.
        lr: AdamW peak learning rate (linear warmup, then cosine decay over trainer.max_steps).
        weight_decay: AdamW weight decay (matrices only).
        warmup_steps: linear warmup steps.
        min_lr_ratio: the cosine decay's floor, as a fraction of lr.
        qkv_init_std: the std of the attention's query/key/value weights at init (None: 0.02, as
            every other weight). At 0.02 the attention logits start near 0 and a recall circuit
            (MQAR's induction head) waits thousands of steps on that plateau; 0.08 (about
            PyTorch's ``nn.Linear`` default at d_model 64) leaves it within ~1000 steps.
        compile: run the forward without a KV cache through ``torch.compile`` (inductor; built on
            the first call, recompiled when the encoding changes); cached decoding stays eager.
            Position tables are sized for ``max_seq_len`` before each compiled call, outside the graph.
    """

    def __init__(self, vocab_size: int = 256, d_model: int = 128, n_layers: int = 4, n_heads: int = 4,
                 n_kv_heads: int | None = None, max_seq_len: int = 1024, mlp_ratio: int = 4,
                 dropout: float = 0.0, encoding: str | None = "rope", encoding_cfg: dict[str, Any] | None = None,
                 backend: str = "auto", lr: float = 3e-3, weight_decay: float = 0.1, warmup_steps: int = 30,
                 min_lr_ratio: float = 0.1, compile: bool = False, qkv_init_std: float | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.max_seq_len = max_seq_len
        self.compile_forward = compile
        self.embed = TokenEmbedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, n_kv_heads, mlp_ratio, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.embed.tok.weight
        self.apply(self._init_weights)
        if qkv_init_std is not None:
            for block in self.blocks:
                nn.init.normal_(block.attn.qkv.weight, std=qkv_init_std)
        if encoding is not None:
            inject(self, encoding, backend=backend, **(encoding_cfg or {}))
        from torchmetrics import MeanMetric

        self.val_nll = MeanMetric()

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    # ---------------------------------------------------------------- FSDP2
    def configure_model(self) -> None:
        """Shard with FSDP2 (`shard`) when the trainer's strategy gives a device mesh (Lightning's
        ``ModelParallelStrategy``); otherwise (and when already sharded) nothing. Lightning calls
        this after the callbacks' ``setup``, so an encoding a `PosEncCallback` injected is sharded too."""
        mesh = self.device_mesh
        if mesh is None or _is_sharded(self):
            return
        self.shard(mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh)

    def shard(self, mesh: Any) -> None:
        """FSDP2 (``fully_shard``) over ``mesh``: every parameter, the encoding's included, becomes
        a DTensor sharded over the mesh on its longest dim (CoPE's ``[1, head_dim, P]`` table has a
        dim 0 of 1), gathered for forward and backward. One unit for the whole model: an encoding
        shared across layers is one module referenced by every block, and per-block units fail
        (block 1 finds block 0's DTensors: "Cannot concatenate overlapping meshes", torch 2.13).
        Override this for another layout (e.g. per-block units with ``share_across_layers=False``)."""
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        def longest_dim(p: nn.Parameter) -> Shard:
            return Shard(max(range(p.dim()), key=lambda d: (p.shape[d], -d)))

        fully_shard(self, mesh=mesh, shard_placement_fn=longest_dim)

    # ---------------------------------------------------------------- model
    def new_cache(self) -> KVCache:
        return KVCache(len(self.blocks))

    def forward(self, input_ids: Tensor, positions: Tensor | None = None, cache: KVCache | None = None,
                segment_ids: Tensor | None = None) -> Tensor:
        if self.compile_forward and cache is None and not Mode.tracing():
            # flush-to-zero is set around the compiled graph (it cannot be set inside it)
            return call_flushing_denormals(self._compiled_forward(), input_ids, positions, None, segment_ids)
        return self._forward(input_ids, positions, cache, segment_ids)

    def _compiled_forward(self) -> Any:
        """`_forward` compiled once per model (not pickled: rebuilt in each process), with the
        encodings' position tables reserved for ``max_seq_len`` first (a table cannot grow
        inside a compiled graph; longer inputs compute their angles in-graph instead)."""
        for m in self.modules():
            if isinstance(m, Encoding):
                m.reserve(self.max_seq_len, self.embed.tok.weight.device)
        fn = self.__dict__.get("_compiled_fn")
        if fn is None:
            fn = self.__dict__["_compiled_fn"] = torch.compile(self._forward)
        return fn

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__() if hasattr(super(), "__getstate__") else dict(self.__dict__)
        state = dict(state)
        state.pop("_compiled_fn", None)
        return state

    def _forward(self, input_ids: Tensor, positions: Tensor | None, cache: KVCache | None,
                 segment_ids: Tensor | None) -> Tensor:
        offset = cache.length if cache is not None else 0
        x = self.embed(input_ids, positions, offset)
        for i, block in enumerate(self.blocks):
            x = block(x, positions, cache[i] if cache is not None else None, segment_ids)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, use_cache: bool = True) -> Tensor:
        """Greedy decoding; with ``use_cache`` only the new token runs through the model."""
        out = input_ids
        cache = self.new_cache() if use_cache else None
        step_in = input_ids
        for _ in range(max_new_tokens):
            logits = self(step_in, cache=cache) if use_cache else self(out)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat((out, nxt), dim=1)
            step_in = nxt
        return out


def _is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)
