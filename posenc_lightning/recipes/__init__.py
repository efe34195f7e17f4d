"""The code the recipes (``recipes/*.py``) and ``posenc train`` share: their LightningCLI
(`recipes.cli`), perplexity by length and the train-then-sweep body (`recipes.sweep`), and the
results writer and verdicts (`recipes.results`). The recipe scripts themselves are ``recipes/*.py``
in the checkout; ``posenc run NAME`` runs one."""

from posenc_lightning.recipes.cli import (
    BAREBONES_OFF,
    RecipeCLI,
    RunDirSaveConfig,
    finetune_trainer,
    make_cli,
    recipe_parser_kwargs,
    start_from_pretrained,
)
from posenc_lightning.recipes.results import (
    bigram_perplexity,
    encoding_name,
    extension_verdict,
    rope_base,
    run_dir,
    stop_reason,
    write_results,
)
from posenc_lightning.recipes.sweep import SweepOptions, length_sweep, perplexity, train_and_sweep

__all__ = ["BAREBONES_OFF", "RecipeCLI", "RunDirSaveConfig", "SweepOptions", "bigram_perplexity", "encoding_name",
           "extension_verdict", "finetune_trainer", "length_sweep", "make_cli", "perplexity", "recipe_parser_kwargs",
           "rope_base", "run_dir", "start_from_pretrained", "stop_reason", "train_and_sweep", "write_results"]
