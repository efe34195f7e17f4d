"""Compiled FIRE on CPU past `Tunables.compiled_one_block_bytes` runs the eager choice of form as one
opaque operator (``posenc::opaque_sdpa``, `attention/backends/sdpa/opaque_form.py`): below the learned
threshold ``L`` its O(N) table through the Toeplitz mask, past it the MLP rows by blocks; within
it, one traced block. Forward and every gradient equal eager's in every form, at positions given
or made, offsets, GQA, cached decoding, frozen parameters."""

from __future__ import annotations

import pytest
import torch

from posenc_lightning.functional.tunables import Tunables
from posenc_lightning.models.tinygpt import CausalSelfAttention, TinyGPT
from tests.helpers import compiled_greedy

N = 21  # not a multiple of any block


@pytest.fixture(autouse=True)
def _operator_sizes(monkeypatch):
    """These sizes would run as one traced block (`Tunables.compiled_one_block_bytes`): the operator
    is what larger ones take, so it is forced here (the one-block form: its own test below)."""
    monkeypatch.setattr(CausalSelfAttention, "posenc_tunables", Tunables(compiled_one_block_bytes=0))


def _model(init_L: float, **kw) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(d_model=32, n_layers=2, n_heads=4, max_seq_len=64, encoding="fire",
                   encoding_cfg={"init_L": init_L}, **kw)


def _grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _forms(monkeypatch) -> dict[str, list[bool]]:
    """Records which form each attention call ran: the Toeplitz template ("toeplitz") or the
    rows by blocks ("rows"); cleared before the compiled run."""
    from posenc_lightning.attention.backends import sdpa
    from posenc_lightning.attention.backends.sdpa import opaque_op

    seen: dict[str, list[bool]] = {"toeplitz": [], "rows": []}
    real_t, real_r = sdpa.attend_toeplitz, sdpa.attend_by_rows

    def toeplitz(*a, **k):
        seen["toeplitz"].append(True)
        return real_t(*a, **k)

    def rows(*a, **k):
        seen["rows"].append(True)
        return real_r(*a, **k)

    for module in (sdpa, opaque_op):  # the eager forms and the operator's kernel
        monkeypatch.setattr(module, "attend_toeplitz", toeplitz)
        monkeypatch.setattr(module, "attend_by_rows", rows)
    return seen


def _compare(m: TinyGPT, x: torch.Tensor, positions: torch.Tensor | None = None,
             forms: dict[str, list[bool]] | None = None, operator: bool = True) -> None:
    import torch._dynamo as dynamo

    ref = m(x, positions)
    ref.square().mean().backward()
    g_ref = _grads(m)
    m.zero_grad(set_to_none=True)
    dynamo.reset()
    for seen in (forms or {}).values():
        seen.clear()
    graphs: list[str] = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    out = torch.compile(m, fullgraph=True, backend=backend)(x, positions)
    out.square().mean().backward()
    assert any("posenc.opaque_sdpa" in g for g in graphs) == operator  # the operator, or traced
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    g = _grads(m)
    assert set(g) == set(g_ref)
    assert any("L_multiplier" in n for n in g) and any(".mlp." in n for n in g)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-5, atol=1e-7, msg=lambda s, n=n: f"{n}: {s}")


@pytest.mark.parametrize("init_L, toeplitz", [(512.0, True), (7.0, False)])
def test_compiled_equals_eager_in_both_forms(monkeypatch, init_L, toeplitz):
    from posenc_lightning.encodings.fire import compiled as fire_compiled

    forms = _forms(monkeypatch)
    compiled_rows: list[bool] = []
    real = fire_compiled.compiled_rows

    def counted():
        compiled_rows.append(True)
        return real()

    monkeypatch.setattr(fire_compiled, "compiled_rows", counted)
    x = torch.randint(0, 256, (2, N), generator=torch.Generator().manual_seed(1))
    _compare(_model(init_L), x, forms=forms)
    # queries below L: the table in every layer; past it: the rows
    assert len(forms["toeplitz" if toeplitz else "rows"]) == 2 and not forms["rows" if toeplitz else "toeplitz"]
    # past L the operator's backward differentiates its rows in the inductor-compiled formula
    # (the forward's rows, without gradients, stay eager's), equal to eager's gradients above
    assert bool(compiled_rows) == (not toeplitz)


