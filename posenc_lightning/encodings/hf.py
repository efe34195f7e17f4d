"""Build the rotary encoding that matches a Hugging Face ``rope_parameters`` / ``rope_scaling`` dict.

Each rotary law declares its transformers ``rope_type`` (`Encoding.hf_rope_type`) and reads its own
fields (`RotaryEncoding.config_from_rope_parameters`); `from_hf` looks the law up in a table of the
registered classes.
"""

from __future__ import annotations

from typing import Any

from posenc_lightning.encodings.registry import available_encodings, encoding_class
from posenc_lightning.encodings.rope import RotaryEncoding

__all__ = ["from_hf", "hf_rope_laws"]


def hf_rope_laws() -> dict[str, type[RotaryEncoding]]:
    """The registered rotary laws by the transformers ``rope_type`` each declares.

    Returns:
        ``{rope_type: class}``, sorted by ``rope_type``.

    Raises:
        ValueError: two registered classes declare the same ``rope_type``.
    """
    table: dict[str, type[RotaryEncoding]] = {}
    for name in available_encodings():
        cls = encoding_class(name)
        rope_type = cls.hf_rope_type
        if rope_type is None:
            continue
        if rope_type in table:
            raise ValueError(f"rope_type {rope_type!r} is declared by {table[rope_type].__qualname__} and "
                             f"{cls.__qualname__}")
        table[rope_type] = cls
    return dict(sorted(table.items()))


def from_hf(rope_parameters: dict[str, Any] | None, head_dim: int, max_position_embeddings: int,
            original_max_position_embeddings: int | None = None) -> RotaryEncoding:
    """The encoding with the same ``inv_freq`` and attention scaling as HF's ``ROPE_INIT_FUNCTIONS``.

    Args:
        rope_parameters: the config's ``rope_parameters`` (transformers >= 5) or ``rope_scaling``
            (older, with ``type``); ``rope_theta`` and ``partial_rotary_factor`` are read from it.
        head_dim: the attention head size.
        max_position_embeddings: ``config.max_position_embeddings``.
        original_max_position_embeddings: a top-level ``config.original_max_position_embeddings``
            (Phi-3 keeps it outside the dict; it wins over the dict's value, as in HF).

    Returns:
        An encoding already bound to ``head_dim`` (``frequencies()`` works at once).

    Raises:
        ValueError: an unknown ``rope_type``, or a field its law needs is missing.
    """
    p = dict(rope_parameters or {})
    rope_type = p.get("rope_type", p.get("type", "default"))
    laws = hf_rope_laws()
    if rope_type not in laws:
        raise ValueError(f"from_hf: rope_type {rope_type!r} is not supported; supported: {', '.join(laws)}")
    original = original_max_position_embeddings or p.get("original_max_position_embeddings") or max_position_embeddings
    cls = laws[rope_type]
    enc = cls(**cls.config_from_rope_parameters(p, int(max_position_embeddings), int(original)))
    return enc.bind(head_dim=int(head_dim))
