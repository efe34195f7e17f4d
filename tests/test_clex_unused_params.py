"""CLEX at t = 1 runs no ODE step; its parameters must still take part in the step (with a zero
gradient), or DDP stops with "parameters that were not used in producing the loss"."""

import torch

from posenc_lightning.models import TinyGPT


def test_clex_parameters_get_a_zero_gradient_at_t1_and_a_real_one_beyond():
    model = TinyGPT(d_model=16, n_layers=1, n_heads=2, max_seq_len=16, encoding="clex",
                    encoding_cfg={"max_scale": 4.0, "original_max_position_embeddings": 16})
    ode = [p for n, p in model.named_parameters() if "ode_" in n]
    assert ode
    x = torch.randint(0, 256, (2, 16))
    model.token_nll(x, x).mean().backward()  # 16 tokens = the original length: t = 1
    assert all(p.grad is not None and p.grad.abs().max() == 0 for p in ode)
    model.zero_grad(set_to_none=True)
    x = torch.randint(0, 256, (2, 48))  # t = 3: the ODE runs and learns
    model.token_nll(x, x).mean().backward()
    assert all(p.grad is not None for p in ode) and any(p.grad.abs().max() > 0 for p in ode)
