"""Which tokens of a sequence each context-parallel rank holds: PyTorch's head-tail load balancer.

A sequence of ``N`` tokens is cut into ``2 * size`` equal chunks of ``c = N / (2 * size)``; rank
``r`` holds chunk ``r`` (its head) and chunk ``2 * size - 1 - r`` (its tail), so that under a
causal mask every rank attends to the same number of (query, key) pairs (Llama 3's context
parallelism, and ``torch.distributed.tensor.experimental``'s ``_HeadTailLoadBalancer``, whose
indices are used here).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor


def check_length(n: int, size: int, arg: str = "sequence length") -> None:
    """Raise a ValueError unless ``n`` splits into ``2 * size`` equal chunks."""
    if n % (2 * size):
        raise ValueError(f"{arg} {n} is not divisible by 2 x context-parallel size = {2 * size}: each rank "
                         f"holds a head and a tail chunk of equal length (causal load balancing); use a "
                         f"length that is a multiple of {2 * size} (e.g. {(n // (2 * size) + 1) * 2 * size})")


@functools.lru_cache(maxsize=64)
def _indices(n: int, size: int) -> tuple[Tensor, Tensor]:
    """(rearrange, restore) for ``n`` tokens over ``size`` ranks: ``x[rearrange]`` lists every
    rank's tokens in rank order, ``x[rearrange][restore] == x``."""
    from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer

    balancer = _HeadTailLoadBalancer(n, size, torch.device("cpu"))
    rearrange = balancer._generate_indices(restore=False).reshape(-1)
    restore = balancer._generate_indices(restore=True).reshape(-1)
    return rearrange, restore


@dataclass(frozen=True)
class ShardLayout:
    """The head-tail layout of ``n_global`` tokens over ``size`` ranks, seen from rank ``rank``.

    Args:
        n_global: the full sequence length (a multiple of ``2 * size``).
        size: ranks in the context-parallel group.
        rank: this rank's index in the group.
    """

    n_global: int
    size: int
    rank: int

    def __post_init__(self) -> None:
        check_length(self.n_global, self.size)

    @classmethod
    def from_local(cls, n_local: int, size: int, rank: int) -> ShardLayout:
        """The layout whose shards hold ``n_local`` tokens each."""
        return cls(n_local * size, size, rank)

    @property
    def chunk(self) -> int:
        return self.n_global // (2 * self.size)

    @property
    def n_local(self) -> int:
        return 2 * self.chunk

    @property
    def starts(self) -> tuple[int, int]:
        """Global index of this rank's head and tail chunks' first tokens."""
        return self.rank * self.chunk, (2 * self.size - 1 - self.rank) * self.chunk

    def token_indices(self, device: torch.device | None = None) -> Tensor:
        """Global indices ``[n_local]`` of this rank's tokens, head then tail."""
        rearrange, _ = _indices(self.n_global, self.size)
        return rearrange[self.rank * self.n_local:(self.rank + 1) * self.n_local].to(device)

    def restore_indices(self, device: torch.device | None = None) -> Tensor:
        """``gathered[:, restore]`` puts the concatenation of every rank's shard (rank order) back
        into sequence order."""
        return _indices(self.n_global, self.size)[1].to(device)

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's tokens of a full-sequence tensor (``x.shape[dim] == n_global``)."""
        if x.shape[dim] != self.n_global:
            raise ValueError(f"shard: expected {self.n_global} tokens along dim {dim}, got shape {tuple(x.shape)}")
        return x.index_select(dim, self.token_indices(x.device))

    def unshard(self, gathered: Tensor, dim: int = 1) -> Tensor:
        """Sequence order from every rank's shard concatenated in rank order along ``dim``."""
        return gathered.index_select(dim, self.restore_indices(gathered.device))
