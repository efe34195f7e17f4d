"""`PosEncCallback`: inject an encoding into a LightningModule at ``setup``."""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

from posenc_lightning.encodings.base import Encoding
from posenc_lightning.encodings.schedule import LayerSchedule
from posenc_lightning.inject import CHECKPOINT_KEY, find_mixin_modules, inject, injected_spec
from posenc_lightning.plain import plain


class PosEncCallback(pl.Callback):
    """Builds the encoding and injects it into every mixin module of the LightningModule.

    Runs at ``setup`` (before the DDP wrap, the optimizer and checkpoint restore) and again right
    after ``configure_model`` for modules that build their layers there. Idempotent: a second
    ``setup`` (fit then test), or a model from ``load_from_checkpoint`` that already holds the
    same encoding (same name and config), keeps it and its trained parameters (`inject` compares
    specs). The encoding's name and config go into the checkpoint (``checkpoint["posenc_lightning"]``) so
    `posenc_lightning.restore_from_checkpoint` / ``TinyGPT.load_from_checkpoint`` rebuild it.

    Args:
        encoding: a registered name (``posenc list``), a preset, an `Encoding` or a `LayerSchedule`.
        backend: ``auto``, ``eager``, ``sdpa``, ``flex``, ``triton`` or ``blockwise``.
        share_across_layers: one encoding for all layers (default) or one per layer.
        log_hparams: log the encoding's hyperparameters to the trainer's loggers.
        config: the encoding's arguments, when ``encoding`` is a name, as one dict: the form
            LightningCLI / YAML can read (``init_args: {encoding: fire, config: {init_L: 64}}``).
        schedule: a layer schedule's rules (`LayerSchedule`), the form YAML can read
            (``init_args: {schedule: [{layers: every 4, encoding: nope}, {layers: rest, encoding: rope,
            window: 256}]}``), in place of ``encoding`` (which then names the schedule, if given).
        **cfg: the same arguments as keywords, for Python callers (``PosEncCallback("fire", init_L=64)``).
    """

    def __init__(self, encoding: str | Encoding | LayerSchedule | None = None, backend: str = "auto",
                 share_across_layers: bool = True, log_hparams: bool = True, config: dict[str, Any] | None = None,
                 schedule: list[dict[str, Any]] | None = None, **cfg: Any) -> None:
        config, cfg, schedule = plain(config), plain(cfg), plain(schedule)  # OmegaConf containers as dicts, lists
        if schedule is not None:
            if not isinstance(encoding, (str, type(None))) or config or cfg:
                raise ValueError("PosEncCallback: give either schedule=[rules] (encoding= may name it) or an "
                                 "encoding with its config, not both")
            encoding = LayerSchedule(schedule, name=encoding or "schedule")
        if encoding is None:
            raise ValueError("PosEncCallback needs an encoding (a name, an Encoding, a preset) or schedule=[rules]")
        both = sorted(set(config or {}) & set(cfg))
        if both:
            raise ValueError(f"PosEncCallback: {both} given both in config={config!r} and as keywords {cfg!r}; "
                             f"give each encoding argument once")
        self.encoding = encoding
        self.backend = backend
        self.share_across_layers = share_across_layers
        self.log_hparams = log_hparams
        self.cfg = {**(config or {}), **cfg}
        self.injected: Encoding | None = None

    @property
    def encoding_name(self) -> str:
        return self.encoding if isinstance(self.encoding, str) else self.encoding.name  # an Encoding's or a schedule's

    @property
    def state_key(self) -> str:
        return self._generate_state_key(encoding=self.encoding_name)

    def _inject(self, pl_module: pl.LightningModule) -> None:
        # `inject` compares specs: the same encoding already in the model (a second setup, or a
        # model from ``load_from_checkpoint``) is kept with its trained parameters
        self.injected = inject(pl_module, self.encoding, backend=self.backend,
                               share_across_layers=self.share_across_layers, **self.cfg)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._wrap_configure_model(pl_module)
        try:
            self._inject(pl_module)
        except ValueError:
            if not is_overridden("configure_model", pl_module) or any(find_mixin_modules(pl_module)):
                raise  # layers there (or none coming): the error stands; else configure_model builds them
        if self.injected is None:
            return
        recorded = self._record_in_model_hparams(pl_module)
        if self.log_hparams:
            spec = injected_spec(pl_module) or {}
            logged = ({"posenc/encoding": spec["encoding"], "posenc/schedule": str(spec["schedule"]["rules"])}
                      if "schedule" in spec else self.injected.hparams_for_logging())
            if recorded:  # the model's own ``encoding`` hyperparameter names it: one entry, not two
                logged.pop("posenc/encoding", None)
            for logger in trainer.loggers:
                logger.log_hyperparams(logged)

    def _record_in_model_hparams(self, pl_module: pl.LightningModule) -> bool:
        """A model whose hyperparameters name its encoding (`TinyGPT`'s ``encoding`` / ``encoding_cfg``,
        None when it was built bare for this callback) records the one injected: ``hparams.yaml`` and
        checkpoints then say which encoding was used. Returns whether the model has such a hyperparameter."""
        hparams = pl_module.hparams
        if "encoding" not in hparams:
            return False
        if isinstance(self.encoding, LayerSchedule):  # rules are no encoding name: the checkpoint's spec has them
            return True
        name = self.encoding_name
        cfg = (dict(self.cfg) or None) if isinstance(self.encoding, str) else None
        if hparams.get("encoding") != name or ("encoding_cfg" in hparams and hparams.get("encoding_cfg") != cfg):
            updated = {**hparams, "encoding": name, **({"encoding_cfg": cfg} if "encoding_cfg" in hparams else {})}
            # save_hyperparameters also refreshes the copy Lightning logs (``hparams_initial``)
            pl_module.save_hyperparameters(updated, logger=getattr(pl_module, "_log_hyperparams", True))
        return True

    def _wrap_configure_model(self, pl_module: pl.LightningModule) -> None:
        if not is_overridden("configure_model", pl_module) or getattr(pl_module, "_posenc_wrapped", False):
            return
        original = pl_module.configure_model

        @functools.wraps(original)
        def configure_model() -> None:
            original()
            self._inject(pl_module)

        pl_module.configure_model = configure_model  # type: ignore[method-assign]
        pl_module._posenc_wrapped = True

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # undo the wrap: a local function in the module's __dict__ would stop it from pickling
        # (ddp_spawn, torch.save(model)) after the run; the next setup wraps again
        if pl_module.__dict__.pop("_posenc_wrapped", False):
            pl_module.__dict__.pop("configure_model", None)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        spec = injected_spec(pl_module)
        if spec is not None:
            checkpoint[CHECKPOINT_KEY] = dict(spec)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        saved = (checkpoint.get(CHECKPOINT_KEY) or {}).get("encoding")
        if saved is not None and saved != self.encoding_name:
            raise ValueError(f"this checkpoint was trained with encoding {saved!r} but the PosEncCallback "
                             f"injects {self.encoding_name!r}; resume with PosEncCallback({saved!r}) (or start "
                             f"a new run from the weights with load_from_checkpoint to switch encodings)")

    def state_dict(self) -> dict[str, Any]:
        return {"encoding": self.encoding_name, "backend": self.backend,
                "share_across_layers": self.share_across_layers}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("encoding") not in (None, self.encoding_name):
            raise ValueError(f"this checkpoint was trained with encoding {state_dict['encoding']!r} but the "
                             f"PosEncCallback injects {self.encoding_name!r}; use the same encoding to resume")
