"""Small modules shared by tests."""

import torch
from torch import nn

from posenc_lightning import PosEncAttentionMixin


class Attn(nn.Module, PosEncAttentionMixin):
    """A bare attention layer (q, k, v given) to test the mixin and backends."""

    def __init__(self, n_heads=4, head_dim=16, d_model=None):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.d_model = d_model or n_heads * head_dim

    def forward(self, q, k, v, **kw):
        return self.attend(q, k, v, **kw)


def qkv(b=2, h=4, n=11, d=16, hkv=None, dtype=torch.float32, grad=False):
    t = [torch.randn(b, hh, n, d, dtype=dtype, requires_grad=grad) for hh in (h, hkv or h, hkv or h)]
    return t
