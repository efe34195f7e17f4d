"""``posenc train``: the main job on LightningCLI (`TinyGPT` on the bundled corpus, the encoding
injected by a `PosEncCallback`). Every ``--trainer.*``, ``--model.*``, ``--data.*`` and
``--posenc.*`` option is documented in ``posenc train --help`` with its default;
``--print_config`` prints the full config, ``--config FILE`` reads one. The encoding is chosen
with ``--posenc.*`` only (default rope); the model records it in ``hparams.yaml``.

    posenc train --posenc.encoding=alibi
    posenc train --posenc.encoding=fire --posenc.config='{init_L: 64}' --trainer.max_steps=500
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from posenc_lightning.recipes import RecipeCLI

#: the main job's defaults (a minute of CPU on 2 cores); every one can be overridden
TRAINER_DEFAULTS: dict[str, Any] = {
    "max_steps": 300, "val_check_interval": 100, "check_val_every_n_epoch": None, "log_every_n_steps": 10,
    "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
               "init_args": {"save_dir": "runs", "name": ""}},  # name "" = the encoding's name
}
MODEL_DATA_DEFAULTS: dict[str, Any] = {
    "model.d_model": 128, "model.n_layers": 4, "model.n_heads": 4, "model.lr": 3e-3,
    "data.seq_len": 128, "data.batch_size": 16, "data.max_bytes": 4_000_000, "data.max_val_windows": 32,
    "posenc.encoding": "rope", "seed_everything": 0,
}


def _bare(_: Any) -> None:
    """The model's own encoding arguments under ``posenc train``: none (the `PosEncCallback` injects it)."""


class TrainCLI(RecipeCLI):
    """LightningCLI(TinyGPT, CorpusDataModule) with a ``--posenc.*`` group (`PosEncCallback`,
    added to the trainer's callbacks); the model's length follows ``--data.seq_len``."""

    recipe = "train"

    def add_arguments_to_parser(self, parser: Any) -> None:
        from posenc_lightning.callbacks import PosEncCallback

        parser.add_lightning_class_args(PosEncCallback, "posenc")
        parser.link_arguments("data.seq_len", "model.max_seq_len")
        # one way to choose the encoding: --posenc.*. The model is built bare (no --model.encoding /
        # --model.encoding_cfg options) and the callback records the encoding it injects in the
        # model's hyperparameters (hparams.yaml, checkpoints)
        parser.link_arguments("posenc.encoding", "model.encoding", compute_fn=_bare)
        parser.link_arguments("posenc.config", "model.encoding_cfg", compute_fn=_bare)
        parser.set_defaults(MODEL_DATA_DEFAULTS)
        # PosEncCallback's encoding has no default of its own, so the option was marked required;
        # it has one here (rope): not required, and --help says so once
        parser._option_string_actions["--posenc.encoding"].required = False

    def before_instantiate_classes(self) -> None:
        super().before_instantiate_classes()
        cfg = self.config
        t = cfg["trainer"]
        logger = t.get("logger")
        enc = cfg["posenc"]["encoding"]
        if logger and getattr(logger, "init_args", None) is not None and logger.init_args.get("name") == "":
            logger.init_args["name"] = enc if isinstance(enc, str) else getattr(enc, "class_path", "encoding").split(".")[-1]
        steps, every = t.get("max_steps") or -1, t.get("val_check_interval")
        if isinstance(every, int) and 0 < steps < every:  # validate at least at the end
            t["val_check_interval"] = steps


def main(args: list[str] | None = None) -> int:
    """Train and print ``encoding=... steps=... val_loss=... val_ppl=... logs=...``."""
    import torch

    from posenc_lightning.data import CorpusDataModule
    from posenc_lightning.models import TinyGPT
    from posenc_lightning.recipes import RunDirSaveConfig, recipe_parser_kwargs

    if args is None:
        args = sys.argv[1:]
    args = [("--posenc.encoding" + a[len("--encoding"):]) if a == "--encoding" or a.startswith("--encoding=") else a
            for a in args]  # --encoding NAME: short for --posenc.encoding=NAME
    with warnings.catch_warnings():  # `posenc train ARGS` hands ARGS on: not a mistake here
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        cli = TrainCLI(TinyGPT, CorpusDataModule, run=False, args=args, trainer_defaults=TRAINER_DEFAULTS,
                       save_config_callback=RunDirSaveConfig, save_config_kwargs={"overwrite": True},
                       parser_kwargs={**recipe_parser_kwargs("train", __doc__), "prog": "posenc train"})
    torch.set_num_threads(max(1, torch.get_num_threads()))
    trainer = cli.trainer
    trainer.fit(cli.model, cli.datamodule)
    metrics = trainer.callback_metrics
    ppl = float(metrics["val/ppl"]) if "val/ppl" in metrics else float("nan")
    enc = cli.config["posenc"]["encoding"]
    log_dir = trainer.log_dir  # collective under DDP: every rank
    if trainer.is_global_zero:
        print(f"encoding={enc} steps={trainer.global_step} "
              f"val_loss={float(metrics.get('val/loss', float('nan'))):.4f} val_ppl={ppl:.3f} logs={log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
