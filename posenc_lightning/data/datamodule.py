"""`CorpusDataModule`: language-modeling windows over a byte corpus, with a settable length."""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from posenc_lightning.data.corpus import load_corpus


class RandomWindows(Dataset):
    """Sample ``i`` is a window at a fixed pseudo-random *fraction* of the corpus, so its
    length can change between steps (``seq_len`` is read at ``__getitem__`` time)."""

    def __init__(self, tokens: Tensor, owner: CorpusDataModule, n_samples: int, seed: int) -> None:
        self.tokens = tokens
        self.owner = owner
        self.fracs = np.random.default_rng(seed).random(n_samples)

    def __len__(self) -> int:
        return len(self.fracs)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        n = self.owner.seq_len
        span = len(self.tokens) - n - 1
        if span <= 0:
            raise ValueError(f"seq_len={n} is longer than the corpus ({len(self.tokens)} tokens)")
        start = int(self.fracs[i] * span)
        w = self.tokens[start: start + n + 1].long()
        return w[:-1], w[1:]


class FixedWindows(Dataset):
    """Consecutive non-overlapping windows of ``seq_len`` (validation: every token once)."""

    def __init__(self, tokens: Tensor, seq_len: int, max_windows: int | None = None) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        n = (len(tokens) - 1) // seq_len
        if n < 1:
            raise ValueError(f"validation text ({len(tokens)} tokens) is shorter than seq_len={seq_len}")
        self.n = n if max_windows is None else min(n, max_windows)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        w = self.tokens[i * self.seq_len: (i + 1) * self.seq_len + 1].long()
        return w[:-1], w[1:]


def tokenize(data: Tensor, tokenizer: str) -> Tensor:
    """The bytes ``data`` (uint8) as the ids of a local Hugging Face tokenizer (int32)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    text = bytes(data.numpy()).decode("utf-8", errors="replace")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int32)


class CorpusDataModule(pl.LightningDataModule):
    """Byte-level LM data from the Python standard library's source (or your own text files).

    Args:
        seq_len: training window length; may be changed at any step (context curricula).
        batch_size: windows per batch.
        val_seq_len: validation window length (default: ``seq_len``).
        files: your own text files instead of the standard library.
        max_bytes: cap on the training text (None = all of it).
        val_fraction: share of files held out for validation.
        samples_per_epoch: training windows per epoch (default: corpus size / seq_len).
        max_val_windows: cap on validation windows per length.
        seed: the window sampling seed.
        num_workers: DataLoader workers (0 = no prefetching: a new seq_len applies at once).
        tokenizer: a local Hugging Face tokenizer directory (a pretrained model's own): windows are
            then of its tokens instead of bytes (the text is decoded as UTF-8 first).
    """

    def __init__(self, seq_len: int = 256, batch_size: int = 16, val_seq_len: int | None = None,
                 files: Sequence[str] | None = None, max_bytes: int | None = 8_000_000,
                 val_fraction: float = 0.05, samples_per_epoch: int | None = None,
                 max_val_windows: int | None = 64, seed: int = 0, num_workers: int = 0,
                 tokenizer: str | None = None) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_seq_len = val_seq_len or seq_len
        self.files = tuple(files) if files is not None else None
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.samples_per_epoch = samples_per_epoch
        self.max_val_windows = max_val_windows
        self.seed = seed
        self.num_workers = num_workers
        self.tokenizer = tokenizer
        self.train_tokens: Tensor | None = None
        self.val_tokens: Tensor | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_tokens is None:
            self.train_tokens, self.val_tokens = load_corpus(self.files, self.val_fraction, self.max_bytes)
            if self.tokenizer is not None:
                self.train_tokens, self.val_tokens = (tokenize(t, self.tokenizer)
                                                      for t in (self.train_tokens, self.val_tokens))

    def train_dataloader(self) -> DataLoader:
        self.setup()
        n = self.samples_per_epoch or max(len(self.train_tokens) // self.seq_len, self.batch_size)
        ds = RandomWindows(self.train_tokens, self, n, self.seed)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False, drop_last=True,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        self.setup()
        ds = FixedWindows(self.val_tokens, self.val_seq_len, self.max_val_windows)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)

    def length_dataloader(self, seq_len: int, max_windows: int | None = None, batch_size: int | None = None) -> DataLoader:
        """Validation windows at another length (perplexity-by-length evaluation)."""
        self.setup()
        ds = FixedWindows(self.val_tokens, seq_len, max_windows or self.max_val_windows)
        return DataLoader(ds, batch_size=batch_size or max(1, self.batch_size * self.val_seq_len // seq_len))
