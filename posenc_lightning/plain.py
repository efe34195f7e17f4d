"""`plain`: configuration values as plain Python containers.

Hydra (``hydra.utils.instantiate``) and OmegaConf hand arguments over as ``DictConfig`` /
``ListConfig``: mappings and sequences, but not ``dict`` / ``list``. Kept as they are they fail
``isinstance(x, dict)`` checks, YAML dumps (``hparams.yaml``) and ``torch.load(weights_only=True)``
of a checkpoint that holds them. Reading them item by item resolves their ``${...}``
interpolations; OmegaConf is never imported here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def plain(value: Any) -> Any:
    """``value`` with every mapping turned into a ``dict`` and every sequence (other than ``str`` /
    ``bytes``) into a ``list`` (a ``tuple`` stays a ``tuple``), recursively; anything else as it is.

    Args:
        value: a configuration value, e.g. an OmegaConf ``DictConfig`` from ``hydra.utils.instantiate``.

    Returns:
        The same content in ``dict`` / ``list`` / ``tuple`` (interpolations resolved).

    Examples:
        >>> from omegaconf import OmegaConf
        >>> plain(OmegaConf.create({"n": 16, "lengths": ["${n}", 32]}))
        {'n': 16, 'lengths': [16, 32]}
    """
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        return [plain(v) for v in value]
    return value
