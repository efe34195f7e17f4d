"""Offline use of lm-eval: no downloads at run time, RULER's tasks sized by the byte tokenizer.

* `offline_env` sets ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` (and restores them).
* `ruler_patches` makes the installed RULER tasks (``lm_eval/tasks/ruler``) run offline:
  NLTK's ``punkt_tab`` download at import becomes a no-op (a regex sentence splitter replaces it
  when the resource is absent), the essay haystack of ``niah_single_2/3``, ``niah_multikey_1``,
  ``niah_multivalue``, ``niah_multiquery`` comes from a local text (the bundled corpus or any user
  file) instead of ``baber/paul_graham_essays``, and only the samples that will be evaluated are
  generated (RULER generates 500 per length; the first ``n`` are the same either way).
* `check_offline` fails fast, naming what is missing, for tasks that need a download.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

# RULER tasks that fetch data over the network, and what they fetch.
NEEDS_DOWNLOAD = {
    "ruler_qa_squad": "the SQuAD v2 dev json (rajpurkar.github.io)",
    "ruler_qa_hotpot": "the HotpotQA dev json (curtis.ml.cmu.edu)",
}
ESSAY_TASKS = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


class OfflineTaskError(RuntimeError):
    """A task needs data that is not on this machine."""


@contextlib.contextmanager
def offline_env() -> Iterator[None]:
    """Hugging Face hub/datasets offline for the duration (previous values restored)."""
    old = {k: os.environ.get(k) for k in _OFFLINE_VARS}
    os.environ.update({k: "1" for k in _OFFLINE_VARS})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# RULER tasks whose generators do not terminate at short lengths with a byte tokenizer (seen:
# ruler_vt at 512 and 2048 loops on "reduces chain length for not enough noises").
MIN_LENGTH = {"ruler_vt": 4096}


def check_lengths(tasks: Sequence[str], max_seq_lengths: Sequence[int]) -> None:
    for t in tasks:
        short = [n for n in max_seq_lengths if n < MIN_LENGTH.get(t, 0)]
        if short:
            raise ValueError(f"{t} does not finish generating its data at lengths {short} (its sampler loops "
                             f"there); use max_seq_lengths >= {MIN_LENGTH[t]} for it, or niah_* / ruler_fwe")


def check_offline(tasks: Sequence[str]) -> None:
    bad = {t: NEEDS_DOWNLOAD[t] for t in tasks if t in NEEDS_DOWNLOAD}
    if "ruler" in tasks:
        bad.update(NEEDS_DOWNLOAD)
    if bad:
        what = "; ".join(f"{t} needs {w}" for t, w in bad.items())
        raise OfflineTaskError(f"these lm-eval tasks need a download, which is off in the eval path: {what}. "
                               f"Drop them, or list the RULER tasks that run offline (niah_*, ruler_vt, "
                               f"ruler_cwe, ruler_fwe).")


@functools.lru_cache(maxsize=4)
def local_text(files: tuple[str, ...] | None = None, max_bytes: int = 2_000_000) -> str:
    """A local text: ``files`` joined, or the bundled corpus's validation split (NULs -> newlines)."""
    if files:
        return "\n".join(Path(f).read_text(errors="replace") for f in files)
    from posenc_lightning.data.corpus import load_corpus

    _, val = load_corpus(None, 0.05, max_bytes)
    return bytes(val.numpy()).replace(b"\0", b"\n").decode("utf-8", errors="replace")


def local_haystack(files: tuple[str, ...] | None = None) -> list[str]:
    """Whitespace-split words of `local_text` (RULER's essay haystack format)."""
    return [w for w in re.sub(r"\s+", " ", local_text(files)).split(" ") if w]


def _regex_sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


def _have_punkt() -> bool:
    try:
        import nltk

        nltk.data.find("tokenizers/punkt_tab")
        return True
    except (LookupError, ImportError):
        return False


