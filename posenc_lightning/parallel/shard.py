"""The data side of context parallelism: batch sharding, the data-parallel sampler, setup checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from posenc_lightning.parallel.group import ContextParallelGroup


def _first_length(batch: Any) -> int | None:
    if isinstance(batch, Tensor):
        return batch.shape[1] if batch.dim() >= 2 else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for x in items:
        n = _first_length(x)
        if n is not None:
            return n
    return None


def shard_batch(batch: Any, group: ContextParallelGroup) -> Any:
    """This rank's tokens of every ``[B, N, ...]`` tensor in ``batch`` (tensors, or tuples, lists and
    dicts of them): inputs, targets, positions, segment ids, padding masks. ``N`` is the sequence
    length of the batch's first such tensor; tensors of another length pass unchanged.

    Raises:
        ValueError: ``N`` is not divisible by ``2 * group.size``.
    """
    n = _first_length(batch)
    if n is None:
        return batch
    group.check_length(n, "batch sequence length")
    layout = group.layout(n // group.size)

    def cut(x: Any) -> Any:
        if isinstance(x, Tensor):
            return layout.shard(x, 1) if x.dim() >= 2 and x.shape[1] == n else x
        if isinstance(x, dict):
            return type(x)({k: cut(v) for k, v in x.items()}) if type(x) is dict else _set_items(x, cut)
        if isinstance(x, tuple):
            return type(x)(*map(cut, x)) if hasattr(x, "_fields") else tuple(map(cut, x))
        if isinstance(x, list):
            return [cut(v) for v in x]
        return x

    return cut(batch)


def _set_items(mapping: Any, fn: Callable[[Any], Any]) -> Any:
    """Mappings that are not plain dicts (transformers' ``BatchEncoding``): values replaced in place."""
    for k in list(mapping.keys()):
        mapping[k] = fn(mapping[k])
    return mapping


def narrow_sampler(strategy: Any, dp_size: int, dp_rank: int) -> Callable[[], None]:
    """Make the strategy's distributed sampler split the data over the data-parallel axis only
    (``num_replicas = dp_size``, ``rank = dp_rank``): the ranks of a context-parallel group read the
    same samples. Returns the undo."""
    cls = type(strategy)
    kwargs = {"num_replicas": dp_size, "rank": dp_rank}
    narrowed = type(cls.__name__, (cls,), {
        "distributed_sampler_kwargs": property(lambda self: dict(kwargs)),
        "__module__": cls.__module__,
        "__doc__": f"{cls.__name__} whose distributed sampler runs over the data-parallel axis only."})
    strategy.__class__ = narrowed

    def undo() -> None:
        strategy.__class__ = cls

    return undo


def check_shardable(model: nn.Module) -> None:
    """Raise a ValueError naming each attention module of ``model`` that cannot run sharded, and why.

    - an encoding with per-token state beside the keys (``keeps_cache_state``) that does not declare
      ``context_parallel = True`` (it must read the gathered ``ctx.k_hidden``, as FoX does);
    - a Hugging Face attention with a sliding window (the sharded path has no window) or a
      non-causal one (a chunk attends to the keys before it only).
    """
    problems: list[str] = []
    for name, m in model.named_modules():
        enc = getattr(m, "posenc", None)
        if enc is None:
            continue
        if not enc.context_parallel or enc.keeps_cache_state and not _declares(type(enc)):
            problems.append(f"{name or type(m).__name__}: encoding {enc.name!r} cannot run with the keys "
                            f"gathered over the group (context_parallel = False, or per-token state beside "
                            f"the keys, keeps_cache_state, without reading the gathered ctx.k_hidden)")
        if getattr(m, "is_causal", True) is False:
            problems.append(f"{name}: {type(m).__name__} is not causal; context parallelism shards causal "
                            f"attention only")
        cfg = getattr(m, "config", None)
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            problems.append(f"{name}: {type(m).__name__} has a sliding window ({cfg.sliding_window}); "
                            f"the sharded attention has none")
    if problems:
        raise ValueError("ContextParallel: these modules cannot run sharded:\n  " + "\n  ".join(problems))


def _declares(cls: type) -> bool:
    """``cls`` (not the `Encoding` base) sets ``context_parallel`` itself."""
    from posenc_lightning.encodings.base import Encoding

    return any("context_parallel" in vars(c) for c in cls.__mro__ if c is not Encoding)
