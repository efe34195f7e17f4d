"""Each bias / normalizer encoding against a naive transcription of its paper's formula
(python loops over i, j in float64), forward and backward: gradients w.r.t. q, k, v, the
hidden state (fox) and every parameter of the encoding. Positions are offset per batch row."""

import math

import pytest
import torch

from posenc_lightning import inject
from tests.helpers import Attn

B, H, N, D, DM = 2, 2, 7, 4, 6


def _positions():
    return torch.stack([torch.arange(N) + 3, torch.arange(N)])  # not arange: an offset row


def _dot(a, b):
    return (a * b).sum()


def _rope(x, p, theta=10000.0):
    """RoFormer eq. 34 in the "half" layout: pairs (d, d + D/2) rotated by p * theta^(-2d/D)."""
    half = x.shape[-1] // 2
    out = []
    for d in range(half):
        ang = p * theta ** (-2.0 * d / x.shape[-1])
        out.append(x[d] * math.cos(ang) - x[d + half] * math.sin(ang))
    for d in range(half):
        ang = p * theta ** (-2.0 * d / x.shape[-1])
        out.append(x[d + half] * math.cos(ang) + x[d] * math.sin(ang))
    return torch.stack(out)


def _alibi_slope(h, n_heads):
    return 2.0 ** (-8.0 * (h + 1) / n_heads)  # Press et al.: geometric, start 2^(-8/n)


def loops_softmax(q, k, v, score):
    """o_i = sum_{j<=i} softmax_j(score(b, h, i, j)) v_j, causal, loops only."""
    rows = []
    for b in range(q.shape[0]):
        heads = []
        for h in range(q.shape[1]):
            outs = []
            for i in range(q.shape[2]):
                s = torch.stack([score(b, h, i, j) for j in range(i + 1)])
                w = torch.exp(s - s.max())
                w = w / w.sum()
                outs.append(sum(w[j] * v[b, h, j] for j in range(i + 1)))
            heads.append(torch.stack(outs))
        rows.append(torch.stack(heads))
    return torch.stack(rows)


def loops_stick_breaking(q, k, v, logit):
    """o_i = sum_{j<i} beta_ij prod_{j<t<i} (1 - beta_it) v_j (Tan et al., eq. 2-3), loops only."""
    rows = []
    for b in range(q.shape[0]):
        heads = []
        for h in range(q.shape[1]):
            outs = []
            for i in range(q.shape[2]):
                o = torch.zeros(v.shape[-1], dtype=v.dtype)
                for j in range(i):
                    a = torch.sigmoid(logit(b, h, i, j))
                    for t in range(j + 1, i):
                        a = a * (1 - torch.sigmoid(logit(b, h, i, t)))
                    o = o + a * v[b, h, j]
                outs.append(o)
            heads.append(torch.stack(outs))
        rows.append(torch.stack(heads))
    return torch.stack(rows)


# ------------------------------------------------------------------------ naive transcriptions
def naive_fire(q, k, v, pos, P, enc, hidden):
    c, L = P["c"], (P["L_multiplier"] * enc.init_L.double()).abs()
    w1, b1, w2, b2 = P["mlp.0.weight"][:, 0], P["mlp.0.bias"], P["mlp.2.weight"], P["mlp.2.bias"]

    def fire_bias(b, h, i, j, c=c, L=L, w1=w1, b1=b1, w2=w2, b2=b2):
        pi, pj = pos[b, i].double(), pos[b, j].double()
        x = torch.log(1 + (c * (pi - pj)).abs()) / (torch.log(1 + (c * torch.maximum(L, pi)).abs()) + enc.eps)
        return _dot(w2[h], torch.relu(w1 * x + b1)) + b2[h]

    return loops_softmax(q, k, v, lambda b, h, i, j: _dot(q[b, h, i], k[b, h, j]) / math.sqrt(D)
                         + fire_bias(b, h, i, j)), fire_bias


def naive_cope(q, k, v, pos, P, enc, hidden):
    e_all = P["pos_emb"]
    npos = enc.max_position

    def score(b, h, i, j):
        g = [torch.sigmoid(_dot(q[b, h, i], k[b, h, t]) / math.sqrt(D)) for t in range(N)]
        p = sum(g[t] for t in range(j, i + 1))  # p_ij = sum_{t=j}^{i} g_it (eq. 4)
        p = torch.clamp(p, max=npos - 1)
        e = e_all[h if enc.per_head else 0]  # [D, P]
        lo, hi = int(torch.floor(p)), int(torch.ceil(p))
        e_p = (p - lo) * e[:, hi] + (1 - p + lo) * e[:, lo]  # raw vector interpolation (eq. 5)
        return _dot(q[b, h, i], k[b, h, j]) / math.sqrt(D) + _dot(q[b, h, i], e_p)

    return loops_softmax(q, k, v, score)


def naive_fox(q, k, v, pos, P, enc, hidden):
    w, bias = P["gate.weight"], P["gate.bias"]

    def log_f(b, h, t):
        return torch.log(torch.sigmoid(_dot(w[h], hidden[b, t]) + bias[h]))

    def score(b, h, i, j):
        d = sum((log_f(b, h, l) for l in range(j + 1, i + 1)), torch.zeros((), dtype=q.dtype))
        return _dot(q[b, h, i], k[b, h, j]) / math.sqrt(D) + d

    return loops_softmax(q, k, v, score)


