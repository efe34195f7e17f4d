"""sdpa's choice of form, decided once per call: `Mode` (eager or traced, the device), `Call` (what the
choice reads of the call: declarations and shapes, no tensor values), `choose` (a pure function of
the two) and the `Plan` it returns, which `sdpa` then runs. See docs/architecture.md, section 4.

The forms, cheapest exact first (`Form`): SDPA alone (no bias), the kind's own attention (eagerly, a kind
whose logits are not ``q . k`` plus rows: `Bias.own_attention`), a key-only bias as SDPA's key mask
or one extra q/k channel, a Toeplitz bias as a zero-copy view (its own backward when learned), and
blocks of query rows (checkpointed, or the engine's own backward). Under ``torch.compile`` on CPU a
small attention is one traced block, and a kind whose cheapest form depends on values
(`Bias.opaque_operands`) runs as one opaque operator making the eager choice inside (`opaque_form`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from posenc_lightning.attention.backends.engine import blocks as _blocks
from posenc_lightning.functional.mode import Mode

__all__ = ["Call", "Form", "Mode", "Plan", "choose"]


class Form(enum.Enum):
    """One way sdpa runs an attention (cheapest exact first)."""

    SDPA = "sdpa"  # no bias: SDPA's is_causal or no mask
    MASK = "mask"  # no bias: SDPA with the boolean mask
    KEY_MASK = "key mask"  # a key-only bias as a broadcast mask on SDPA's CPU flash kernel
    KEY_CHANNEL = "key channel"  # a key-only bias as one extra q/k channel
    TOEPLITZ = "toeplitz"  # f(i - j) at arange positions: a zero-copy strided mask (learned: own backward)
    ROWS = "rows"  # blocks of query rows, each checkpointed under grad mode
    OWN_BACKWARD = "rows, own backward"  # blocks of query rows, the engine's backward by blocks
    ONE_BLOCK = "one block"  # compiled on CPU, small: the rows and SDPA's math form, traced
    OPAQUE = "opaque"  # compiled: one opaque operator making the eager, value-dependent choice inside
    OWN = "own attention"  # eager: the kind computes the whole attention itself (`Bias.own_attention`)


@dataclass(frozen=True)
class Call:
    """What `choose` reads of one call: shapes and declarations, read once.

    Args:
        batch: B; heads: query heads; n_q: queries; n_k: keys.
        bias: the call has a bias.
        plain_mask: the mask is plain causal or nothing.
        offset_causal: causal with the queries at an offset (a chunk, a prefill after a cache).
        key_only: the bias has a key-only form (`Bias.key_only`).
        key_mask: that form fits SDPA's CPU key mask (`key_bias._key_mask_works`).
        toeplitz: the bias is ``f(i - j)`` at arange positions, readable here (`Bias.distance_only`).
        recomputable: grad mode, and the bias recomputes its rows from stand-ins (`Bias.recomputable`)
            (read where a rows form is reachable).
        grads: q, k, v or a bias input that is not q or k needs a gradient (the same).
        grad_mode: autograd records.
        opaque: compiled, with a context, and the kind declares `Bias.opaque_operands`.
        kernel_runs: float32, no key padding and no documents, a kind that recomputes its rows from
            its inputs: a block of rows whose bias has a constant run may run on SDPA's CPU
            kernel, forward and backward (`runs`).
        own: the kind computes the whole attention itself (`Bias.own_attention`) for the q and k
            attended with, and the mask is causal with at most documents (an offset allowed).
    """

    batch: int
    heads: int
    n_q: int
    n_k: int
    bias: bool = True
    plain_mask: bool = True
    offset_causal: bool = False
    key_only: bool = False
    key_mask: bool = False
    toeplitz: bool = False
    recomputable: bool = False
    grads: bool = False
    grad_mode: bool = False
    opaque: bool = False
    kernel_runs: bool = False
    own: bool = False


@dataclass(frozen=True)
class Plan:
    """The form a call runs in; ``rows``: query rows per block (the row forms); ``fallback``: the
    plan when the form declines at run time (an opaque operator that does not apply, a kind
    with no value at the Toeplitz distances); ``kernel_runs``: blocks of rows may run on SDPA's
    CPU kernel (`Call.kernel_runs`, eagerly: the own backward's form, and the rows form without
    grad mode)."""

    form: Form
    rows: int = 0
    fallback: Plan | None = None
    kernel_runs: bool = False


def choose(call: Call, mode: Mode, one_block_bytes: int = 0) -> Plan:
    """The cheapest exact form of ``call`` in ``mode`` (see `Form`).

    Args:
        call: what the call declares.
        mode: eager or traced, and the device.
        one_block_bytes: compiled on CPU, attention weights ``[B, H, Nq, Nk]`` (float32) up to
            this size run as one traced block (sdpa passes `Tunables.compiled_one_block_bytes`).

    Returns:
        The plan.
    """
    if not call.bias:
        if call.plain_mask:
            return Plan(Form.SDPA)
        if call.offset_causal and 4 * call.batch * call.n_q * call.n_k > mode.tunables.bias_block_bytes:
            # an offset SDPA's is_causal cannot express, with a mask larger than a bias block:
            # its rows a block at a time (a zero bias)
            return _rows(call, mode)
        return Plan(Form.MASK)
    if call.own and not mode.compiling:  # a Python loop of the kind's own: eager only
        return Plan(Form.OWN, fallback=choose(replace(call, own=False), mode, one_block_bytes))
    if (not call.key_only and mode.compiling and mode.device == "cpu"
            and 4 * call.batch * call.heads * call.n_q * call.n_k <= one_block_bytes):
        return Plan(Form.ONE_BLOCK, rows=call.n_q)
    if mode.compiling and call.opaque:
        return Plan(Form.OPAQUE, fallback=choose(replace(call, opaque=False), mode, one_block_bytes))
    if call.key_only:
        return Plan(Form.KEY_MASK if call.plain_mask and call.key_mask else Form.KEY_CHANNEL)
    if call.toeplitz and not mode.compiling:  # strided views of storage offsets do not trace
        return Plan(Form.TOEPLITZ, fallback=_rows(call, mode))
    return _rows(call, mode)


def _rows(call: Call, mode: Mode) -> Plan:
    """Blocks of query rows: the engine's own backward when the bias recomputes its rows and
    something needs a gradient, else each block checkpointed under grad mode."""
    if call.grad_mode and call.recomputable and call.grads:
        return Plan(Form.OWN_BACKWARD, rows=_blocks.forward_rows(call.heads, call.n_q, call.n_k, tunables=mode.tunables),
                    kernel_runs=call.kernel_runs and mode.host_reads)
    return Plan(Form.ROWS, rows=_blocks.forward_rows(call.heads, call.n_q, call.n_k, tunables=mode.tunables),
                kernel_runs=call.kernel_runs and mode.host_reads and not call.grad_mode)
