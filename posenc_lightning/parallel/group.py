"""The process groups of data x context parallelism and the all-gather that attention uses.

World size ``W = dp * cp``: ranks ``[g * cp, (g + 1) * cp)`` form context-parallel group ``g``
(they hold the same sequences, each a head-tail shard of them), and ranks with the same index in
their group form a data-parallel group (they hold different sequences). The groups are a
``DeviceMesh`` with dims ``("data_parallel", "context_parallel")``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from posenc_lightning.parallel.layout import ShardLayout, check_length


def check_world(world_size: int, size: int) -> None:
    """Raise a ValueError unless ``size`` ranks per context-parallel group divide ``world_size``."""
    if size < 1:
        raise ValueError(f"ContextParallel(size={size}): size must be >= 1")
    if world_size % size:
        raise ValueError(f"ContextParallel(size={size}): the world size {world_size} (devices x nodes) is not "
                         f"divisible by size; use a world size that is a multiple of {size} "
                         f"(data-parallel groups x context-parallel size)")


class ContextParallelGroup:
    """One rank's view of the data x context-parallel groups.

    Args:
        size: ranks per context-parallel group.
        mesh: a ``DeviceMesh`` with a ``"context_parallel"`` dim (and optionally ``"data_parallel"``);
            `from_world` builds one over the default process group.
    """

    def __init__(self, size: int, mesh: Any) -> None:
        self.size = size
        self.mesh = mesh
        self.group = mesh.get_group("context_parallel")
        self.rank = mesh.get_local_rank("context_parallel")
        names = mesh.mesh_dim_names or ()
        self.dp_size = mesh.size(names.index("data_parallel")) if "data_parallel" in names else 1
        self.dp_rank = mesh.get_local_rank("data_parallel") if "data_parallel" in names else 0

    @classmethod
    def from_world(cls, size: int, device_type: str = "cpu") -> ContextParallelGroup:
        """Groups over the initialized default process group (every rank must call this)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("ContextParallel needs an initialized process group (a DDP-style strategy)")
        world = dist.get_world_size()
        check_world(world, size)
        mesh = init_device_mesh(device_type, (world // size, size),
                                mesh_dim_names=("data_parallel", "context_parallel"))
        return cls(size, mesh)

    def layout(self, n_local: int) -> ShardLayout:
        """The head-tail layout of a sequence whose shards hold ``n_local`` tokens."""
        return ShardLayout.from_local(n_local, self.size, self.rank)

    def check_length(self, n: int, arg: str = "sequence length") -> None:
        check_length(n, self.size, arg)

    def positions(self, batch: int, n_local: int, device: torch.device) -> Tensor:
        """The true global positions ``[B, n_local]`` of this rank's tokens."""
        return self.layout(n_local).token_indices(device).expand(batch, n_local)

    def gather(self, x: Tensor, dim: int) -> Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in sequence order (with autograd: the
        backward is a reduce-scatter, so each rank's gradient sums every rank's use of its tokens)."""
        import torch.distributed._functional_collectives as fc

        moved = x.movedim(dim, 0).contiguous()
        if moved.requires_grad:
            out = fc.all_gather_single_autograd(moved, 0, self.group)
        else:
            out = fc.all_gather_single(moved, 0, self.group)
        out = fc.wait_tensor(out) if isinstance(out, fc.AsyncCollectiveTensor) else out
        full = out.movedim(0, dim)
        return self.layout(x.shape[dim]).unshard(full, dim)

    def sum(self, x: Tensor) -> Tensor:
        """``x`` summed over the group's ranks, without autograd (token counts, statistics)."""
        import torch.distributed._functional_collectives as fc

        out = fc.all_reduce(x.detach(), "sum", self.group)
        return fc.wait_tensor(out) if isinstance(out, fc.AsyncCollectiveTensor) else out


def trainer_group(trainer: Any) -> ContextParallelGroup | None:
    """The context-parallel group a callback of ``trainer`` built (`ContextParallel`'s ``group``).

    Read by attribute, so that the curriculum and the evaluation callbacks need not import the
    callback that builds it.

    Args:
        trainer: a Lightning ``Trainer`` (or None).

    Returns:
        The first built `ContextParallelGroup` among the trainer's callbacks, or None.
    """
    for cb in getattr(trainer, "callbacks", None) or ():
        group = getattr(cb, "group", None)
        if isinstance(group, ContextParallelGroup):
            return group
    return None


#: the attribute through which a module's attention calls get the group they shard over: declared
#: (None) by the attention and embedding mixins and `CausalLMSteps`; set on every module of a model,
#: and on the attention modules an encoding was injected into (`posenc`), by `engage`
CONTEXT_PARALLEL = "posenc_context_parallel"


def engage(model: nn.Module, group: ContextParallelGroup | None) -> None:
    """Make ``model``'s attention shard over ``group`` (None: not at all) from now on.

    Args:
        model: the model (its modules that declare `CONTEXT_PARALLEL` or carry an injected encoding
            get the group).
        group: the group, or None to stop sharding.
    """
    for m in model.modules():
        if hasattr(m, CONTEXT_PARALLEL) or isinstance(getattr(m, "posenc", None), nn.Module):
            setattr(m, CONTEXT_PARALLEL, group)


@contextlib.contextmanager
def engaged(model: nn.Module, group: ContextParallelGroup | None) -> Iterator[None]:
    """``model``'s attention (and default positions) run sharded over ``group`` inside the block.

    Args:
        model: the model; group: the group.
    """
    before = [(m, getattr(m, CONTEXT_PARALLEL, None)) for m in model.modules()
              if hasattr(m, CONTEXT_PARALLEL) or isinstance(getattr(m, "posenc", None), nn.Module)]
    engage(model, group)
    try:
        yield
    finally:
        for m, g in before:
            setattr(m, CONTEXT_PARALLEL, g)
