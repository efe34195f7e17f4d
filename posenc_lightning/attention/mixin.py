"""The two mixins a user's modules inherit to receive an injected encoding."""

from __future__ import annotations

import torch
from torch import Tensor

from posenc_lightning.attention.backends import resolve_backend
from posenc_lightning.attention.kv_cache import LayerKVCache
from posenc_lightning.attention.mask import AttentionMask, local_kinds
from posenc_lightning.attention.pipeline import context, fused_rotary, run_stages
from posenc_lightning.attention.validate import check_attend, check_embed
from posenc_lightning.encodings.base import Encoding
from posenc_lightning.functional.positions import arange_offset
from posenc_lightning.functional.tunables import Tunables
from posenc_lightning.parallel.group import ContextParallelGroup


class _NoEncoding(Encoding):
    """What attention runs with when no encoding is injected: the base class implements no
    stage, so `attend` is plain attention (SDPA on ``auto``)."""

    name = "nope"


#: one shared instance: nothing is built per call
NO_ENCODING: Encoding = _NoEncoding()


def default_positions(batch: int, n: int, offset: int, device: torch.device) -> Tensor:
    return torch.arange(offset, offset + n, device=device).expand(batch, n)


class PosEncAttentionMixin:
    """Inherit it in your attention module, declare ``n_heads`` and ``head_dim``, and call
    `attend` instead of your softmax(QK^T)V. With nothing injected it is plain SDPA attention.
    """

    n_heads: int
    head_dim: int
    posenc_backend: str = "auto"
    #: the backends' block budgets and switches for this module's calls (None: the defaults)
    posenc_tunables: Tunables | None = None
    #: rotate q, k again in backward instead of keeping the rotated copies (`attention.recompute`)
    posenc_recompute_rotation: bool = True
    #: the context-parallel group this module's calls shard over, or None; set around the batches
    #: that run sharded (`parallel.group.engaged`, `ContextParallel`)
    posenc_context_parallel: ContextParallelGroup | None = None
    #: this layer's sliding window W (key j visible to query i iff 0 <= i - j < W) or chunk C
    #: (i // C == j // C, causal), by index; set by `inject` from a `LayerSchedule` (None: global)
    posenc_window: int | None = None
    posenc_chunk: int | None = None

    @property
    def encoding(self) -> Encoding | None:
        return getattr(self, "posenc", None)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None = None, causal: bool = True,
               hidden: Tensor | None = None, cache: LayerKVCache | None = None,
               segment_ids: Tensor | None = None, key_padding_mask: Tensor | None = None) -> Tensor:
        """Attention with the injected encoding's stages 2-4.

        Args:
            q: ``[B, H, Nq, D]`` queries of the new tokens.
            k: ``[B, Hkv, Nq, D]`` keys of the new tokens (un-rotated; the cache holds the earlier ones).
            v: ``[B, Hkv, Nq, D]`` values of the new tokens.
            positions: ``[B, Nq]`` integer (or float) positions of the new tokens, ``[B, Nq, 2]``
                for 2-D encodings; default ``arange`` after what the cache holds.
            causal: causal mask by order in the sequence (cached keys come first).
            hidden: the layer input ``[B, Nq, d_model]``, for content-dependent encodings (fox).
            cache: this layer's `LayerKVCache` for incremental decoding.
            segment_ids: ``[B, Nq]`` document ids of a packed batch; attention stays inside a document.
            key_padding_mask: ``[B, Nk]`` bool, False for padding keys.

        Returns:
            ``[B, H, Nq, D]``: the attention output of the new tokens.
        """
        enc = self.encoding or NO_ENCODING
        check_attend(enc, q, k, v, positions, hidden, cache, segment_ids, key_padding_mask)
        b, _, n, _ = q.shape
        offset = cache.seen if cache is not None else 0  # the first new token's index
        start = None  # positions known to be start + arange(n) in every row (`AttentionContext`)
        group = self.posenc_context_parallel if cache is None else None  # q, k, v: this rank's shard
        if positions is None:
            if enc.position_dims != 1:
                raise ValueError(f"{enc.name} needs explicit positions of shape [B, N, {enc.position_dims}]")
            if group is not None:  # the shard's true global positions; the full sequence is arange
                positions, start = group.positions(b, n, q.device), 0
            else:
                positions, start = default_positions(b, n, offset, q.device), offset
        elif positions.dim() == 1:
            positions = positions.expand(b, -1)
        want = 2 if enc.position_dims == 1 else 3
        # encodings with ``accepts_nd_positions`` (rope_2d, liere, comrope) take [B, N] or [B, N, k]
        if positions.dim() != want and not (positions.dim() == 3 and enc.accepts_nd_positions):
            raise ValueError(f"{enc.name}: positions must be [B, N]{'' if want == 2 else ', 2'} "
                             f"(got shape {tuple(positions.shape)})")
        if enc.requires_hidden and hidden is None:
            raise ValueError(f"{enc.name} is content-dependent: pass hidden=<layer input> to attend()")
        # under context parallelism ``start`` describes the whole sequence's positions, not the shard's
        shard_start, start = (start, None) if group is not None else (None, start)
        if start is None and positions.dim() == 2 and group is None:
            start = arange_offset(positions)  # a look at the values only where that is free
        enc.check_positions(positions, start)
        window, chunk = self.posenc_window, self.posenc_chunk
        if (window is not None or chunk is not None) and not causal:
            raise ValueError(f"{type(self).__name__} has a sliding window or chunk (posenc_window={window}, "
                             f"posenc_chunk={chunk}), which is causal: call attend(..., causal=True)")
        local = local_kinds(window, chunk)
        requires_grad = torch.is_grad_enabled() and (q.requires_grad or any(p.requires_grad for p in enc.parameters()))
        backend = resolve_backend(self.posenc_backend, enc, q.device, requires_grad, local)
        scale = enc.softmax_scale(q.shape[-1])
        if group is not None:  # this rank's chunks attend to the group's gathered keys
            from posenc_lightning.attention.sharded import sharded_attend

            return sharded_attend(group, self, enc, backend, scale, q, k, v, positions,
                                  causal, hidden, segment_ids, key_padding_mask, positions_start=shard_start,
                                  window=window, chunk=chunk)
        if cache is None:
            ctx = context(enc, backend, positions, positions, causal=causal, hidden=hidden, module=self,
                          q_start=start, k_start=start)
            mask = AttentionMask(causal, 0, n, k.shape[-2], segment_ids, segment_ids, key_padding_mask, window, chunk)
            return run_stages(enc, backend, q, k, v, ctx, mask, scale,
                              recompute=requires_grad and self.posenc_recompute_rotation)
        # a backend that rotates in-kernel (triton) gets un-rotated q, k and the rotary encoding as
        # ``ctx.rotary``: its cache then holds un-rotated keys, as for dynamic encodings
        rotate_later = enc.dynamic or fused_rotary(enc, backend) is not None
        if not rotate_later and "rotate" in enc.stages:  # the cache holds rotated keys
            q, k = enc.rotate(q, k, context(enc, None, positions, positions, causal=causal, hidden=hidden,
                                            cache=cache, module=self, q_start=start, k_start=start))
        if key_padding_mask is not None and cache.dropped:  # given for every key: the dropped ones go
            key_padding_mask = key_padding_mask[:, cache.dropped:]
        held = cache.length  # the mask counts the keys held, the first new one at index `held`
        k, v, k_pos, k_seg = cache.update(k, v, positions, rotated=not rotate_later, segments=segment_ids,
                                          start=start)
        ctx = context(enc, backend, positions, k_pos, causal=causal, hidden=hidden, cache=cache, module=self,
                      q_start=start, k_start=cache.start)
        mask = AttentionMask(causal, held, n, k.shape[-2], segment_ids,
                             k_seg if segment_ids is not None else None, key_padding_mask, window, chunk)
        out = run_stages(enc, backend, q, k, v, ctx, mask, scale, rotated=not rotate_later)
        if (window is not None or chunk is not None) and not enc.dynamic:
            cache.drop(cache.invisible(window, chunk))
        return out