def test_given_positions_offsets_and_gqa(monkeypatch):
    """Positions given (read inside the operator): an offset arange takes the table below L; a
    batch with gaps and different rows takes the rows; GQA (2 key heads for 4 query heads)."""
    forms = _forms(monkeypatch)
    x = torch.randint(0, 256, (2, N), generator=torch.Generator().manual_seed(4))
    offset = (37 + torch.arange(N)).expand(2, N)
    _compare(_model(512.0, n_kv_heads=2), x, offset, forms)
    assert len(forms["toeplitz"]) == 2 and not forms["rows"]
    gaps = torch.stack((3 * torch.arange(N), 100 + 2 * torch.arange(N)))
    _compare(_model(512.0, n_kv_heads=2), x, gaps, forms)
    assert len(forms["rows"]) == 2 and not forms["toeplitz"]  # not arange: the rows by blocks


def test_frozen_fire_parameters(monkeypatch):
    """Only q, k, v need gradients: the backward skips the bias parameters (zeros not returned)."""
    for init_L in (512.0, 7.0):
        m = _model(init_L)
        for blk in m.blocks:
            blk.attn.posenc.requires_grad_(False)
        x = torch.randint(0, 256, (2, N), generator=torch.Generator().manual_seed(5))
        ref = m(x)
        ref.square().mean().backward()
        g_ref = _grads(m)
        m.zero_grad(set_to_none=True)
        out = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
        out.square().mean().backward()
        g = _grads(m)
        assert set(g) == set(g_ref) and not any("posenc" in n for n in g)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        for n in g_ref:
            torch.testing.assert_close(g[n], g_ref[n], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("init_L", [512.0, 7.0])
def test_compiled_cached_decoding(init_L):
    """A compiled decode step (one query after a cache of keys, q_offset > 0) equals eager's."""
    m = _model(init_L)
    x = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    assert torch.equal(compiled_greedy(m, x, 5), m.generate(x, 5))


@pytest.mark.parametrize("init_L", [512.0, 7.0])
def test_bf16_compiled_equals_eager(init_L):
    """bf16 weights and activations: the operator computes what eager computes (the template in
    float32, as eager keeps it for its backward), output and gradients."""
    m = _model(init_L).to(torch.bfloat16)
    x = torch.randint(0, 256, (2, N), generator=torch.Generator().manual_seed(6))
    ref = m(x)
    ref.float().square().mean().backward()
    g_ref = _grads(m)
    m.zero_grad(set_to_none=True)
    out = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
    out.float().square().mean().backward()
    g = _grads(m)
    torch.testing.assert_close(out, ref)
    assert set(g) == set(g_ref)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], msg=lambda s, n=n: f"{n}: {s}")


@pytest.mark.parametrize("init_L", [512.0, 7.0])
def test_small_attention_is_one_traced_block(monkeypatch, init_L):
    """Within `Tunables.compiled_one_block_bytes` the compiled attention is one traced block (rows by
    FIRE's formula, SDPA's math form, autograd): no operator and no form chosen by reading L, the
    same output and gradients as eager below and past L, with given positions that have gaps."""
    monkeypatch.setattr(CausalSelfAttention, "posenc_tunables", Tunables(compiled_one_block_bytes=2 * 2**20))
    forms = _forms(monkeypatch)
    x = torch.randint(0, 256, (2, N), generator=torch.Generator().manual_seed(7))
    _compare(_model(init_L, n_kv_heads=2), x, forms=forms, operator=False)
    assert not forms["toeplitz"] and not forms["rows"]
    gaps = torch.stack((3 * torch.arange(N), 100 + 2 * torch.arange(N)))
    _compare(_model(init_L), x, gaps, operator=False)
