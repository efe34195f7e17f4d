import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def shard_key(item: pytest.Item) -> str:
    """What keeps GPU tests together in one shard: a conformance case's encoding (its kernel
    variants are compiled once, in one process), else the test itself."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return f"encoding:{params['name']}" if "name" in params and "conformance" in item.nodeid else item.nodeid


#: the order a conformance case's backend runs in: the default paths first, so that a suite cut at
#: its deadline has proven them (flex's compilations are the slowest)
BACKEND_RANK = {"sdpa": 0, "blockwise": 0, "triton": 1, "flex": 2}


def _rank(item: pytest.Item) -> int:
    params = getattr(getattr(item, "callspec", None), "params", {})
    ours = "conformance" in item.nodeid and HERE in Path(str(item.path)).resolve().parents
    return BACKEND_RANK.get(params.get("backend"), 0) if ours else 0


def pytest_collection_modifyitems(config, items):
    """``POSENC_GPU_SHARD=i/n`` keeps the i-th of n shards of the GPU tests (benchmarks/gpu_suite.py
    runs the shards side by side, so the Triton compilations spread over the CPU cores); the
    conformance cases run by backend (`BACKEND_RANK`)."""
    items.sort(key=_rank)  # stable: collection order within a rank
    shard = os.environ.get("POSENC_GPU_SHARD")
    if not shard:
        return
    i, n = (int(x) for x in shard.split("/"))
    mine = [it for it in items if HERE in Path(str(it.path)).resolve().parents]
    keys = sorted({shard_key(it) for it in mine})
    keep = {k for j, k in enumerate(keys) if j % n == i}
    drop = [it for it in mine if shard_key(it) not in keep]
    if drop:
        config.hook.pytest_deselected(items=drop)
        dropped = set(map(id, drop))
        items[:] = [it for it in items if id(it) not in dropped]


@pytest.fixture(autouse=True)
def _dynamo_fails_instead_of_falling_back():
    """The GPU tests compile many small graphs (flex's ``score_mod`` per encoding, dtype and mask):
    a compiled function past dynamo's recompile limit would silently run eagerly, so the limit is
    raised and hitting it is an error (the compiled path is what these tests are about)."""
    with torch._dynamo.config.patch(recompile_limit=512, accumulated_recompile_limit=8192,
                                    fail_on_recompile_limit_hit=True):
        yield
