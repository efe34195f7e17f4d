"""Which keys each query may see: causal order, packed documents, padding.

Causality is by *index* in the attended sequence (cached keys come first), never by position:
positions only feed the encodings, so packed documents (positions restarting at 0) and
KV-cache offsets need no special case. Packed documents are separated by ``segment_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(eq=False)
class AttentionMask:
    causal: bool
    q_offset: int  # index of the first query among the keys (the cache length)
    n_q: int
    n_k: int
    q_segments: Tensor | None = None  # [B, Nq]
    k_segments: Tensor | None = None  # [B, Nk]
    k_valid: Tensor | None = None  # [B, Nk] bool, False = padding

    @property
    def is_trivial(self) -> bool:
        return not self.causal and self.q_segments is None and self.k_valid is None

    @property
    def is_plain_causal(self) -> bool:
        """Square causal mask with nothing else (SDPA's ``is_causal`` fast path)."""
        return (self.causal and self.q_offset == 0 and self.n_q == self.n_k
                and self.q_segments is None and self.k_valid is None)

    def materialize(self, device: torch.device) -> Tensor | None:
        """bool ``[B|1, 1, Nq, Nk]``, True where attention is allowed; None if all allowed."""
        if self.is_trivial:
            return None
        m = torch.ones(1, 1, self.n_q, self.n_k, dtype=torch.bool, device=device)
        if self.causal:
            qi = torch.arange(self.n_q, device=device)[:, None] + self.q_offset
            kj = torch.arange(self.n_k, device=device)[None, :]
            m = m & (kj <= qi)
        if self.q_segments is not None:
            ks = self.k_segments if self.k_segments is not None else self.q_segments
            m = m & (self.q_segments[:, None, :, None] == ks[:, None, None, :])
        if self.k_valid is not None:
            m = m & self.k_valid[:, None, None, :]
        return m
