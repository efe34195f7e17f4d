"""Export a Hugging Face model with an injected score-level encoding as transformers *remote code*.

`export_remote_code` writes a directory that ``AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)`` loads and runs where posenc_lightning is not installed:

- ``modeling_posenc.py``, written from this package's templates (``models/remote_templates/``): the
  model's own transformers class with its positions switched off, a config class, and an attention
  function registered with transformers' ``AttentionInterface`` that applies the encoding's formula
  in plain torch (one template per encoding family);
- ``config.json``: the model's config with ``model_type = "posenc_<type>"`` (an engine that does not
  run remote code refuses the directory instead of serving the model without its encoding),
  ``auto_map`` naming the two classes, and ``posenc`` (the encoding, its arguments and sizes);
- the weights, the encoding's parameters included under the attention modules' ``posenc.``.

Rope-family laws need no remote code: `posenc_lightning.models.hf_export.export_pretrained` writes
them as transformers ``rope_parameters``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

from torch import nn

from posenc_lightning.adapters import hf as adapter
from posenc_lightning.models.hf_export import _TOKENIZER_FILES, _is_posenc_key, _single_hf, _wpe_key, injected_encoding

TEMPLATES = Path(__file__).resolve().parent / "remote_templates"
MODELING_FILE = "modeling_posenc.py"


@dataclass(frozen=True)
class Family:
    """One template: the encodings it writes and the arguments of theirs it reads."""

    template: str
    reads: tuple[str, ...]


#: encoding name -> its template; an encoding not here has no remote-code form yet
FAMILIES: dict[str, Family] = {
    "alibi": Family("alibi", ("slope_scale",)),
    "relative_bias": Family("t5", ("num_buckets", "max_distance", "bidirectional")),
    "fire": Family("fire", ("mlp_width", "init_L", "eps")),
    "fox": Family("fox", ("rope",)),
    "sba": Family("stick_breaking", ("attend_current",)),
    "cope": Family("cope", ("max_position", "per_head")),
}


def remote_code_encodings() -> list[str]:
    """The encodings `export_remote_code` writes."""
    return sorted(FAMILIES)


def modeling_source(encoding: str, base_model: type, model_type: str) -> str:
    """The ``modeling_posenc.py`` text for ``encoding`` on top of transformers' ``base_model``.

    Args:
        encoding: a name in `FAMILIES`.
        base_model: the trained model's transformers class (``LlamaForCausalLM``, ...).
        model_type: the exported config's ``model_type``.

    Returns:
        Python source that imports torch and transformers only.
    """
    family = _family(encoding)
    module = base_model.__module__
    config_cls = base_model.config_class
    if config_cls.__module__.rsplit(".", 1)[0] != module.rsplit(".", 1)[0]:
        raise ValueError(f"export_remote_code: {base_model.__name__}'s config class {config_cls.__name__} lives "
                         f"outside its model package; export this model with format='hf'")
    body = (TEMPLATES / f"{family.template}.py.tmpl").read_text().rstrip("\n")
    return Template((TEMPLATES / "model.py.tmpl").read_text()).substitute(
        title=f"{encoding} on {base_model.__name__}: remote code written by posenc-lightning.",
        base_module=module, base_config=config_cls.__name__, base_model=base_model.__name__,
        attention=f"posenc_{family.template}", family=encoding, encoding=body, model_type=model_type,
        # the imports the family's formula uses, no others
        stdlib="import math\n\n" if "math." in body else "",
        functional="import torch.nn.functional as F\n" if "F." in body else "")


def _family(encoding: str) -> Family:
    if encoding not in FAMILIES:
        raise ValueError(f"export_remote_code: no remote-code template for encoding {encoding!r}; it has one for "
                         f"{', '.join(remote_code_encodings())} (rope-family laws: format='hf', which writes "
                         f"transformers rope_parameters)")
    return FAMILIES[encoding]


def _check_model(hf: nn.Module, encoding: str, spec: dict[str, Any]) -> None:
    """Refuse what the template's attention does not reproduce, naming it."""
    info = adapter.describe(hf)
    cfg = hf.config
    problems = []
    if info.fused_unsupported or getattr(cfg, "attn_logit_softcapping", None):
        problems.append("attention score transforms (softcapping, sinks)")
    if getattr(cfg, "sliding_window", None) is not None or getattr(cfg, "layer_types", None):
        problems.append("a sliding window or per-layer attention types")
    if info.rotary is not None and info.rotary.form not in ("half", "interleaved"):
        problems.append(f"a {info.rotary.form!r} rotary form")
    if encoding == "fox" and spec.get("config", {}).get("rope"):
        problems.append("fox with rope=True")
    if problems:
        raise ValueError(f"export_remote_code: {type(hf).__name__} with {encoding} has {'; '.join(problems)}, which the "
                         f"remote-code template does not reproduce; use format='hf' (posenc_lightning.load_pretrained)")


