"""Context-parallel equality runs in gloo processes (tests/test_context_parallel.py).

``python -m tests.cp_worker OUT WORLD CP`` spawns ``WORLD`` processes (``WORLD / CP`` data-parallel
groups of ``CP``); each rank computes, for every registered encoding on TinyGPT (and, with ``--hf``,
tiny Llama / GPT-2 configs through the adapter), the loss and every gradient of a 1-process run on
the full sequences and of its own shard, all-reduces the shard gradients as DDP does (mean over the
world) and rank 0 writes the largest differences to ``OUT/results.json``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import PRESET_CASES

B, N = 2, 16  # sequences per data-parallel group, tokens per sequence
HF_ENCODINGS = ("alibi", "fire", "fox", "sba", "yarn")


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [torch.zeros_like(p) if g is None else g for p, g in
            zip(params, torch.autograd.grad(loss, params, allow_unused=True))]


def _compare(ref_loss, ref_grads, loss, grads, world: int) -> dict[str, float]:
    """Max |loss difference| and, over every parameter, max |g - g_ref| / max |g_ref| (and absolute)."""
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    rel = absd = 0.0
    # a parameter whose gradient is zero in exact arithmetic (a per-head constant bias, which
    # softmax ignores) is compared against a floor of 1e-3 x the model's largest gradient
    floor = 1e-3 * max(float(r.abs().max()) for r in ref_grads)
    for r, g in zip(ref_grads, grads):
        g = g.detach().clone()
        dist.all_reduce(g)
        g /= world  # DDP's average over the world
        d = float((g - r).abs().max())
        absd = max(absd, d)
        rel = max(rel, d / max(float(r.abs().max()), floor))
    return {"loss": float(ref_loss.detach()), "loss_diff": abs(float(loss) / world - float(ref_loss.detach())),
            "grad_abs": absd, "grad_rel": rel}


def _data(group, vocab: int, packed: bool):
    g = torch.Generator().manual_seed(1)
    rows = B * group.dp_size
    x = torch.randint(1, vocab, (rows, N), generator=g)
    y = torch.randint(1, vocab, (rows, N), generator=g)
    pos = seg = None
    if packed:  # documents of 5, 7 and 4 tokens in row 0; 9 and 7 in the others
        lens = [[5, 7, 4]] + [[9, 7]] * (rows - 1)
        pos = torch.stack([torch.cat([torch.arange(n) for n in ls]) for ls in lens])
        seg = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(ls)]) for ls in lens])
    return x, y, pos, seg


def _mine(t, group):
    return None if t is None else t[group.dp_rank * B:(group.dp_rank + 1) * B]


def tinygpt_case(group, world: int, encoding: str, packed: bool) -> dict[str, float]:
    from posenc_lightning.models.tinygpt import TinyGPT
    from posenc_lightning.parallel.group import engaged

    torch.manual_seed(0)
    model = TinyGPT(d_model=32, n_layers=2, n_heads=2, max_seq_len=64, encoding=encoding,
                    encoding_cfg=PRESET_CASES.get(encoding))
    x, y, pos, seg = _data(group, 256, packed)
    kw = {} if not packed else {"positions": pos, "segment_ids": seg}
    ref = F.cross_entropy(model(x, **kw).transpose(1, 2), y)
    ref_grads = _grads(model, ref)
    layout = group.layout(N // group.size)
    shard = {k: layout.shard(_mine(v, group)) for k, v in kw.items()}
    with engaged(model, group):
        loss = F.cross_entropy(model(layout.shard(_mine(x, group)), **shard).transpose(1, 2),
                               layout.shard(_mine(y, group)))
        grads = _grads(model, loss)
    return _compare(ref, ref_grads, loss, grads, world)


def hf_case(group, world: int, arch: str, encoding: str, packed: bool) -> dict[str, float]:
    from benchmarks.hf_matrix import build
    from posenc_lightning import inject
    from posenc_lightning.callbacks.context_parallel import _fused_hf_attention
    from posenc_lightning.parallel.group import engaged

    module = build(arch).eval()  # no dropout (GPT-2's config has some); gradients as in training
    inject(module, encoding)
    vocab = module.model.config.vocab_size
    x, y, pos, _ = _data(group, vocab, packed)
    kw = {"positions": pos} if packed else {}
    ref = module.token_nll(x, y, **kw).mean()
    ref_grads = _grads(module, ref)
    undo = _fused_hf_attention(module)
    layout = group.layout(N // group.size)
    shard = {k: layout.shard(_mine(v, group)) for k, v in kw.items()}
    with engaged(module, group):
        loss = module.token_nll(layout.shard(_mine(x, group)), layout.shard(_mine(y, group)), **shard).mean()
        grads = _grads(module, loss)
    if undo is not None:
        undo()
    return _compare(ref, ref_grads, loss, grads, world)


def _run(rank: int, world: int, cp: int, port: int, out: str, hf: bool) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from posenc_lightning import available_encodings
    from posenc_lightning.parallel.group import ContextParallelGroup

    group = ContextParallelGroup.from_world(cp)
    results: dict[str, dict[str, float]] = {}
    for enc in [*available_encodings(), *PRESET_CASES]:  # every encoding, and every preset's schedule
        results[f"tinygpt/{enc}"] = tinygpt_case(group, world, enc, packed=False)
    for enc in ("alibi", "fire", "fox", "sba", "rope", "cope", "path"):
        results[f"tinygpt-packed/{enc}"] = tinygpt_case(group, world, enc, packed=True)
    if hf:
        for arch in ("llama", "gpt2"):
            for enc in HF_ENCODINGS:
                results[f"{arch}/{enc}"] = hf_case(group, world, arch, enc, packed=False)
        for enc in HF_ENCODINGS:
            results[f"llama-packed/{enc}"] = hf_case(group, world, "llama", enc, packed=True)
    if rank == 0:
        Path(out, "results.json").write_text(json.dumps({"world": world, "cp": cp, "dp": group.dp_size,
                                                          "results": results}, indent=1))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> None:
    import torch.multiprocessing as mp

    out, world, cp = argv[0], int(argv[1]), int(argv[2])
    mp.spawn(_run, args=(world, cp, _free_port(), out, "--hf" in argv), nprocs=world)


if __name__ == "__main__":
    main(sys.argv[1:])
