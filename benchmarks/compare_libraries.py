"""Our fast paths against the libraries users would otherwise use, on the same tensors:
``python benchmarks/compare_libraries.py [--quick]`` (needs ``pip install -e .[bench]``).

- rotary application: ours (``apply_rotary``, both layouts) vs Hugging Face transformers'
  ``apply_rotary_pos_emb`` (half layout) and rotary-embedding-torch's ``apply_rotary_emb``
  (interleaved); tables precomputed for everyone, q and k rotated.
- ALiBi and T5 relative-bias attention: ours (mixin ``attend``, backend auto) vs x-transformers'
  ``AlibiPositionalBias`` / ``RelativePositionBias`` + ``Attend(causal=True, flash=True)``.

Forward and forward+backward, interleaved repetitions, medians; ratio = ours / theirs
(< 1: ours is faster). Writes ``benchmarks/results/compare-<device>-<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
from torch import nn

from benchmarks.harness import interleaved_medians, loadavg, machine
from posenc_lightning.attention.mixin import PosEncAttentionMixin
from posenc_lightning.functional.rope import apply_rotary, rope_cos_sin, rope_inv_freq
from posenc_lightning.inject import inject


class _Attn(nn.Module, PosEncAttentionMixin):
    def __init__(self, n_heads: int, head_dim: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim


def _qkv(h: int, n: int, d: int, dev: torch.device, grad: bool):
    """q, k, v as models make them: strided views of one fused projection [B, N, 3*H*D]."""
    fused = torch.randn(1, n, 3 * h * d, device=dev)
    q, k, v = (t.view(1, n, h, d).transpose(1, 2) for t in fused.split(h * d, dim=-1))
    if grad:
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    return q, k, v


def _fb(f, inputs):
    def run():
        for t in inputs:
            t.grad = None
        out = f()
        out = out if isinstance(out, torch.Tensor) else torch.cat([o.flatten() for o in out])
        out.square().mean().backward()
    return run


def _nograd(f):
    def run():
        with torch.no_grad():
            f()
    return run


def rotary_cases(n: int, h: int, d: int, dev: torch.device) -> dict[tuple, object]:
    from rotary_embedding_torch import RotaryEmbedding, apply_rotary_emb
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, _ = _qkv(h, n, d, dev, grad=True)
    pos = torch.arange(n, device=dev)[None]
    cos, sin = rope_cos_sin(pos, rope_inv_freq(d, device=dev))
    cos_hf, sin_hf = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # HF's [B, N, D] tables
    freqs = RotaryEmbedding(dim=d).to(dev)(torch.arange(n, device=dev))  # [N, D] interleaved angles
    def ours_h():
        return (apply_rotary(q, cos, sin, "half"), apply_rotary(k, cos, sin, "half"))
    def hf():
        return apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    def ours_i():
        return (apply_rotary(q, cos, sin, "interleaved"), apply_rotary(k, cos, sin, "interleaved"))
    def ret():
        return (apply_rotary_emb(freqs, q), apply_rotary_emb(freqs, k))
    # same numbers first: a comparison of different results would mean nothing
    for a, b in zip(ours_h(), hf()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(ours_i(), ret()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    out = {}
    for name, f in (("ours half", ours_h), ("HF apply_rotary_pos_emb", hf),
                    ("ours interleaved", ours_i), ("rotary-embedding-torch", ret)):
        out[("rotary", name, "fwd")] = _nograd(f)
        out[("rotary", name, "fwd+bwd")] = _fb(f, (q, k))
    return out


def bias_cases(n: int, h: int, d: int, dev: torch.device) -> dict[tuple, object]:
    from x_transformers.attend import Attend
    from x_transformers.x_transformers import AlibiPositionalBias, RelativePositionBias

    q, k, v = _qkv(h, n, d, dev, grad=True)
    out = {}
    attend = Attend(causal=True, flash=True).to(dev)
    theirs = {"alibi": AlibiPositionalBias(heads=h).to(dev),
              "relative_bias": RelativePositionBias(scale=1.0, causal=True, num_buckets=32, max_distance=128,
                                                    heads=h).to(dev)}
    for enc, xt in theirs.items():
        ours_mod = _Attn(h, d).to(dev)
        inject(ours_mod, enc)
        if enc == "relative_bias":  # the same table values, so that the outputs can be compared
            with torch.no_grad():
                ours_mod.posenc.relative_attention_bias.weight.copy_(xt.relative_attention_bias.weight)
        def ours(m=ours_mod):
            return m.attend(q, k, v)
        def xtf(xt=xt):
            return attend(q, k, v, attn_bias=xt(n, n))[0]
        torch.testing.assert_close(ours(), xtf(), rtol=2e-4, atol=2e-4)
        params = [p for m in (ours_mod, xt) for p in m.parameters()]
        for name, f in ((f"ours {enc}", ours), (f"x-transformers {enc}", xtf)):
            out[(enc, name, "fwd")] = _nograd(f)
            out[(enc, name, "fwd+bwd")] = _fb(f, [q, k, v, *params])
    return out


PAIRS = [("rotary", "ours half", "HF apply_rotary_pos_emb"),
         ("rotary", "ours interleaved", "rotary-embedding-torch"),
         ("rotary", "ours half", "rotary-embedding-torch"),
         ("alibi", "ours alibi", "x-transformers alibi"),
         ("relative_bias", "ours relative_bias", "x-transformers relative_bias")]


def rotary_reps(reps: int) -> int:
    return max(30, 6 * reps)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.lengths, a.reps = [512], 5
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lines = [f"# Ours vs the libraries ({dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC})", "",
             f"- machine: {machine()}", f"- load average before: {loadavg()}",
             f"- command: `python benchmarks/compare_libraries.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
             (f"- B=1, {a.heads} heads, head_dim {a.head_dim}, fp32, q/k/v strided views of a fused projection; "
             f"{a.reps} interleaved reps ({rotary_reps(a.reps)} for the rotary calls, timed among themselves), "
             f"medians; outputs checked equal before timing"), "",
             "| N | what | ours | theirs | fwd ms ours / theirs | fwd ratio | fwd+bwd ms ours / theirs | fwd+bwd ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for n in a.lengths:
        torch.manual_seed(0)
        # the rotary calls take milliseconds: timed among themselves (not after a multi-second
        # attention call that leaves every cache cold) and with more repetitions
        med = {**interleaved_medians(rotary_cases(n, a.heads, a.head_dim, dev), rotary_reps(a.reps), warmup=2),
               **interleaved_medians(bias_cases(n, a.heads, a.head_dim, dev), a.reps, warmup=1)}
        for group, ours, theirs in PAIRS:
            cells = []
            for mode in ("fwd", "fwd+bwd"):
                o, t = med[(group, ours, mode)], med[(group, theirs, mode)]
                cells += [f"{1e3 * o:.1f} / {1e3 * t:.1f}", f"**{o / t:.2f}**"]
            lines.append(f"| {n} | {group} | {ours} | {theirs} | " + " | ".join(cells) + " |")
        print(f"N={n} done", file=sys.stderr, flush=True)
    lines += ["", f"- load average after: {loadavg()}"]
    text = "\n".join(lines)
    out = a.out or ROOT / "benchmarks" / "results" / f"compare-{dev.type}-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M}{'-quick' if a.quick else ''}.md"
    out.write_text(text + "\n")
    print(text)
    return out


if __name__ == "__main__":
    main()
