"""sdpa's choice of form (`plan.choose`), by itself: a pure function of what a call declares
(`plan.Call`) and how it runs (`plan.Mode`), checked form by form with no tensor computed."""

from __future__ import annotations

import dataclasses

import pytest

from posenc_lightning.attention.backends.engine import blocks as _blocks
from posenc_lightning.attention.backends.sdpa.plan import Call, Form, Mode, Plan, choose
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables

EAGER, CUDA = Mode(False, "cpu"), Mode(False, "cuda")
COMPILED, COMPILED_CUDA = Mode(True, "cpu"), Mode(True, "cuda")
#: B 2, H 4, 512 x 512: weights of 8 MiB in float32
B, H, N = 2, 4, 512
ONE_BLOCK = 4 * B * H * N * N  # the compiled one-block threshold at exactly these sizes


def call(**kw) -> Call:
    return Call(B, H, N, N, **kw)


def test_mode_reads_host_values_only_eagerly_on_cpu():
    assert EAGER.host_reads
    assert not CUDA.host_reads and not COMPILED.host_reads and not COMPILED_CUDA.host_reads


@pytest.mark.parametrize("mode", [EAGER, CUDA, COMPILED])
def test_no_bias(mode):
    """SDPA alone under a plain mask; its boolean mask otherwise; a causal offset whose mask
    outgrows a bias block goes by rows (a zero bias), the engine's backward when q, k, v need one."""
    assert choose(call(bias=False), mode) == Plan(Form.SDPA)
    assert choose(call(bias=False, plain_mask=False), mode) == Plan(Form.MASK)
    small = Call(1, H, 16, 16, bias=False, plain_mask=False, offset_causal=True)
    assert choose(small, mode) == Plan(Form.MASK)  # 1 KiB of mask: not worth blocks
    big = Call(1, H, 2048, 2048, bias=False, plain_mask=False, offset_causal=True, recomputable=True)
    rows = _blocks.forward_rows(H, 2048, 2048)
    assert choose(big, mode) == Plan(Form.ROWS, rows=rows)
    assert choose(dataclasses.replace(big, grads=True, grad_mode=True), mode) == Plan(Form.OWN_BACKWARD, rows=rows)


@pytest.mark.parametrize("mode", [EAGER, CUDA, COMPILED, COMPILED_CUDA])
def test_key_only_bias(mode):
    """ALiBi / FoX: the CPU key mask where it works under a plain mask, else the extra channel;
    never one traced block (the key-only forms are cheaper)."""
    assert choose(call(key_only=True, key_mask=True), mode, ONE_BLOCK) == Plan(Form.KEY_MASK)
    assert choose(call(key_only=True, key_mask=False), mode, ONE_BLOCK) == Plan(Form.KEY_CHANNEL)
    assert choose(call(key_only=True, key_mask=True, plain_mask=False), mode) == Plan(Form.KEY_CHANNEL)


def test_toeplitz_eagerly_with_rows_as_fallback():
    rows = _blocks.forward_rows(H, N, N)
    assert choose(call(toeplitz=True), EAGER) == Plan(Form.TOEPLITZ, fallback=Plan(Form.ROWS, rows=rows))
    assert choose(call(toeplitz=True), CUDA).form is Form.TOEPLITZ
    # strided views of storage offsets do not trace: by rows under compile
    assert choose(call(toeplitz=True), COMPILED_CUDA) == Plan(Form.ROWS, rows=rows)


def test_rows_own_backward_only_when_recomputable_and_needed():
    rows = _blocks.forward_rows(H, N, N)
    own = Plan(Form.OWN_BACKWARD, rows=rows)
    assert choose(call(recomputable=True, grads=True, grad_mode=True), EAGER) == own
    assert choose(call(recomputable=False, grads=True, grad_mode=True), EAGER) == Plan(Form.ROWS, rows=rows)
    assert choose(call(recomputable=True, grads=False, grad_mode=True), EAGER) == Plan(Form.ROWS, rows=rows)
    assert choose(call(recomputable=True, grads=True, grad_mode=False), EAGER) == Plan(Form.ROWS, rows=rows)


def _eager(budget: int) -> Mode:
    return Mode(False, "cpu", Tunables(bias_block_bytes=budget))


def test_rows_per_block_follow_the_budget():
    """One block of bias ``[1, H, rows, keys]`` float32 within the budget, at least 16 rows, at
    most the queries."""
    assert choose(call(), _eager(4 * H * N * 40)).rows == 40
    assert choose(call(), _eager(1)).rows == DEFAULT_TUNABLES.min_rows
    assert choose(call(), Mode(False, "cpu", Tunables(bias_block_bytes=1, min_rows=24))).rows == 24
    assert choose(call(), _eager(2**40)).rows == N


def test_compiled_one_block_on_cpu_up_to_its_size():
    assert choose(call(), COMPILED, ONE_BLOCK) == Plan(Form.ONE_BLOCK, rows=N)
    assert choose(call(), COMPILED, ONE_BLOCK - 1).form is Form.ROWS
    assert choose(call(), COMPILED_CUDA, ONE_BLOCK).form is Form.ROWS  # CPU only
    assert choose(call(), EAGER, ONE_BLOCK).form is Form.ROWS  # compiled only