def export_remote_code(module: nn.Module, out_dir: str, tokenizer_dir: str | None = None) -> dict[str, Any]:
    """Write ``module``'s Hugging Face model and its injected encoding as a remote-code directory.

    Args:
        module: a ``PreTrainedModel`` with an injected encoding, or a module holding one (`HFCausalLM`).
        out_dir: the directory to write (created).
        tokenizer_dir: tokenizer files to copy beside the model (default: the module's own).

    Returns:
        ``{"format": "remote-code", "encoding": name, "modeling_file": path, "model_type": ...}``.

    Raises:
        ValueError: no encoding is injected, the encoding has no template (`FAMILIES`), or the
            model has what the template does not reproduce (a sliding window, softcapping, ...).
    """
    from posenc_lightning.inject import injected_spec

    hf = _single_hf(module)
    spec = injected_spec(hf) or injected_spec(module)
    enc = injected_encoding(hf)
    if spec is None or enc is None:
        raise ValueError("export_remote_code: the model has no injected encoding; inject one first, or save it with "
                         "save_pretrained")
    name = spec["encoding"]
    family = _family(name)
    _check_model(hf, name, spec)
    layer = adapter.attention_modules(hf)[0]
    base_cls = type(hf)
    model_type = f"posenc_{hf.config.model_type}"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MODELING_FILE).write_text(modeling_source(name, base_cls, model_type))
    originals = getattr(hf, adapter.ORIGINALS, None) or {}
    # every tensor its own copy: the shared encoding appears under each layer, and the files keep each
    state = {k: v.detach().clone() if _is_posenc_key(k) else v for k, v in hf.state_dict().items()}
    if "wpe" in originals:
        state[_wpe_key(hf)] = originals["wpe"].weight.detach()
    hf.save_pretrained(str(out), state_dict=state)
    config = hf.config.to_dict()
    config.update(model_type=model_type, architectures=["PosencForCausalLM"],
                  auto_map={"AutoConfig": "modeling_posenc.PosencConfig",
                            "AutoModelForCausalLM": "modeling_posenc.PosencForCausalLM"},
                  posenc={"encoding": name, "template": family.template,
                          "config": {k: v for k, v in spec.get("config", {}).items() if k in family.reads},
                          "n_heads": adapter.n_heads_of(layer, hf.config),
                          "head_dim": adapter.head_dim_of(layer, hf.config),
                          "d_model": int(hf.config.hidden_size)})
    config.pop("_attn_implementation_autoset", None)
    config.pop("attn_implementation", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    src = tokenizer_dir or getattr(module, "tokenizer_dir", None)
    if src:
        for fname in _TOKENIZER_FILES:
            if (Path(src) / fname).is_file():
                shutil.copy(Path(src) / fname, out / fname)
    return {"format": "remote-code", "encoding": name, "model_type": model_type,
            "modeling_file": str(out / MODELING_FILE)}

