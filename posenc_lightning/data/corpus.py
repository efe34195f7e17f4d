"""The bundled corpus: the Python standard library's own ``.py`` source, as bytes.

Every Python install has it, so recipes and tests need no download. Files are split into
train/val by a hash of their relative path (deterministic everywhere); the user's own text
files work the same way (``CorpusDataModule(files=[...])``).
"""

from __future__ import annotations

import functools
import sysconfig
import zlib
from pathlib import Path

import torch
from torch import Tensor

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib", "lib2to3", "turtledemo"}


def stdlib_files() -> list[Path]:
    """Sorted ``.py`` files of the standard library (tests and third-party packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts[:-1]) & _SKIP_DIRS)]
    if not files:
        raise FileNotFoundError(f"no .py files found under the standard library at {root}; pass files=[...]"
                                f" to CorpusDataModule to train on your own text")
    return sorted(files)


def is_validation_file(rel: str, val_fraction: float) -> bool:
    return (zlib.crc32(rel.encode()) % 10_000) < val_fraction * 10_000


@functools.lru_cache(maxsize=8)
def load_corpus(files: tuple[str, ...] | None = None, val_fraction: float = 0.05,
                max_bytes: int | None = None) -> tuple[Tensor, Tensor]:
    """``(train, val)`` uint8 token tensors (one byte = one token; files joined by a NUL byte)."""
    if files is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        paths = [(p, str(p.relative_to(root))) for p in stdlib_files()]
    else:
        paths = [(Path(f), Path(f).name) for f in files]
        missing = [str(p) for p, _ in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"corpus files not found: {missing[:5]}")
    train: list[bytes] = []
    val: list[bytes] = []
    n_train = n_val = 0
    cap_val = None if max_bytes is None else max(int(max_bytes * val_fraction / (1 - val_fraction)), 1)
    for path, rel in paths:
        data = path.read_bytes() + b"\0"
        if is_validation_file(rel, val_fraction):
            if cap_val is None or n_val < cap_val:
                val.append(data)
                n_val += len(data)
        elif max_bytes is None or n_train < max_bytes:
            train.append(data)
            n_train += len(data)
    if files is not None and not val:  # a single user file: hold out its tail
        joined = b"".join(train)
        cut = int(len(joined) * (1 - val_fraction))
        train, val = [joined[:cut]], [joined[cut:]]
    def to_t(chunks):
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    tr, va = to_t(train), to_t(val)
    if max_bytes is not None:
        tr = tr[:max_bytes]
    return tr, va
