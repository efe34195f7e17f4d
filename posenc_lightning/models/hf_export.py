"""Export a Hugging Face model with an injected encoding, and load it back.

`export_pretrained` writes a ``save_pretrained`` directory:

- rope-family laws transformers knows (rope, ntk as a new base, pi = ``linear``, dynamic_ntk =
  ``dynamic``, yarn, llama3, long_rope = ``longrope``) become ``rope_parameters`` in config.json:
  the directory loads in plain ``transformers`` with no posenc_lightning installed, same logits;
- any other encoding keeps the model's own weights in the usual files (GPT-2's original ``wpe``
  included, so transformers loads it without warnings) and adds ``posenc_lightning.json`` (the
  encoding's spec) and ``posenc_lightning.pt`` (its parameters): reload with `load_pretrained`.
  Plain transformers would load the model *without* the encoding: `export_pretrained` says so.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posenc_lightning.adapters import hf as adapter
from posenc_lightning.encodings.base import Encoding
from posenc_lightning.models.hf_rope_config import rope_config

SPEC_FILE, STATE_FILE = "posenc_lightning.json", "posenc_lightning.pt"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")


def to_rope_parameters(enc: Encoding) -> tuple[dict[str, Any], int | None] | None:
    """``enc`` as transformers ``rope_parameters``: the law's own mapping (`Encoding.to_rope_parameters`,
    the inverse of `posenc_lightning.encodings.hf.from_hf`).

    Args:
        enc: the injected encoding.

    Returns:
        ``(rope_parameters, max_position_embeddings or None)``, or None when no transformers rope
        law equals ``enc``.
    """
    return enc.to_rope_parameters()


def _single_hf(module: nn.Module) -> nn.Module:
    models = adapter.find_hf_models(module)
    if len(models) != 1:
        raise ValueError(f"export_pretrained: {type(module).__name__} holds {len(models)} Hugging Face models; "
                         f"pass the PreTrainedModel to export")
    return models[0]


def injected_encoding(hf: nn.Module) -> Encoding | None:
    """The encoding the adapter placed in ``hf`` (the first layer's), or None."""
    table = adapter.rotary_module(hf)
    if isinstance(table, adapter.RotaryTable):
        return table.posenc
    wpe = getattr(hf.base_model, "wpe", None)
    for m in adapter.attention_modules(hf):
        if getattr(m, "posenc", None) is not None:
            return m.posenc
    return getattr(wpe, "posenc", None)


def _is_posenc_key(key: str) -> bool:
    return ".posenc." in key or key.startswith("posenc.")


def export_pretrained(module: nn.Module, out_dir: str, tokenizer_dir: str | None = None) -> dict[str, Any]:
    """Write ``module``'s Hugging Face model with its injected encoding to ``out_dir``.

    Returns ``{"format": "transformers" | "posenc_lightning", "rope_parameters": ...}``; the
    second format needs `load_pretrained` (a warning says so)."""
    from posenc_lightning.inject import injected_spec

    hf = _single_hf(module)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    enc = injected_encoding(hf)
    spec = injected_spec(hf) or injected_spec(module)
    originals = getattr(hf, adapter.ORIGINALS, None) or {}
    state = {k: v for k, v in hf.state_dict().items() if not _is_posenc_key(k)}
    has_rope = adapter.rotary_module(hf) is not None
    rope = rope_config(hf, scheduled="schedule" in (spec or {})) if enc is not None and has_rope else None
    config = hf.config.__class__.from_dict(hf.config.to_dict())
    # engines pick their model class from it (vLLM, llama.cpp's converter); a config built in code lacks it
    config.architectures = config.architectures or [type(hf).__name__]
    if "wpe" in originals:  # the model's own table, so that transformers loads the files cleanly
        state[_wpe_key(hf)] = originals["wpe"].weight.detach()
    hf.save_pretrained(str(out), state_dict=state)
    result: dict[str, Any] = {"format": "transformers", "rope_parameters": None}
    if spec is None:
        pass
    elif rope is not None:
        params, max_pos = rope
        config.rope_parameters = params
        if max_pos is not None:
            config.max_position_embeddings = int(max_pos)
        result["rope_parameters"] = params
    else:
        torch.save({k: v.detach().clone() for k, v in hf.state_dict().items() if _is_posenc_key(k)}, out / STATE_FILE)
        (out / SPEC_FILE).write_text(json.dumps(spec, indent=2, default=str))
        result["format"] = "posenc_lightning"
        warnings.warn(f"{spec['encoding']} is not a transformers rope law: {out} needs "
                      f"posenc_lightning.load_pretrained({str(out)!r}) to load with its encoding "
                      f"(plain transformers would load the model without it)", stacklevel=2)
    config._attn_implementation = originals.get("attn_implementation", config._attn_implementation)
    config.save_pretrained(str(out))
    src = tokenizer_dir or getattr(module, "tokenizer_dir", None)
    if src:
        for name in _TOKENIZER_FILES:
            if (Path(src) / name).is_file():
                shutil.copy(Path(src) / name, out / name)
    return result


def _wpe_key(hf: nn.Module) -> str:
    for name, m in hf.named_modules():
        if m is hf.base_model.wpe:
            return f"{name}.weight"
    return "transformer.wpe.weight"


def load_pretrained(path: str, **kwargs: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path)`` (local files only) with the encoding an
    `export_pretrained` directory names re-injected and its parameters loaded."""
    from transformers import AutoModelForCausalLM

    from posenc_lightning.inject import CHECKPOINT_KEY, restore_from_checkpoint

    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)
    spec_file = Path(path) / SPEC_FILE
    if spec_file.is_file():  # one encoding or a layer schedule, as a checkpoint names it
        restore_from_checkpoint(hf, {CHECKPOINT_KEY: json.loads(spec_file.read_text())})
        saved = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)
        missing = {k for k in hf.state_dict() if _is_posenc_key(k)} - set(saved)
        if missing:
            raise ValueError(f"load_pretrained: {STATE_FILE} in {path} lacks {sorted(missing)[:4]}")
        hf.load_state_dict(saved, strict=False)
    return hf