def naive_sba(q, k, v, pos, P, enc, hidden):
    return loops_stick_breaking(q, k, v, lambda b, h, i, j: _dot(q[b, h, i], k[b, h, j]) / math.sqrt(D))


def naive_rse(q, k, v, pos, P, enc, hidden):
    lam = P["penalty"]

    def logit(b, h, i, j):
        pi, pj = int(pos[b, i]), int(pos[b, j])
        return (_dot(_rope(q[b, h, i], pi), _rope(k[b, h, j], pj)) / math.sqrt(D) - lam[h] * abs(pi - pj))

    return loops_stick_breaking(q, k, v, logit)


def naive_rope_alibi(q, k, v, pos, P, enc, hidden):
    def score(b, h, i, j):
        pi, pj = int(pos[b, i]), int(pos[b, j])
        return (_dot(_rope(q[b, h, i], pi), _rope(k[b, h, j], pj)) / math.sqrt(D)
                - _alibi_slope(h, H) * abs(pi - pj))

    return loops_softmax(q, k, v, score)


def naive_mixture(q, k, v, pos, P, enc, hidden):
    w = torch.softmax(P["mixture_logits"], 0)
    t5 = enc.members[1]
    table = P["members.1.relative_attention_bias.weight"][t5.buckets()].t()  # [H, 2R+1] (T5 buckets)
    r = t5.max_distance
    fire = enc.members[2]
    fire_p = {n[len("members.2."):]: p for n, p in P.items() if n.startswith("members.2.")}
    _, fire_bias = naive_fire(q[:, :, :1], k[:, :, :1], v[:, :, :1], pos, fire_p, fire, hidden)

    def score(b, h, i, j):
        pi, pj = int(pos[b, i]), int(pos[b, j])
        qk = _dot(q[b, h, i], k[b, h, j]) / math.sqrt(D)
        rot = _dot(_rope(q[b, h, i], pi), _rope(k[b, h, j], pj)) / math.sqrt(D)
        return (qk + w[0] * (-_alibi_slope(h, H) * abs(pi - pj)) + w[1] * table[h, max(-r, min(r, pi - pj)) + r]
                + w[2] * fire_bias(b, h, i, j) + w[3] * (rot - qk))

    return loops_softmax(q, k, v, score)


CASES = {
    "fire": ({"init_L": 4.0, "init_c": 0.5}, naive_fire),  # queries past L: a DenseBias
    "fire@short": ({"init_L": 40.0, "init_c": 0.5}, naive_fire),  # all below L: a RelativeBias table
    "cope": ({"max_position": 4, "per_head": True, "init_std": 0.5}, naive_cope),
    "fox": ({"gate_bias_init": 1.0}, naive_fox),
    "sba": ({}, naive_sba),
    "rse": ({"penalty_init": 0.3}, naive_rse),
    "rope_alibi": ({}, naive_rope_alibi),
    "mixture": ({"members": ("alibi", "relative_bias", "fire", "rope"),
                 "member_cfgs": {"fire": {"init_L": 4.0}, "relative_bias": {"max_distance": 4, "num_buckets": 6}},
                 "init_weights": (0.1, -0.2, 0.3, 0.0)}, naive_mixture),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_paper_formula_forward_and_backward(name):
    cfg, naive = CASES[name]
    name = name.split("@")[0]
    attn = Attn(n_heads=H, head_dim=D, d_model=DM)
    enc = inject(attn, name, backend="eager", **cfg)
    with torch.no_grad():  # move every parameter off its init so each term matters
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    pos = _positions()
    q, k, v = (torch.randn(B, H, N, D, requires_grad=True) for _ in range(3))
    hidden = torch.randn(B, N, DM, requires_grad=True)
    out = attn(q, k, v, positions=pos, hidden=hidden)
    g = torch.randn_like(out)
    (out * g).sum().backward()

    q64, k64, v64, h64 = (t.detach().double().requires_grad_() for t in (q, k, v, hidden))
    P = {n: p.detach().double().requires_grad_() for n, p in enc.named_parameters()}
    ref = naive(q64, k64, v64, pos, P, enc, h64)
    ref = ref[0] if isinstance(ref, tuple) else ref
    (ref * g.double()).sum().backward()

    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(out.double(), ref, **tol)
    for mine, theirs, what in ((q, q64, "q"), (k, k64, "k"), (v, v64, "v")):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, **tol, msg=f"{name}: d{what}")
    if enc.requires_hidden:
        torch.testing.assert_close(hidden.grad.double(), h64.grad, **tol, msg=f"{name}: dhidden")
    learned = [n for n, p in enc.named_parameters() if p.requires_grad]
    for n in learned:
        p = dict(enc.named_parameters())[n]
        assert P[n].grad is not None, f"{name}: the formula does not use {n}"
        torch.testing.assert_close(p.grad.double(), P[n].grad, **tol, msg=f"{name}: d{n}")
    if name in ("fire", "cope", "fox", "rse", "mixture"):
        assert learned and all(dict(enc.named_parameters())[n].grad.abs().sum() > 0 for n in learned)
