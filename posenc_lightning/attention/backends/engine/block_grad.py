"""The softmax-attention gradient by blocks of query rows, for the SDPA backend's own backward
passes (`sdpa.toeplitz.ToeplitzAttention`, `sdpa.rows.RowsAttention`): SDPA's kernels cannot give
the gradient of a bias, so these recompute it block by block.

With ``S = q k^T s + bias``, ``P = softmax(S)``, ``O = P v``: ``dS = P * (dO v^T - rowsum(dO * O))``,
``dq = dS k s``, ``dk = dS^T q s``, ``dv = P^T dO``, and the bias gets ``dS``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor


def attention_backward_by_blocks(q: Tensor, k: Tensor, v: Tensor, out: Tensor, d_out: Tensor, *, scale: float,
                                 causal: bool, q_offset: int, rows: int,
                                 add_bias: Callable[[int, int, int, Tensor], None],
                                 on_ds: Callable[[int, int, int, Tensor], None] | None = None,
                                 reverse_rows: bool = False, dq: Tensor | None = None,
                                 dk: Tensor | None = None, dv: Tensor | None = None, empty_rows: bool = False,
                                 scratch: Scratch | None = None, compiling: bool = False,
                                 lse: Tensor | None = None, blocks: Sequence[tuple[int, int]] | None = None
                                 ) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the dtypes of q, k, v, computed ``rows`` query rows at a time.

    ``add_bias(start, stop, k_stop, s)`` adds the block's bias (and ``-inf`` where masked) in
    place to ``s = [B, H_kv, g, r, k_stop]`` (g query heads per kv head: grouped, no k/v copies);
    ``on_ds(start, stop, k_stop, ds)`` receives that block's ``dS`` in the same layout. Causal
    blocks stop at the keys their last query sees. ``reverse_rows``: each block's rows come in
    reverse order (``rr = stop - 1 - i``), for biases that are zero-copy views only that way.
    ``dq``/``dk``/``dv``: zero-filled accumulators to add into (float32 or wider, the shapes of q,
    k and v), so that ``on_ds`` can add a bias's own gradients for q and k to them without more
    buffers, and a caller running some blocks itself can sum them unrounded.
    ``empty_rows``: a query may see no key at all (key padding): its weights are 0, not NaN.
    ``scratch``: the blocks' buffers (`Scratch`, two of a block's size at least); buffer 1 is free
    while ``on_ds`` runs (a caller may use it there). ``compiling``: traced by ``torch.compile``
    (as the caller's `mode.Mode` says), for the default ``scratch``.
    ``lse``: the forward's log-sum-exp of each query's logits (bias and mask included), ``[B, H,
    Nq]``, float32 or wider: the logits are then in base 2 (times `LOG2E`, folded into q; ``add_bias``
    adds the bias times `LOG2E`) and the weights ``exp2(S - lse log2(e))`` in place, two passes where
    a softmax takes three and a buffer (not with ``empty_rows``: a row with no key has no lse).
    ``blocks``: the ``(start, stop)`` query rows of each block (at most ``rows`` each), where not
    every block of the queries is wanted; consecutive blocks by default.
    """
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[-2]
    g = h // h_kv
    wt = torch.promote_types(q.dtype, torch.float32)
    kf, vf = k.to(wt), v.to(wt)
    add_dq = dq is not None
    dq = torch.empty_like(q, dtype=wt) if dq is None else dq  # q's layout: returned without a copy
    dk = torch.zeros_like(kf) if dk is None else dk
    dv = torch.zeros_like(vf) if dv is None else dv
    block = b * h * min(rows, n_q) * n_k
    scratch = Scratch((block, block), wt, q.device, compiling) if scratch is None else scratch
    blocks = [(s0, min(n_q, s0 + rows)) for s0 in range(0, n_q, rows)] if blocks is None else blocks
    delta = _delta(d_out, out, wt, blocks, n_q)  # [B, H, Nq, 1]

    def grouped(t: Tensor, start: int, stop: int) -> Tensor:  # [B, H, r, X] -> [B, H_kv, g*r, X]
        t = t[:, :, start:stop]
        t = t.flip(-2) if reverse_rows else t
        return t.to(wt).reshape(b, h_kv, g * (stop - start), t.shape[-1])

    unit = LOG2E if lse is not None and not empty_rows else 1.0  # the logits' units: e, or 2 with the lse
    # k, v laid out once where a block's keys would otherwise be copied by each matmul (heads
    # inside tokens, ``[B, N, H, D]`` viewed as ``[B, H, N, D]``, with B > 1); slices then fold
    kc, vc = _foldable(kf), _foldable(vf)
    for start, stop in blocks:
        r = stop - start
        k_stop = min(n_k, q_offset + stop) if causal else n_k
        kb = kc[:, :, :k_stop]
        # s (and log2(e) with the lse) folded into q: one pass less
        qs, dob = grouped(q, start, stop) * (scale * unit), grouped(d_out, start, stop)
        shape = (b, h_kv, g * r, k_stop)
        if unit == 1.0:
            s = scratch.matmul(0, qs, kb.transpose(-1, -2), shape)
            add_bias(start, stop, k_stop, s.view(b, h_kv, g, r, k_stop))
            p = scratch.softmax(1, s, shape)
            if empty_rows:
                p = p.nan_to_num_(0.0)
        else:  # exp2 of (S - lse) log2(e), in place in buffer 1
            p = scratch.matmul(1, qs, kb.transpose(-1, -2), shape)
            add_bias(start, stop, k_stop, p.view(b, h_kv, g, r, k_stop))
            p = p.sub_(grouped(lse.unsqueeze(-1), start, stop), alpha=LOG2E).exp2_()
        ds = scratch.matmul(0, dob, vc[:, :, :k_stop].transpose(-1, -2), shape)  # s is dead: its buffer takes dS
        ds.sub_(grouped(delta, start, stop)).mul_(p)
        _accumulate(dv[:, :, :k_stop], p.transpose(-1, -2), dob, 1.0, scratch.eager)
        del p
        if add_dq and g == 1 and not reverse_rows:
            _accumulate(dq[:, :, start:stop], ds, kb, scale, scratch.eager)
        else:
            dq_b = torch.matmul(ds, kb).mul_(scale).view(b, h, r, d)
            dq_b = dq_b.flip(-2) if reverse_rows else dq_b
            if add_dq:
                dq[:, :, start:stop] += dq_b
            else:
                dq[:, :, start:stop] = dq_b
        _accumulate(dk[:, :, :k_stop], ds.transpose(-1, -2), qs, 1 / unit, scratch.eager)
        if on_ds is not None:
            on_ds(start, stop, k_stop, ds.view(b, h_kv, g, r, k_stop))
        del ds
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _accumulate(acc: Tensor, a: Tensor, b: Tensor, alpha: float, in_place: bool) -> None:
    """``acc += alpha * a @ b`` (``acc`` a slice of an accumulator, ``[B, H, m, n]``): ``in_place``
    (eagerly, no graph recorded) as one product into ``acc`` where its batch dims fold into one
    (``baddbmm_``: no product tensor and no second pass over it), else a product then added."""
    if in_place:
        try:
            flat = acc.view(-1, *acc.shape[-2:])  # a view or an error: never a copy written in vain
        except RuntimeError:
            flat = None
        if flat is not None:
            flat.baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), alpha=alpha)
            return
    acc.add_(torch.matmul(a, b), alpha=alpha)


