"""The softmax-attention gradient by blocks of query rows, for the SDPA backend's own backward
passes (`sdpa._ToeplitzAttention`, `sdpa._BlockwiseAttention`): SDPA's kernels cannot give
the gradient of a bias, so these recompute it block by block.

With ``S = q k^T s + bias``, ``P = softmax(S)``, ``O = P v``: ``dS = P * (dO v^T - rowsum(dO * O))``,
``dq = dS k s``, ``dk = dS^T q s``, ``dv = P^T dO``, and the bias gets ``dS``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def attention_backward_by_blocks(q: Tensor, k: Tensor, v: Tensor, out: Tensor, d_out: Tensor, *, scale: float,
                                 causal: bool, q_offset: int, rows: int,
                                 add_bias: Callable[[int, int, int, Tensor], None],
                                 on_ds: Callable[[int, int, int, Tensor], None] | None = None,
                                 reverse_rows: bool = False, dq: Tensor | None = None,
                                 dk: Tensor | None = None, empty_rows: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the dtypes of q, k, v, computed ``rows`` query rows at a time.

    ``add_bias(start, stop, k_stop, s)`` adds the block's bias (and ``-inf`` where masked) in
    place to ``s = [B, H_kv, g, r, k_stop]`` (g query heads per kv head: grouped, no k/v copies);
    ``on_ds(start, stop, k_stop, ds)`` receives that block's ``dS`` in the same layout. Causal
    blocks stop at the keys their last query sees. ``reverse_rows``: each block's rows come in
    reverse order (``rr = stop - 1 - i``), for biases that are zero-copy views only that way.
    ``dq``/``dk``: zero-filled accumulators to add into (float32 or wider, the shapes of q and k),
    so that ``on_ds`` can add a bias's own gradients for q and k to them without more buffers.
    ``empty_rows``: a query may see no key at all (key padding): its weights are 0, not NaN.
    """
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[-2]
    g = h // h_kv
    wt = torch.promote_types(q.dtype, torch.float32)
    kf, vf = k.to(wt), v.to(wt)
    delta = (d_out.to(wt) * out.to(wt)).sum(-1, keepdim=True)  # [B, H, Nq, 1]
    add_dq = dq is not None
    dq = torch.empty_like(q, dtype=wt) if dq is None else dq  # q's layout: returned without a copy
    dk = torch.zeros_like(kf) if dk is None else dk
    dv = torch.zeros_like(vf)

    def grouped(t: Tensor, start: int, stop: int) -> Tensor:  # [B, H, r, X] -> [B, H_kv, g*r, X]
        t = t[:, :, start:stop]
        t = t.flip(-2) if reverse_rows else t
        return t.to(wt).reshape(b, h_kv, g * (stop - start), t.shape[-1])

    for start in range(0, n_q, rows):
        stop = min(n_q, start + rows)
        r = stop - start
        k_stop = min(n_k, q_offset + stop) if causal else n_k
        kb, vb = kf[:, :, :k_stop], vf[:, :, :k_stop]
        qb, dob = grouped(q, start, stop), grouped(d_out, start, stop)
        s = torch.matmul(qb, kb.transpose(-1, -2)).mul_(scale)
        add_bias(start, stop, k_stop, s.view(b, h_kv, g, r, k_stop))
        p = torch.softmax(s, dim=-1)
        if empty_rows:
            p = p.nan_to_num_(0.0)
        del s
        ds = torch.matmul(dob, vb.transpose(-1, -2))
        ds.sub_(grouped(delta, start, stop)).mul_(p)
        dv[:, :, :k_stop] += torch.matmul(p.transpose(-1, -2), dob)
        del p
        dq_b = torch.matmul(ds, kb).mul_(scale).view(b, h, r, d)
        dq_b = dq_b.flip(-2) if reverse_rows else dq_b
        if add_dq:
            dq[:, :, start:stop] += dq_b
        else:
            dq[:, :, start:stop] = dq_b
        dk[:, :, :k_stop] += torch.matmul(ds.transpose(-1, -2), qb).mul_(scale)
        if on_ds is not None:
            on_ds(start, stop, k_stop, ds.view(b, h_kv, g, r, k_stop))
        del ds
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


#: eagerly, a block's bias is differentiated with ``autograd.grad`` on its small graph rather than
#: ``torch.func.vjp``, whose per-call overhead (~0.4 ms: pytrees, signature binding) was most of
#: FIRE's backward rows at N=4096 (256 blocks); under compile ``torch.func.vjp`` (traceable)
EAGER_AUTOGRAD = True


def _autograd_records() -> bool:
    """Autograd records here: not inside a custom operator's kernel (`_fire_op`), where it is
    excluded whatever the grad mode (``torch.func``'s transforms still work there)."""
    with torch.enable_grad():
        return torch.ones((), requires_grad=True).mul(1).requires_grad


def block_vjp(fn: Callable[..., Tensor], *primals: Tensor) -> tuple[Tensor, Callable[[Tensor], tuple[Tensor, ...]]]:
    """``(fn(*primals), pullback)`` with ``pullback(g)`` the gradients of ``<fn(...), g>`` to every
    primal (zeros for one ``fn`` does not use), as ``torch.func.vjp``; eagerly through autograd."""
    if torch.compiler.is_compiling() or not EAGER_AUTOGRAD or not _autograd_records():
        return torch.func.vjp(fn, *primals)
    leaves = [p.detach().requires_grad_() for p in primals]
    with torch.enable_grad():
        out = fn(*leaves)

    def pullback(g: Tensor) -> tuple[Tensor, ...]:
        if not out.requires_grad:
            return tuple(torch.zeros_like(p) for p in leaves)
        return torch.autograd.grad(out, leaves, g, materialize_grads=True)

    return out.detach(), pullback
