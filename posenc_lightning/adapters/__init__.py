"""Adapters for models the user did not write (docs/architecture.md, injection): each maps the model's own hooks
onto the four stages and the posenc backends; `posenc_lightning.inject` picks one when it finds no
mixin module. ``hf``: transformers ``PreTrainedModel``s. (litgpt: see the README.)"""

from posenc_lightning.adapters.hf import find_hf_models

__all__ = ["find_hf_models"]
