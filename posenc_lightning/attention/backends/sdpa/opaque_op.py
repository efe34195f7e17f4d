"""``posenc::opaque_sdpa`` and its backward operator (`opaque_form`): the eager choice of form of a
bias with a value-dependent form (`Bias.value_dependent`), inside a compiled graph. The kernels
rebuild the bias from its tensors and constants by its registered kind name and run sdpa's engine:
the Toeplitz template (`attend_toeplitz`, `toeplitz_backward`) where
`ValueDependentForm.distance_shift` holds, else rows by blocks (`attend_by_rows`, `rows_backward`,
rows differentiated by `ValueDependentForm.compiled_rows_from`). Nothing is recomputed in backward but the bias rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from posenc_lightning.attention.backends.engine.blocks import forward_rows
from posenc_lightning.attention.backends.sdpa.opaque_form import template
from posenc_lightning.attention.backends.sdpa.rows import RowsSpec, Sink, Target, attend_by_rows, rows_backward
from posenc_lightning.attention.backends.sdpa.toeplitz import attend_toeplitz, toeplitz_backward
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.bias import Bias, Index, rebuild_bias
from posenc_lightning.functional.tunables import Tunables

__all__ = ["opaque_sdpa", "opaque_sdpa_backward"]


@torch.library.custom_op("posenc::opaque_sdpa", mutates_args=())
def opaque_sdpa(q: Tensor, k: Tensor, v: Tensor, operands: list[Tensor], u: Tensor | None, kind: str, ints: list[int],
                floats: list[float], causal: bool, q_offset: int, scale: float, tunables: list[float]
                ) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, u_used, toeplitz)``: the attention output ``[B, H, Nq, Dv]`` (laid out as SDPA's),
    the template the backward reads (zeros unless ``toeplitz``) and whether the Toeplitz form ran.
    ``u``: the template computed in the graph (static positions), or None: computed here.
    ``tunables``: the call's `Tunables.as_floats` (an operator takes no Python object)."""
    tun = Tunables.from_floats(tunables)
    n_q, n_k = q.shape[-2], k.shape[-2]
    mask = AttentionMask(causal, q_offset, n_q, n_k)
    gqa = k.shape[1] != q.shape[1]
    bias = rebuild_bias(kind, operands, ints, floats)
    form = bias.value_dependent()
    with torch.no_grad():  # (blocks written straight into SDPA's layout)
        shift = form.distance_shift()
        if shift is not None:
            u = u if u is not None else template(form, shift, mask, q.shape[1], q.device)
            # detached: a mask that requires grad sends SDPA to its math kernel, even here
            out = attend_toeplitz(q, k, v, u.detach().to(q.dtype), mask, scale, gqa)
        else:
            out = attend_by_rows(q, k, v, bias, mask, scale, gqa, forward_rows(q.shape[1], n_q, n_k, tunables=tun),
                                 tunables=tun)
    u_out = u.float().clone() if shift is not None else q.new_zeros(q.shape[1], n_q + n_k - 1, dtype=torch.float32)
    return _laid_out(out, _sdpa_layout(q, v)), u_out, torch.tensor(shift is not None)


def _sdpa_layout(q: Tensor, v: Tensor) -> Tensor:
    """An empty output ``[B, H, Nq, Dv]`` laid out ``[B, Nq, H, Dv]`` as SDPA's own (callers view
    ``out.transpose(1, 2)`` as ``[B, Nq, H * Dv]``)."""
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[-1]).transpose(1, 2)


def _laid_out(t: Tensor, like: Tensor) -> Tensor:
    """``t`` in the dtype and strides of ``like`` (as the fake implementations state them): ``t``
    itself when it already is (the blocks were written into SDPA's layout), else a copy."""
    return t if t.stride() == like.stride() and t.dtype == like.dtype else like.copy_(t)


@opaque_sdpa.register_fake
def _(q, k, v, operands, u, kind, ints, floats, causal, q_offset, scale, tunables):
    n_q, n_k = q.shape[-2], k.shape[-2]
    return (_sdpa_layout(q, v), q.new_empty(q.shape[1], n_q + n_k - 1, dtype=torch.float32),
            q.new_empty((), dtype=torch.bool))


@dataclass(eq=False)
class _DifferentiatedRows(Bias):
    """``inner`` as the engine's backward reads it inside the operator: rows differentiated by its
    `ValueDependentForm.compiled_rows_from` where it has one (with gradients on), everything else its own."""

    inner: Bias

    def materialize(self) -> Tensor:
        return self.inner.materialize()

    def rows(self, start: int, stop: int, k_stop: int) -> Tensor:
        return self.inner.rows(start, stop, k_stop)

    def grad_inputs(self) -> tuple[Tensor, ...] | None:
        return self.inner.grad_inputs()

    def input_windows(self, start: int, stop: int, k_stop: int) -> tuple[Index, ...]:
        return self.inner.input_windows(start, stop, k_stop)

    @property
    def recomputable(self) -> bool:
        return self.inner.recomputable

    @property
    def fresh_rows(self) -> bool:
        return self.inner.fresh_rows

    def rows_from(self, start: int, stop: int, k_stop: int, views: Sequence[Tensor]) -> Tensor:
        if torch.is_grad_enabled():
            compiled = self.inner.value_dependent().compiled_rows_from
            if compiled is not None:
                return compiled(start, stop, k_stop, views)
        return self.inner.rows_from(start, stop, k_stop, views)


