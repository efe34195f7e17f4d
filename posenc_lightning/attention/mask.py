"""Which keys each query may see: causal order, packed documents, padding, a local window.

Causality is by *index* in the attended sequence (cached keys come first), never by position:
positions only feed the encodings, so packed documents (positions restarting at 0) and
KV-cache offsets need no special case. Packed documents are separated by ``segment_ids``.

A layer may be local (`LOCAL_KINDS`): a sliding ``window`` W (key j visible to query i iff
``0 <= i - j < W``, Mistral's and Gemma's sliding layers) or a ``chunk`` C (i and j in the same
chunk, ``i // C == j // C``, causal: Llama 4's chunked layers). Both are by index, as causality is,
and both imply causal. A backend declares which of them it honors (``LOCAL_MASKS``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: the local restrictions a mask can carry, each a capability a backend declares (``LOCAL_MASKS``)
LOCAL_KINDS: frozenset[str] = frozenset({"window", "chunk"})
_NONE: frozenset[str] = frozenset()
_WINDOW: frozenset[str] = frozenset({"window"})
_CHUNK: frozenset[str] = frozenset({"chunk"})


def local_kinds(window: int | None, chunk: int | None) -> frozenset[str]:
    """The local kinds a layer with ``window`` and ``chunk`` uses (a subset of `LOCAL_KINDS`)."""
    if window is None:
        return _NONE if chunk is None else _CHUNK
    return _WINDOW if chunk is None else LOCAL_KINDS


@dataclass(eq=False)
class AttentionMask:
    """The keys each query may see, by index (cached keys first; queries start at ``q_offset``)."""

    causal: bool
    q_offset: int  # index of the first query among the keys (the cache length)
    n_q: int
    n_k: int
    q_segments: Tensor | None = None  # [B, Nq]
    k_segments: Tensor | None = None  # [B, Nk]
    k_valid: Tensor | None = None  # [B, Nk] bool, False = padding
    window: int | None = None  # key j visible to query i iff 0 <= i - j < window (by index)
    chunk: int | None = None  # key j visible to query i iff i // chunk == j // chunk and j <= i

    def __post_init__(self) -> None:
        if (self.window is not None or self.chunk is not None) and not self.causal:
            raise ValueError("a sliding window or chunk is causal by definition: pass causal=True, "
                             "or give the layer no window/chunk")

    @property
    def local(self) -> frozenset[str]:
        """The local kinds this mask uses (`LOCAL_KINDS`): what a backend must honor."""
        return local_kinds(self.window, self.chunk)

    def local_allowed(self, qi: Tensor, kj: Tensor) -> Tensor | None:
        """The window and chunk terms at query indices ``qi`` and key indices ``kj`` (broadcast,
        ``qi`` already offset by `q_offset`), True where allowed; None without a window or chunk."""
        m = None
        if self.window is not None:
            m = qi - kj < self.window
        if self.chunk is not None:
            c = torch.div(qi, self.chunk, rounding_mode="floor") == torch.div(kj, self.chunk, rounding_mode="floor")
            m = c if m is None else m & c
        return m

    @property
    def is_trivial(self) -> bool:
        return not self.causal and self.q_segments is None and self.k_valid is None

    @property
    def is_plain_causal(self) -> bool:
        """Square causal mask with nothing else (SDPA's ``is_causal`` fast path)."""
        return (self.causal and self.q_offset == 0 and self.n_q == self.n_k
                and self.q_segments is None and self.k_valid is None and not self.local)

    def materialize(self, device: torch.device) -> Tensor | None:
        """bool ``[B|1, 1, Nq, Nk]``, True where attention is allowed; None if all allowed."""
        if self.is_trivial:
            return None
        m = torch.ones(1, 1, self.n_q, self.n_k, dtype=torch.bool, device=device)
        if self.causal:
            qi = torch.arange(self.n_q, device=device)[:, None] + self.q_offset
            kj = torch.arange(self.n_k, device=device)[None, :]
            m = m & (kj <= qi)
            local = self.local_allowed(qi, kj)
            if local is not None:
                m = m & local
        if self.q_segments is not None:
            ks = self.k_segments if self.k_segments is not None else self.q_segments
            m = m & (self.q_segments[:, None, :, None] == ks[:, None, None, :])
        if self.k_valid is not None:
            m = m & self.k_valid[:, None, None, :]
        return m
