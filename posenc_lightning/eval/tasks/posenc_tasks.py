"""Data and scoring for posenc-lightning's own lm-eval tasks (passkey, perplexity by length).

Each dataset function receives the task metadata (``max_seq_lengths``, ``tokenizer``,
``num_samples``, ``seed``) and sizes every document to its length with that tokenizer, like RULER.
"""

from __future__ import annotations

import random
import re

# Mohtashami & Jaggi (2023), "Landmark Attention", appendix: the passkey retrieval prompt.
TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
GEN_BUDGET = 8


def _tokenizer(kwargs):
    from transformers import AutoTokenizer

    from posenc_lightning.eval.tokenizer import byte_tokenizer_dir

    return AutoTokenizer.from_pretrained(kwargs.get("tokenizer") or byte_tokenizer_dir(), local_files_only=True)


def _lengths(kwargs) -> list[int]:
    lengths = kwargs.get("max_seq_lengths") or [1024]
    return [int(x) for x in lengths]


def _dataset(rows):
    import datasets

    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


def passkey_prompt(n_filler: int, depth: float, key: str) -> str:
    before = round(n_filler * depth)
    return TASK + FILLER * before + NEEDLE.format(key=key) + FILLER * (n_filler - before) + QUESTION


def passkey_docs(**kwargs) -> dict:
    """``num_samples`` prompts per length with the needle at evenly spread depths."""
    tok = _tokenizer(kwargs)
    n = int(kwargs.get("num_samples") or 20)
    rng = random.Random(int(kwargs.get("seed", 0)))
    def n_tok(s):
        return len(tok(s, add_special_tokens=False).input_ids)
    rows = []
    for length in _lengths(kwargs):
        budget = length - GEN_BUDGET
        per_filler = n_tok(FILLER)
        for i in range(n):
            key = str(rng.randint(10_000, 99_999))
            depth = i / max(1, n - 1)
            k = max(0, (budget - n_tok(passkey_prompt(0, 0, key))) // per_filler)
            while k > 0 and n_tok(passkey_prompt(k, depth, key)) > budget:
                k -= 1
            prompt = passkey_prompt(k, depth, key)
            if n_tok(prompt) > budget:
                raise ValueError(f"passkey: length {length} leaves no room for the prompt; use lengths >= "
                                 f"{n_tok(prompt) + GEN_BUDGET}")
            rows.append({"input": prompt, "passkey": key, "depth": depth, "max_length": length})
    return _dataset(rows)


def passkey_generate_results(doc: dict, results: list[str]) -> dict:
    found = re.findall(r"\d+", results[0])
    return {"acc": float(bool(found) and found[0] == doc["passkey"])}


def passkey_loglikelihood_results(doc: dict, results: list[tuple[float, bool]]) -> dict:
    ll, greedy = results[0]
    return {"acc": float(greedy), "logprob": float(ll)}


def text_docs(**kwargs) -> dict:
    """``num_samples`` consecutive windows of the local text per length, each at most that many
    tokens (the bundled corpus's validation split, or ``files``)."""
    from posenc_lightning.eval.offline import local_text

    tok = _tokenizer(kwargs)
    files = kwargs.get("files")
    text = local_text(tuple(files) if files else None)
    n = int(kwargs.get("num_samples") or 8)
    rows = []
    for length in _lengths(kwargs):
        start = 0
        for _ in range(n):
            chunk = text[start:start + 2 * length]
            ids = tok(chunk, add_special_tokens=False).input_ids[:length]
            piece = tok.decode(ids)
            while len(tok(piece, add_special_tokens=False).input_ids) > length:
                piece = piece[:-1]
            if not piece:
                break
            rows.append({"text": piece, "max_length": length,
                         "n_tokens": len(tok(piece, add_special_tokens=False).input_ids)})
            start += len(piece)
    return _dataset(rows)


def nll_results(doc: dict, results: list[float]) -> dict:
    return {"nll": -float(results[0]) / doc["n_tokens"]}