@contextlib.contextmanager
def ruler_patches(num_samples: int | None = None, haystack_files: Sequence[str] | None = None) -> Iterator[None]:
    """Patch the installed RULER modules for offline use while tasks are built (restored after).

    Args:
        num_samples: samples generated per length (None = RULER's 500).
        haystack_files: text files for the essay haystack (None = the bundled corpus).
    """
    try:
        import nltk
    except ImportError as e:  # pragma: no cover - the eval extra installs it
        raise ImportError("RULER tasks need nltk and wonderwords: pip install 'posenc-lightning[eval]'") from e
    real_download = nltk.download

    def no_download(*args, **kwargs) -> bool:
        return False  # offline: punkt_tab is replaced by a regex splitter below

    nltk.download = no_download
    patches: dict[str, object] = {}
    originals: dict[str, object] = {}
    try:
        try:
            import lm_eval.tasks.ruler.prepare_niah as prep
        except ImportError as e:
            raise ImportError(f"RULER tasks need {e.name}: pip install 'posenc-lightning[eval]'") from e
        real_gen, real_hay = prep.generate_samples, prep.get_haystack

        def generate_samples(*args, **kwargs):
            if num_samples is not None:
                kwargs["num_samples"] = min(kwargs.get("num_samples", 500), num_samples)
            if kwargs.get("type_haystack") == "essay" and kwargs.get("max_seq_length", 1 << 30) < 16384:
                return _essay_samples(prep, *args, **kwargs)
            return real_gen(*args, **kwargs)

        def get_haystack(type_haystack: str):
            if type_haystack == "essay":
                return local_haystack(tuple(haystack_files) if haystack_files else None)
            return real_hay(type_haystack)

        patches = {"generate_samples": generate_samples, "get_haystack": get_haystack}
        originals = {"generate_samples": real_gen, "get_haystack": real_hay}
        if not _have_punkt():
            patches["sent_tokenize"], originals["sent_tokenize"] = _regex_sentences, prep.sent_tokenize
            prep.cached_sent_tokenize.cache_clear()
        for mod in _ruler_modules():
            for name, fn in patches.items():
                if getattr(mod, name, None) is originals[name]:
                    setattr(mod, name, fn)
        yield
    finally:
        # modules loaded meanwhile (the task YAMLs' utils) bound the patches too: undo everywhere
        for mod in _ruler_modules():
            for name, fn in patches.items():
                if getattr(mod, name, None) is fn:
                    setattr(mod, name, originals[name])
        if "sent_tokenize" in patches:
            prep.cached_sent_tokenize.cache_clear()
        nltk.download = real_download


def _essay_samples(prep, haystack, TOKENIZER=None, *, max_seq_length: int, num_samples: int = 500,
                   tokens_to_generate: int = 128, random_seed: int = 42, **kw) -> list[dict]:
    """RULER's `generate_samples` for the essay haystack at short lengths. RULER grows the essay
    500 words at a time, which overshoots 512-4096 tokens of a byte tokenizer and leaves one word
    of haystack; here the largest word count that fits is found by bisection. Output format and
    needle/depth sampling are RULER's own (`generate_input_output`)."""
    kw.pop("incremental", None)
    kw.pop("remove_newline_tab", None)
    opts = {k: kw[k] for k in ("type_haystack", "num_needle_k", "type_needle_k", "num_needle_v", "type_needle_v",
                               "template", "num_needle_q") if k in kw}
    opts.setdefault("num_needle_k", 1)
    opts.setdefault("num_needle_v", 1)
    opts.setdefault("num_needle_q", 1)
    opts["num_needle_k"] = max(opts["num_needle_k"], opts["num_needle_q"])
    def n_tok(text):
        return len(TOKENIZER(text).input_ids)

    def fits(n: int) -> tuple[str, list[str], str] | None:
        text, answer, query = prep.generate_input_output(n, haystack, random_seed=random_seed, **opts)
        return (text, answer, query) if n_tok(text) + tokens_to_generate <= max_seq_length else None

    lo, hi = 1, min(len(haystack), max_seq_length)
    while lo < hi:  # largest word count whose prompt fits (with RULER's random needle placement)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    out = []
    v = opts["type_needle_v"]
    single = opts["num_needle_q"] * opts["num_needle_v"] == 1
    for index in range(num_samples):
        used, sample = lo, None
        while used > 0 and sample is None:
            sample = fits(used)
            used -= max(1, lo // 50)
        if sample is None:
            continue
        text, answer, query = sample
        out.append({"index": index, "input": text, "outputs": answer,
                    "length": n_tok(text) + tokens_to_generate, "max_length": max_seq_length,
                    "gen_prefix": (f"The special magic {v[:-1]} for {query} mentioned in the provided text is" if single
                                   else f"The special magic {v} for {query} mentioned in the provided text are")})
    if not out:
        raise ValueError(f"RULER essay niah: the prompt with {opts['num_needle_k'] * opts['num_needle_v']} needle(s) "
                         f"and {tokens_to_generate} generated tokens does not fit in max_seq_length={max_seq_length}"
                         f"; use larger max_seq_lengths for this task")
    return out


def _ruler_modules() -> list[object]:
    return [m for n, m in list(sys.modules.items()) if n.startswith("lm_eval.tasks.ruler.") and m is not None]
