"""Run a GGUF file in llama.cpp (llama-cpp-python, the ``serve`` extra) and compare it with a
Hugging Face model: logits of a full forward, logits and tokens of KV-cached greedy decoding.

llama.cpp runs on the CPU with float32 keys and values in its cache (its default, f16, would round
them) and without flash attention, so that an f32 GGUF differs from transformers only by the order
of float32 sums.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


def llama_cpp_available() -> bool:
    """Whether ``llama_cpp`` (llama-cpp-python) can be imported."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


@contextmanager
def load_gguf(path: str, n_ctx: int) -> Iterator[Any]:
    """``llama_cpp.Llama`` on ``path`` with a context of ``n_ctx`` tokens, every position's logits kept,
    float32 KV cache, no flash attention; closed on exit."""
    import llama_cpp

    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or None
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                          vocab_only=False, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                          flash_attn=False, n_threads=threads, n_threads_batch=threads, verbose=False)
    try:
        yield llm
    finally:
        llm.close()


def llama_cpp_logits(path: str, ids: list[int], n_ctx: int | None = None) -> np.ndarray:
    """llama.cpp's logits ``[len(ids), vocab]`` for one forward over ``ids``."""
    with load_gguf(path, n_ctx or len(ids)) as llm:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)


def llama_cpp_greedy(path: str, prompt: list[int], n_new: int, n_ctx: int | None = None
                     ) -> tuple[list[int], np.ndarray]:
    """Greedy decoding in llama.cpp with its KV cache: the prompt in one batch, then one token a step.

    Returns:
        ``(tokens generated, the logits that chose each [n_new, vocab])``.
    """
    with load_gguf(path, n_ctx or len(prompt) + n_new) as llm:
        llm.eval(prompt)
        tokens, steps = [], []
        for _ in range(n_new):
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            steps.append(row)
            tokens.append(int(row.argmax()))
            llm.eval([tokens[-1]])
        return tokens, np.stack(steps)


def greedy_with_cache(model: nn.Module, prompt: torch.Tensor, n_new: int) -> list[int]:
    """Greedy decoding of a Hugging Face model with its KV cache: the prompt in one forward, then one
    token a step (``generate`` would stop at an end-of-sequence token; llama.cpp's loop does not)."""
    out = model(prompt, use_cache=True)
    tokens = []
    for _ in range(n_new):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def compare_llama_cpp(path: str, reference: nn.Module, ids: torch.Tensor, prompt: int) -> dict[str, Any]:
    """llama.cpp on the GGUF file ``path`` against ``reference`` (a Hugging Face model) on the same tokens.

    Args:
        path: the GGUF file.
        reference: the model to compare with (transformers' reading of the export, or the trained model).
        ids: ``[1, N]`` token ids; llama.cpp's context is N tokens.
        prompt: the greedy decoding's prompt length (it decodes to N tokens).

    Returns:
        ``full``: max |logits - reference| over the N positions; ``cached``: the same over the greedy
        steps (the reference's full forward over llama.cpp's tokens); ``greedy_equal``: llama.cpp's
        greedy tokens equal the reference's (`greedy_with_cache`); ``scale``: max
        |reference logits| (what the errors compare to); ``tokens``: llama.cpp's greedy tokens.
    """
    n = int(ids.shape[1])
    seq = [int(t) for t in ids[0]]
    got = llama_cpp_logits(path, seq, n)
    tokens, steps = llama_cpp_greedy(path, seq[:prompt], n - prompt, n)
    with torch.no_grad():
        want = reference(ids).logits[0].float().numpy()
        mine = torch.tensor([seq[:prompt] + tokens])
        want_steps = reference(mine).logits[0, prompt - 1:-1].float().numpy()
        theirs = greedy_with_cache(reference, ids[:, :prompt], n - prompt)
    return {"full": float(np.abs(got - want).max()), "cached": float(np.abs(steps - want_steps).max()),
            "greedy_equal": tokens == theirs, "scale": float(np.abs(want).max()), "tokens": tokens,
            "reference_tokens": theirs}


#: the largest |llama.cpp logits - reference| accepted, relative to max(1, max |reference logits|), per
#: GGUF weight type: f32 differs only by the order of float32 sums; the others round the weights
TOLERANCE: dict[str, float] = {"f32": 1e-4, "f16": 3e-2, "bf16": 1e-1, "q8_0": 1e-1}


def gguf_file(path: str) -> Path | None:
    """The GGUF file of an export directory: the one ``posenc_gguf.json`` names, else the first ``*.gguf``."""
    import json

    from posenc_lightning.models.serving import GGUF_MANIFEST

    d = Path(path)
    if (d / GGUF_MANIFEST).is_file():
        return d / json.loads((d / GGUF_MANIFEST).read_text())["gguf"]
    found = sorted(d.glob("*.gguf"))
    return found[0] if found else None


def llama_cpp_lines(path: str, facts: dict[str, Any], reference: Callable[[], nn.Module],
                    seed: int = 0) -> tuple[list[str], bool]:
    """``posenc check-serving``'s llama.cpp measurement: the directory's GGUF file run in llama.cpp
    against the reference on random tokens up to the exported length (at most 128, at least twice the
    original length), full forward and KV-cached greedy decoding of the last quarter (at most 16 tokens).

    Returns:
        The report's lines and whether llama.cpp diverges (an error over `TOLERANCE` or other greedy tokens).
    """
    import json

    from posenc_lightning.models.hf_export import _single_hf
    from posenc_lightning.models.serving import GGUF_MANIFEST

    gguf = gguf_file(path)
    if gguf is None:
        return ["  not run: no .gguf file in the directory (posenc export --format gguf writes one)"], False
    if not llama_cpp_available():
        return ["  not run: llama_cpp is not installed (pip install 'posenc-lightning[serve]')"], False
    manifest = Path(path) / GGUF_MANIFEST
    outtype = json.loads(manifest.read_text()).get("outtype", "f32") if manifest.is_file() else "f32"
    ref = _single_hf(reference()).eval()
    n = min(128, max(2 * facts["original"], facts["max_position_embeddings"]))
    vocab = int(ref.config.vocab_size)
    ids = torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(seed))
    err = compare_llama_cpp(str(gguf), ref, ids, n - min(16, n // 4))
    tol = TOLERANCE.get(outtype, TOLERANCE["q8_0"]) * max(1.0, err["scale"])
    bad = err["full"] > tol or err["cached"] > tol or not err["greedy_equal"]
    return [(f"  {'DIVERGES' if bad else 'equal'} [measured, llama.cpp] {gguf.name} ({outtype}), {n} tokens: max "
            f"|logits - trained| full forward {err['full']:.2e}, KV-cached decoding {err['cached']:.2e} (tolerance "
            f"{tol:.1e}); greedy tokens {'equal' if err['greedy_equal'] else 'differ'}")], bad
