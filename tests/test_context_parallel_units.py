"""The pure pieces of context parallelism (issue 27), in one process: the head-tail layout, the
SDPA backend's mask-only rows (a causal offset without a bias, as every context-parallel chunk
has) against the eager reference forward and backward, and ``posenc run --context-parallel``."""

from __future__ import annotations

import pytest
import torch

from posenc_lightning.attention.backends import eager, sdpa
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.functional.tunables import Tunables
from posenc_lightning.parallel.layout import ShardLayout
from tests.helpers import run_posenc


@pytest.mark.parametrize("n, size", [(8, 1), (12, 3), (32, 2), (40, 4)])
def test_layout_is_head_and_tail_chunks_and_unshards(n, size):
    c = n // (2 * size)
    shards = [ShardLayout(n, size, r) for r in range(size)]
    for r, lay in enumerate(shards):
        want = list(range(r * c, (r + 1) * c)) + list(range((2 * size - 1 - r) * c, (2 * size - r) * c))
        assert lay.token_indices().tolist() == want and lay.starts == (r * c, (2 * size - 1 - r) * c)
    x = torch.arange(3 * n).view(3, n)
    gathered = torch.cat([lay.shard(x) for lay in shards], dim=1)  # rank order, as an all-gather gives
    assert torch.equal(shards[0].unshard(gathered), x)
    # every rank attends to as many (query, key) pairs under a causal mask: the load balance
    pairs = [sum(i + 1 for i in lay.token_indices().tolist()) for lay in shards]
    assert len(set(pairs)) == 1


def test_layout_rejects_a_length_that_does_not_split():
    with pytest.raises(ValueError, match="not divisible by 2 x context-parallel size = 4"):
        ShardLayout(18, 2, 0)


@pytest.mark.parametrize("segments", [False, True])
def test_sdpa_mask_rows_equal_eager_forward_and_backward(segments):
    tunables = Tunables(bias_block_bytes=4 * 2 * 16 * 61)  # blocks of 16 query rows: 16, 16, 7
    torch.manual_seed(0)
    b, h, n_q, n_k, d = 2, 2, 39, 61, 8  # queries are the last 39 of 61 keys (a chunk at offset 22)
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for n in (n_q, n_k, n_k))
    seg = torch.randint(0, 3, (b, n_k)).sort(-1).values if segments else None
    mask = AttentionMask(True, n_k - n_q, n_q, n_k, None if seg is None else seg[:, -n_q:], seg)
    assert 4 * b * n_q * n_k > tunables.bias_block_bytes and sdpa.block_rows(h, n_q, n_k, tunables=tunables) == 16
    outs = [sdpa.attend(q, k, v, bias=None, mask=mask, scale=d ** -0.5, tunables=tunables),  # rows, 3 blocks
            eager.attend(q, k, v, bias=None, mask=mask, scale=d ** -0.5)]
    grads = [torch.autograd.grad((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum(), (q, k, v))
             for o in outs]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-10, atol=1e-12)
    for g_sdpa, g_eager in zip(*grads):
        torch.testing.assert_close(g_sdpa, g_eager, rtol=1e-10, atol=1e-12)


def test_posenc_run_context_parallel_command():
    from posenc_lightning.cli import recipe_command

    cmd = recipe_command("fire_train", ["--devices", "4", "--context-parallel", "2", "--trainer.max_steps=3"])
    assert cmd[-5:] == ["--trainer.devices=4", "--trainer.strategy=ddp",
                        "--trainer.callbacks+=posenc_lightning.callbacks.ContextParallel",
                        "--trainer.callbacks.size=2", "--trainer.max_steps=3"]
    with pytest.raises(SystemExit, match="--devices 3 is not divisible by --context-parallel 2"):
        recipe_command("fire_train", ["--devices=3", "--context-parallel=2"])
    code, out = run_posenc("run", "--dry-run", "fire_train", "--devices", "2", "--context-parallel", "2")
    assert code == 0 and "ContextParallel --trainer.callbacks.size=2" in out
