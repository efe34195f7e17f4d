"""LengthEvalCallback(scale_with_length=True): the zero-shot extension protocol of PI/NTK/YaRN."""

import math

import torch

from posenc_lightning.callbacks import LengthEvalCallback
from posenc_lightning.callbacks.length_eval import token_nll
from posenc_lightning.models import TinyGPT


def test_each_length_is_scored_with_factor_n_over_L_and_the_factor_is_restored():
    torch.manual_seed(0)
    model = TinyGPT(d_model=32, n_layers=1, n_heads=2, max_seq_len=16, encoding="yarn",
                    encoding_cfg={"factor": 1.0, "original_max_position_embeddings": 16})
    enc = model.blocks[0].attn.posenc
    text = torch.randint(0, 256, (1, 64 + 1))
    seen = {}

    def windows(n):
        seen[n] = enc.factor
        return [(text[:, i:i + n], text[:, i + 1:i + n + 1]) for i in range(0, 64, n)]

    cb = LengthEvalCallback(lengths=[16, 32, 64], base_len=16, dataloader_fn=windows, scale_with_length=True)
    res = cb.evaluate(model)
    assert seen == {16: 1.0, 32: 2.0, 64: 4.0}
    assert enc.factor == 1.0
    # the perplexity at 64 is the model's own, computed with yarn factor 4
    enc.set_scale(4.0)
    with torch.no_grad():
        want = math.exp(token_nll(model.eval(), text[:, :64], text[:, 1:65]).mean().item())
    assert abs(res[64] - want) < 1e-4 * want
    plain = LengthEvalCallback(lengths=[64], base_len=16, dataloader_fn=windows).evaluate(model)
    assert seen[64] == 4.0 and abs(plain[64] - want) < 1e-4 * want  # without the flag: untouched factor
    enc.set_scale(1.0)
    assert LengthEvalCallback(lengths=[64], base_len=16, dataloader_fn=windows).evaluate(model)[64] != res[64]
