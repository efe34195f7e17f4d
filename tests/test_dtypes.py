"""Encodings follow the model's dtype and device (at inject and after ``.to()``), keep float32
inside where it matters, and train under Lightning's precision plugins (issue 16)."""

import lightning.pytorch as pl
import pytest
import torch

from posenc_lightning import PosEncCallback, inject
from posenc_lightning.encodings.registry import available_encodings, encoding_class
from posenc_lightning.models import TinyGPT

DTYPES = [torch.bfloat16, torch.float64]
N = 8


def tiny(**kw):
    kw.setdefault("encoding", None)
    return TinyGPT(d_model=16, n_layers=1, n_heads=2, max_seq_len=16, **kw)


def positions_for(name):
    if encoding_class(name).position_dims == 2:  # a 2 x 4 grid
        grid = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(4), indexing="ij"), -1)
        return grid.reshape(1, N, 2).expand(2, N, 2)
    return None


def run(model, name):
    x = torch.randint(0, 256, (2, N), generator=torch.Generator().manual_seed(0))
    out = model(x, positions=positions_for(name))
    out.float().square().mean().backward()
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", available_encodings())
def test_every_encoding_in_bf16_and_fp64_cast_before_or_after_inject(name, dtype):
    for order in ("cast, inject", "inject, cast"):
        torch.manual_seed(0)
        model = tiny()
        if order == "cast, inject":
            enc = inject(model.to(dtype), name)
        else:
            enc = inject(model, name)
            model.to(dtype)
        out = run(model, name)
        assert out.dtype == dtype, order
        for k, p in enc.named_parameters():
            assert p.dtype == dtype, f"{order}: {k} is {p.dtype}"
            assert p.grad is None or (p.grad.dtype == dtype and torch.isfinite(p.grad).all()), (order, k)


@pytest.mark.parametrize("name", available_encodings())
def test_fp64_model_computes_the_fp32_function(name):
    """Same weights in fp32 and fp64 give the same logits (fp64 is no different function)."""
    torch.manual_seed(0)
    model = tiny()
    inject(model, name)
    x = torch.randint(0, 256, (2, N), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(x, positions=positions_for(name))
        out = model.double()(x, positions=positions_for(name))
    assert out.dtype == torch.float64
    torch.testing.assert_close(out.float(), ref, atol=1e-4, rtol=1e-4)


def test_float32_inside_a_bf16_model():
    """Angles, slopes, cumulative log-gates and FIRE's log-ratio stay float32 in a bf16 model."""
    model = tiny().to(torch.bfloat16)
    alibi = inject(model, "alibi")
    assert alibi.slopes.dtype == torch.float32
    model.to(torch.float16).to(torch.bfloat16)  # a round trip through fp16 loses nothing
    from posenc_lightning.functional.alibi import alibi_slopes

    assert torch.equal(alibi.slopes, alibi_slopes(2))

    rope = inject(model, "rope")
    run(model, "rope")
    assert rope._cos.dtype == torch.float32 and rope._cos.numel()
    model.to(torch.float16)
    assert rope._cos.dtype == torch.float32

    model = tiny().to(torch.bfloat16)
    fox = inject(model, "fox")
    h = torch.randn(2, N, 16, dtype=torch.bfloat16)
    assert fox.gate.weight.dtype == torch.bfloat16 and fox.log_forget(h).dtype == torch.float32
    assert tiny().double() and inject(tiny().double(), "fox").log_forget(h).dtype == torch.float64

    fire = inject(model, "fire")
    assert fire.mlp[0].weight.dtype == torch.bfloat16
    pos = torch.arange(N)[None]
    assert fire.normalized_distance(pos, pos).dtype == torch.float32
    assert fire.relative_table(N).dtype == torch.float32


def test_fox_on_the_triton_backend_in_fp64():
    pytest.importorskip("triton")
    from tests.helpers import Attn

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 9, 16, generator=g, dtype=torch.float64) for _ in range(3))
    hidden = torch.randn(2, 9, 32, generator=g, dtype=torch.float64)
    for cast in (False, True):  # the layer has no weights of its own: the gate stays fp32, or is cast
        outs, grads = [], []
        for backend in ("eager", "triton"):
            torch.manual_seed(0)
            m = Attn(n_heads=2, head_dim=16, d_model=32)
            inject(m, "fox", backend=backend)
            if cast:
                m.double()
            ins = [t.clone().requires_grad_() for t in (q, k, v, hidden)]
            out = m(*ins[:3], hidden=ins[3])
            assert out.dtype == torch.float64
            outs.append(out)
            grads.append(torch.autograd.grad(out.sum(), ins + list(m.parameters())))
        # fp32 arithmetic inside (the kernel's accumulators; the gate when not cast): its rounding,
        # eps 1.2e-7, summed over the keys, measured up to 2e-7 absolute
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", torch.float32), ("bf16-true", torch.bfloat16),
                                             ("64-true", torch.float64)])
@pytest.mark.parametrize("name", ["fire", "fox", "cope", "learned"])
def test_lightning_precision_plugins_train(tmp_path, name, precision, dtype):
    from posenc_lightning.data import CorpusDataModule

    model = tiny()
    enc = inject(model, name)  # the callback finds it there and keeps it
    before = {k: p.detach().float().clone() for k, p in enc.named_parameters()}
    cb = PosEncCallback(name)
    t = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, precision=precision, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                   callbacks=[cb], default_root_dir=tmp_path, limit_val_batches=0, num_sanity_val_steps=0)
    t.fit(model, CorpusDataModule(seq_len=N, batch_size=2, max_bytes=20_000, max_val_windows=1))
    assert t.global_step == 2 and torch.isfinite(t.callback_metrics["train/loss"])
    assert cb.injected is enc
    params = dict(enc.named_parameters())
    assert params and all(p.dtype == dtype for p in params.values())
    assert any(not torch.equal(p.detach().float(), before[k]) for k, p in params.items()), "nothing trained"