def _delta(d_out: Tensor, out: Tensor, wt: torch.dtype, blocks: Sequence[tuple[int, int]], n_q: int) -> Tensor:
    """``rowsum(dO * O)`` ``[B, H, Nq, 1]``, of the blocks' rows only where they are not all the queries."""
    lo, hi = min(s for s, _ in blocks), max(e for _, e in blocks)
    if (lo, hi) == (0, n_q):
        return (d_out.to(wt) * out.to(wt)).sum(-1, keepdim=True)
    delta = d_out.new_zeros(*d_out.shape[:-1], 1, dtype=wt)
    delta[:, :, lo:hi] = (d_out[:, :, lo:hi].to(wt) * out[:, :, lo:hi].to(wt)).sum(-1, keepdim=True)
    return delta


#: ``log2(e)``: with the forward's log-sum-exp the logits are in base 2, for ``exp2`` (``exp`` has a
#: slow path where its result is under float32's smallest normal: logits far below their row's
#: maximum; ``exp2`` has none)
LOG2E = 1.4426950408889634


def _foldable(t: Tensor) -> Tensor:
    """``t [B, H, N, D]`` itself where ``t[:, :, :n]`` views as ``[B * H, n, D]`` (what a batched
    matmul needs to read it in place: B = 1, or each batch's heads one stride apart), else a copy."""
    return t if t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1) else t.contiguous()