@torch.library.custom_op("posenc::opaque_sdpa_backward", mutates_args=())
def opaque_sdpa_backward(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, u: Tensor, toeplitz: Tensor,
                         operands: list[Tensor], kind: str, ints: list[int], floats: list[float], causal: bool,
                         q_offset: int, scale: float, tunables: list[float], u_given: bool, need: list[bool]
                         ) -> list[Tensor]:
    """``[dq, dk, dv, *d_operands, du]`` (zeros where ``need`` is False or the form that ran has
    none): the eager backward of that form (`toeplitz_backward`, then ``du`` to the given
    template or, computed here, through the template's vjp; or `rows_backward`)."""
    mask = AttentionMask(causal, q_offset, q.shape[-2], k.shape[-2])
    bias = rebuild_bias(kind, operands, ints, floats)
    tun = Tunables.from_floats(tunables)
    need_ops = need[3:-1]
    grads: list[Tensor | None] = [None] * (len(operands) + 1)
    if bool(toeplitz):
        want_u = any(need[3:])
        dq, dk, dv, du = toeplitz_backward(q, k, v, u, out, d_out, causal, q_offset, scale, want_u, tunables=tun)
        if u_given:
            grads[-1] = du
        elif want_u:
            shift = bias.value_dependent().distance_shift()
            diff = [i for i, n in enumerate(need_ops) if n]

            def of_operands(*p: Tensor) -> Tensor:
                ts = list(operands)
                for i, t in zip(diff, p):
                    ts[i] = t
                return template(rebuild_bias(kind, ts, ints, floats).value_dependent(), shift, mask, q.shape[1],
                                q.device)

            _, vjp = torch.func.vjp(of_operands, *[operands[i] for i in diff])
            for i, g in zip(diff, vjp(du.to(torch.float32))):
                grads[i] = g
    else:
        position = {id(t): i for i, t in enumerate(operands)}
        inputs = bias.grad_inputs() or ()
        extra: list[int] = []  # the operands differentiated, in the order of their first input
        targets: list[Target] = []  # where each input's gradient goes: its slot among them, or nowhere
        for t in inputs:
            i = position.get(id(t))
            if i is None or not need_ops[i]:
                targets.append(Target(Sink.NONE))
                continue
            if i not in extra:
                extra.append(i)
            targets.append(Target(Sink.EXTRA, extra.index(i)))
        spec = RowsSpec(_DifferentiatedRows(bias), mask, scale, tuple(inputs), tuple(targets), tunables=tun)
        dq, dk, dv, g = rows_backward(q, k, v, out, d_out, spec, (*need[:3], False, *[True] * len(extra)))
        for j, i in enumerate(extra):
            grads[i] = g[j]
    full = [dq, dk, dv, *grads]  # laid out as their inputs (the fake's empty_like)
    return [torch.zeros_like(t) if gi is None or not n else _laid_out(gi, torch.empty_like(t))
            for gi, t, n in zip(full, (q, k, v, *operands, u), need)]


@opaque_sdpa_backward.register_fake
def _(d_out, q, k, v, out, u, toeplitz, operands, kind, ints, floats, causal, q_offset, scale, tunables, u_given,
      need):
    return [torch.empty_like(t) for t in (q, k, v, *operands, u)]


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, operands, u_in, kind, ints, floats, causal, q_offset, scale, tunables = inputs
    out, u, toeplitz = output
    ctx.n_operands = len(operands)
    ctx.save_for_backward(q, k, v, out, u, toeplitz, *operands)
    ctx.args = (kind, ints, floats, causal, q_offset, scale, tunables, u_in is not None)


def _backward(ctx, d_out: Tensor, _du: Tensor, _dt: Tensor) -> tuple:
    q, k, v, out, u, toeplitz, *operands = ctx.saved_tensors
    needs = ctx.needs_input_grad
    # a floating operand that needs a gradient gets one; a given template (static positions)
    # takes the Toeplitz form's gradient to the bias's tensors
    need_ops = [bool(n) and t.is_floating_point() for n, t in zip(needs[3], operands)]
    need = [*needs[:3], *need_ops, ctx.args[-1] and needs[4]]
    g = torch.ops.posenc.opaque_sdpa_backward(d_out, q, k, v, out, u, toeplitz, operands, *ctx.args, need)
    kept = [gi if n else None for gi, n in zip(g, need)]
    n_ops, ints, floats = ctx.n_operands, ctx.args[1], ctx.args[2]
    # no gradient for the constants: None, or an empty list for an empty one (autograd's structure)
    return (*kept[:3], kept[3:3 + n_ops], kept[3 + n_ops], None, None if ints else [], None if floats else [],
            None, None, None, None)


opaque_sdpa.register_autograd(_backward, setup_context=_setup_context)