class PosEncEmbeddingMixin:
    """Inherit it in the module that makes token embeddings and call `embed_positions` on its
    output: it applies the injected encoding's stage 1 (sinusoidal, learned), or nothing."""

    d_model: int
    #: as `PosEncAttentionMixin.posenc_context_parallel`
    posenc_context_parallel: ContextParallelGroup | None = None

    @property
    def encoding(self) -> Encoding | None:
        return getattr(self, "posenc", None)

    def embed_positions(self, h: Tensor, positions: Tensor | None = None, offset: int = 0) -> Tensor:
        """Add the injected encoding's position embedding to the token embeddings.

        Args:
            h: ``[B, N, d_model]`` token embeddings.
            positions: ``[B, N]`` positions of the tokens; default ``offset + arange(N)``.
            offset: the first position when ``positions`` is None (tokens already in a cache).

        Returns:
            ``h`` with the encoding's stage 1 applied; ``h`` itself when the encoding has none.
        """
        enc = self.encoding
        if enc is None or "embed" not in enc.stages:
            return h
        check_embed(h, positions, getattr(self, "d_model", None))
        start = None
        group = self.posenc_context_parallel if offset == 0 else None
        if positions is None and group is not None:  # a context-parallel shard: its global positions
            positions = group.positions(h.shape[0], h.shape[1], h.device)
        elif positions is None:
            positions, start = default_positions(h.shape[0], h.shape[1], offset, h.device), offset
        return enc.embed(h, positions, start)
