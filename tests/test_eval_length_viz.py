"""`LengthEvalCallback` numbers and `PosEncVisualizer`'s attention maps against the model itself."""

from __future__ import annotations

import math

import pytest
import torch

from posenc_lightning.callbacks.length_eval import LengthEvalCallback
from posenc_lightning.callbacks.visualize import attention_modules, capture_attention, encoded_attention
from posenc_lightning.models import TinyGPT


def _windows(tokens: torch.Tensor, n: int, k: int, bs: int = 2):
    w = [tokens[i * n: i * n + n + 1] for i in range(k)]
    return [(torch.stack([x[:-1] for x in w[j:j + bs]]), torch.stack([x[1:] for x in w[j:j + bs]]))
            for j in range(0, k, bs)]


def test_length_eval_is_exp_of_mean_token_nll_and_learned_fails_cleanly():
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (4000,))
    cb = LengthEvalCallback(lengths=[32, 64, 128], dataloader_fn=lambda n: _windows(tokens, n, 3))
    model = TinyGPT(d_model=32, n_layers=1, n_heads=2, max_seq_len=64, encoding="alibi")
    res = cb.evaluate(model)
    for n in (32, 64, 128):
        nll = torch.cat([model.token_nll(x, y).flatten() for x, y in _windows(tokens, n, 3)])
        assert res[n] == pytest.approx(math.exp(nll.mean().item()), rel=1e-5)
    learned = TinyGPT(d_model=32, n_layers=1, n_heads=2, max_seq_len=64, encoding="learned",
                      encoding_cfg={"max_seq_len": 64})
    res = cb.evaluate(learned)
    assert res[32] == res[32] and res[64] == res[64]  # inside the table: numbers
    assert res[128] != res[128] and "beyond the learned table" in cb.failures[128]  # beyond: NaN + reason
    assert set(cb.failures) == {128}


@pytest.mark.parametrize("encoding", ["rope", "alibi", "relative_bias", "fire", "fox", "sba", "yarn"])
def test_visualized_attention_reproduces_the_model(encoding):
    """The map the visualizer draws (eager `attention_weights` + the module's encoding) times V is
    exactly what the attention module returned in the forward pass."""
    torch.manual_seed(0)
    model = TinyGPT(d_model=32, n_layers=2, n_heads=2, max_seq_len=48, encoding=encoding).eval()
    x = torch.randint(0, 256, (1, 40))
    mods = attention_modules(model)
    outs = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, i=i: outs.__setitem__(i, inp[0])) for i, m in enumerate(mods)]
    with torch.no_grad(), capture_attention(mods) as got:
        model(x)
    for h in hooks:
        h.remove()
    assert set(got) == {0, 1}
    for i, m in enumerate(mods):
        w, bias = encoded_attention(m, got[i])
        assert w.shape == (1, 2, 40, 40)
        if encoding != "sba":  # stick-breaking weights sum to at most 1
            torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 40), atol=1e-5, rtol=0)
        assert torch.all(w.triu(1) == 0)  # causal
        b, n, _ = outs[i].shape
        qkv = m.qkv(outs[i])
        d = m.head_dim
        v = qkv[..., -m.n_kv_heads * d:].view(b, n, m.n_kv_heads, d).transpose(1, 2)
        with torch.no_grad():
            ref = m.attend(got[i]["q"], got[i]["k"], v, hidden=got[i]["hidden"])
        torch.testing.assert_close((w @ v.float()).to(ref.dtype), ref, atol=2e-5, rtol=1e-4)
        assert (bias is not None) == (encoding in ("alibi", "relative_bias", "fire", "fox"))
