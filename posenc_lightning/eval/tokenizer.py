"""The offline byte-level tokenizer, saved as a local Hugging Face tokenizer directory.

TinyGPT reads bytes (token id = byte value, vocab 256). lm-eval tasks that size their prompts
with a tokenizer (RULER: ``AutoTokenizer.from_pretrained(<path>)``) load this directory by path,
so nothing is downloaded. Token ``0`` (NUL, the corpus's file separator) is the end-of-text token.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path

EOT_ID = 0


def _default_dir() -> Path:
    root = os.environ.get("POSENC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "posenc_lightning")
    return Path(root) / "byte_tokenizer"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (the ByteLevel alphabet of ``tokenizers``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_byte_tokenizer():
    """A `PreTrainedTokenizerFast` whose ids are the UTF-8 bytes of the text (no merges, no BOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    eot = b2u[EOT_ID]
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eot, pad_token=eot,
                                   model_max_length=1 << 30, clean_up_tokenization_spaces=False)


@functools.lru_cache(maxsize=4)
def byte_tokenizer_dir(path: str | None = None) -> str:
    """Save the byte tokenizer to ``path`` (default ``~/.cache/posenc_lightning/byte_tokenizer``,
    or ``$POSENC_CACHE/byte_tokenizer``) once and return the directory, loadable offline with
    ``AutoTokenizer.from_pretrained(dir)``."""
    out = Path(path) if path else _default_dir()
    if not (out / "tokenizer.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        build_byte_tokenizer().save_pretrained(str(tmp))
        for f in tmp.iterdir():  # atomic per file: concurrent ranks may race here
            os.replace(f, out / f.name)
        tmp.rmdir()
    return str(out)


def load_byte_tokenizer(path: str | None = None):
    """The byte tokenizer, loaded back from its directory by `AutoTokenizer` (offline)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(byte_tokenizer_dir(path), local_files_only=True)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """A byte-level BPE `PreTrainedTokenizerFast` trained locally with ``tokenizers`` (no download):
    the 256 byte symbols plus ``vocab_size - 256`` merges; id 0 (NUL) is end-of-text and padding,
    as for the byte tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= 256:
        raise ValueError(f"train_bpe_tokenizer: vocab_size must exceed the 256 byte symbols, got {vocab_size}")
    b2u = bytes_to_unicode()
    alphabet = [b2u[b] for b in range(256)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, special_tokens=[b2u[EOT_ID]],
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    eot = b2u[EOT_ID]
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eot, pad_token=eot,
                                   model_max_length=1 << 30, clean_up_tokenization_spaces=False)