def test_opaque_compiled_form_with_the_rest_of_the_plan_as_fallback():
    """A kind that declares opaque operands runs as the opaque operator under compile (past one block), falling
    back to what the plan would be without it; eagerly it is ignored."""
    c = call(opaque=True, recomputable=True, grads=True, grad_mode=True)
    rows = _blocks.forward_rows(H, N, N)
    assert choose(c, COMPILED) == Plan(Form.OPAQUE, fallback=Plan(Form.OWN_BACKWARD, rows=rows))
    assert choose(c, COMPILED_CUDA).form is Form.OPAQUE
    assert choose(c, COMPILED, ONE_BLOCK).form is Form.ONE_BLOCK
    assert choose(c, EAGER) == Plan(Form.OWN_BACKWARD, rows=rows)


def test_backward_rows_and_a_bias_that_takes_a_share():
    """Half a forward block (two block-sized tensors of ``[B, H, rows, keys]``), and ``share`` of
    that (at least 8 rows) for a bias whose recomputed rows keep more state (`Bias.backward_share`)."""
    rows = _blocks.backward_rows(B, H, 4096, 1024)
    assert rows == DEFAULT_TUNABLES.bias_block_bytes // (2 * 4 * B * H * 1024)
    assert _blocks.backward_rows(B, H, 4096, 1024, 0.75) == 3 * rows // 4
    assert _blocks.backward_rows(B, H, 4096, 2**20, 0.75) == 12  # 16 rows at least, then the share
    assert _blocks.backward_rows(B, H, 4, 1024) == 4  # never more than the queries


def test_blockwise_backend_tiles_take_a_quarter_of_the_budget():
    """The blockwise backend's bias blocks: four block-sized tensors, within its own row caps."""
    n_k = 1024
    assert _blocks.tile_rows(1, H, n_k, 128, 16) == min(128, DEFAULT_TUNABLES.bias_block_bytes // (4 * 4 * H * n_k))
    assert _blocks.tile_rows(8, 16, 8192, 128, 16) == 16
    assert _blocks.tile_rows(8, 16, 8192, 128, 4) == 4


def _declared_form(bias, q, k, v, mask, ctx):
    from posenc_lightning.attention.backends import sdpa

    mode = Mode.of(q)
    call, _ = sdpa._declared(q, k, v, bias, mask, ctx, None, mode)
    return choose(call, mode, mode.tunables.compiled_one_block_bytes).form


def test_what_real_kinds_declare_leads_to_their_form():
    """The bias kinds' declarations as sdpa reads them (`sdpa._declared`), eagerly on CPU:
    causal ALiBi is key-only (the key mask: no gradient, one kv head per query head), a T5
    table at arange positions Toeplitz, at shuffled positions rows; a lazy bias recomputable
    from its inputs the engine's own backward when one needs a gradient, else rows."""
    import torch

    from posenc_lightning.attention.mask import AttentionMask
    from posenc_lightning.encodings.base import AttentionContext, DenseBias, LinearBias, RelativeBias
    from posenc_lightning.functional.alibi import alibi_slopes

    h, n, d = 4, 64, 8
    q, k, v = (torch.randn(1, h, n, d) for _ in range(3))
    pos = torch.arange(n)[None]
    mask, ctx = AttentionMask(True, 0, n, n), AttentionContext(pos, pos, True)
    with torch.no_grad():
        assert _declared_form(LinearBias(alibi_slopes(h), pos, pos), q, k, v, mask, ctx) is Form.KEY_MASK
        table = torch.randn(h, 15)
        assert _declared_form(RelativeBias(table, pos, pos), q, k, v, mask, ctx) is Form.TOEPLITZ
        perm = torch.randperm(n)[None]
        assert _declared_form(RelativeBias(table, perm, perm), q, k, v, mask, AttentionContext(perm, perm)) \
            is Form.ROWS
    w = torch.randn(h, requires_grad=True)

    def rows(s, e, ke, w_):
        return w_[None, :, None, None].expand(1, h, e - s, ke).float()

    lazy = DenseBias.lazy(rows, n, n, inputs=(w,))
    assert _declared_form(lazy, q, k, v, mask, ctx) is Form.OWN_BACKWARD
    with torch.no_grad():
        assert _declared_form(lazy, q, k, v, mask, ctx) is Form.ROWS


def test_own_attention_eagerly_with_the_rest_of_the_plan_as_fallback():
    """A kind that computes the whole attention itself (`Bias.own_attention`) runs it eagerly, on any
    device, falling back to what the plan would be without it; compiled it is ignored."""
    c = call(own=True, recomputable=True, grads=True, grad_mode=True)
    rest = Plan(Form.OWN_BACKWARD, rows=_blocks.forward_rows(H, N, N))
    assert choose(c, EAGER) == Plan(Form.OWN, fallback=rest)
    assert choose(c, CUDA) == Plan(Form.OWN, fallback=rest)
    assert choose(c, COMPILED) == choose(call(recomputable=True, grads=True, grad_mode=True), COMPILED)
    assert choose(call(own=True, bias=False), EAGER) == Plan(Form.SDPA)