class Scratch:
    """Buffers reused from block to block of one backward call (eagerly): a block's logits,
    weights and ``dS`` are written into them (``out=``) instead of fresh multi-MiB tensors each
    block, whose pages are new to the process each time (page faults). Under compile every
    block gets new tensors (`eager` False), as inductor plans its own buffers, and so does a
    backward that is itself differentiated (``create_graph``: ``out=`` records no graph).
    ``compiling``: traced by ``torch.compile``, as the caller's `mode.Mode` says."""

    def __init__(self, sizes: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 compiling: bool = False) -> None:
        self.eager = not compiling and not torch.is_grad_enabled()
        self._buffers = [torch.empty(n, dtype=dtype, device=device) for n in sizes] if self.eager else []

    def view(self, i: int, shape: tuple[int, ...]) -> Tensor:
        """Buffer ``i``'s first elements as a contiguous tensor of ``shape`` (eagerly only)."""
        n = 1
        for s in shape:
            n *= s
        return self._buffers[i][:n].view(shape)

    def matmul(self, i: int, a: Tensor, b: Tensor, shape: tuple[int, ...]) -> Tensor:
        """``a @ b`` (of ``shape``), in buffer ``i``."""
        return torch.matmul(a, b, out=self.view(i, shape)) if self.eager else torch.matmul(a, b)

    def softmax(self, i: int, s: Tensor, shape: tuple[int, ...]) -> Tensor:
        """``softmax(s)`` over the last dim, in buffer ``i``."""
        return torch._softmax(s, -1, False, out=self.view(i, shape)) if self.eager else torch.softmax(s, -1)


def _autograd_records() -> bool:
    """Autograd records here (with grad mode on): not inside a custom operator's kernel, where the
    autograd dispatch keys are excluded whatever the grad mode."""
    with torch.enable_grad():
        return torch.ones((), requires_grad=True).mul(1).requires_grad


#: the autograd dispatch keys a custom operator's kernel runs without
_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                  torch._C.DispatchKey.AutogradNestedTensor)


@contextlib.contextmanager
def _recording() -> Iterator[None]:
    """Grad mode, with the autograd dispatch keys back where any custom operator's kernel runs
    below autograd (e.g. `opaque_op`'s backward): a block's small graph is then differentiated by
    autograd there too, not by the slower ``torch.func.vjp`` (CHANGELOG.md)."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    if not excluded.has(_AUTOGRAD_KEYS[0]):
        with torch.enable_grad():
            yield
        return
    kept = excluded
    for key in _AUTOGRAD_KEYS:
        kept = kept.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), kept), torch.enable_grad():
        yield


def block_vjp(fn: Callable[..., Tensor], *primals: Tensor, compiling: bool = False, eager_autograd: bool = True
              ) -> tuple[Tensor, Callable[[Tensor], tuple[Tensor, ...]]]:
    """``(fn(*primals), pullback)`` with ``pullback(g)`` the gradients of ``<fn(...), g>`` to every
    primal (zeros for one ``fn`` does not use), as ``torch.func.vjp``; eagerly through autograd
    (inside a custom operator's kernel too, `_recording`). ``compiling``: traced by
    ``torch.compile``, as the caller's `mode.Mode` says; ``eager_autograd``: its
    `Tunables.eager_autograd` (False: ``torch.func.vjp`` eagerly too)."""
    if compiling or not eager_autograd:
        return torch.func.vjp(fn, *primals)
    leaves = [p.detach().requires_grad_() for p in primals]
    with _recording():
        records = _autograd_records()
        out = fn(*leaves) if records else None
    if out is None:  # autograd is off here for another reason (a transform)
        return torch.func.vjp(fn, *primals)

    def pullback(g: Tensor) -> tuple[Tensor, ...]:
        if not out.requires_grad:
            return tuple(torch.zeros_like(p) for p in leaves)
        with _recording():
            return torch.autograd.grad(out, leaves, g, materialize_grads=True)

    return out.detach(), pullback
