"""Compare positional encodings on the synthetic length-generalization tasks: for every task and
encoding, train a small TinyGPT at the training length L, then exact-match accuracy at L x 1..16.
An entry of ``--tasks.two_phase`` (default: ``drope``, DroPE) trains with one encoding, then
another in its place (weights kept) for a fraction of the steps, e.g. RoPE then NoPE recalibrated.
Writes ``results.json`` / ``results.md`` (with the papers' expectations checked), one heatmap per
task (``heatmap_<task>.png``) and TensorBoard scalars (``tb/<task>/<encoding>``) in the run
directory. Each finished (task, encoding) cell is saved under ``cells/`` and not retrained when the
run is repeated with the same settings (``--tasks.retrain=true`` retrains).

    posenc run compare_tasks                                    # the default subset
    posenc run compare_tasks --tasks.full=true                  # every registered encoding x every task
    posenc run compare_tasks --tasks.tasks='[copy]' --tasks.encodings='[nope,rope]'
    posenc run compare_tasks --tasks.tasks='[passkey]' --tasks.encodings='[rope,drope]'
    posenc report runs/compare_tasks
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import lightning.pytorch as pl

from posenc_lightning.callbacks import PosEncCallback, TaskEvalCallback
from posenc_lightning.data.tasks import TASKS, TaskDataModule, build_task
from posenc_lightning.encodings import available_encodings
from posenc_lightning.encodings.presets import available_presets
from posenc_lightning.eval.task_report import jsonable, render_tasks
from posenc_lightning.inject import inject
from posenc_lightning.models import TinyGPT
from posenc_lightning.recipes import RecipeCLI, RunDirSaveConfig, encoding_name, recipe_parser_kwargs, stop_reason
from posenc_lightning.recipes.drope import DROPE
from posenc_lightning.recipes.phases import TwoPhase

DEFAULT_TASKS = ["copy", "flip_flop", "selective_copy", "mqar", "counting"]
DEFAULT_ENCODINGS = ["nope", "rope", "alibi", "fire", "cope", "fox", "sba", "yarn"]
#: encoding_cfg keys that state a length in tokens, written for the shared L: a task with its own L
#: scales them by its L over the shared one (a YaRN trained at 16 has an original length of 16)
LENGTH_KEYS = ("max_seq_len", "original_max_position_embeddings", "max_position_embeddings")


@dataclass
class TasksOptions:
    """``--tasks.*`` of compare_tasks.

    Args:
        tasks: tasks to run (``posenc_lightning.data.tasks.TASKS``).
        encodings: encodings to train on each task.
        full: every registered encoding on every task (overrides ``tasks`` and ``encodings``).
        exclude: encodings to skip.
        task_cfg: per-task arguments, e.g. {mqar: {n_pairs: 8}}.
        task_settings: per-task training settings over the shared ones: ``{task: {model: {...},
            data: {...}, trainer: {max_steps: ...}, source: "the paper the setting follows"}}``;
            ``model`` / ``data`` / ``trainer`` keys replace ``--model.*`` / ``--data.*`` /
            ``--trainer.*`` for that task only; ``data.train_len`` gives the task its own L (its
            cells train up to it and test at it x ``multiples``; the ``LENGTH_KEYS`` of
            ``encoding_cfg``, written for the shared L, scale with it).
        seeds: every cell is trained once per seed (model init and training data); results show
            the mean and the spread, and a verdict needs every seed to agree.
        encoding_cfg: per-encoding arguments, e.g. {yarn: {factor: 1.0, original_max_position_embeddings: 32}};
            a two-phase entry's are its first encoding's.
        two_phase: entries trained in two phases, by name: ``{name: {first, then, fraction, lr,
            source}}`` (`TwoPhase`): ``first`` for the task's steps, then ``then`` in its place
            (every weight kept) for ``fraction`` of those steps at peak ``lr`` on fresh examples,
            evaluated with ``then``. Default: ``drope`` (RoPE, then NoPE; DroPE's settings,
            ``posenc_lightning.recipes.drope.DROPE``). A name here is an entry of ``encodings``.
        scale_with_length: encodings evaluated zero-shot with factor n/L at length n (PI/NTK/YaRN protocol).
        multiples: evaluation lengths as multiples of the training length (--data.train_len, or the
            task's own).
        test_examples: examples per evaluation length.
        results_dir: the run directory: results.*, heatmap_<task>.png, cells/, tb/.
        retrain: retrain cells already finished with the same settings.
        num_threads: torch CPU threads (0 = torch's default; 1 is fastest on a busy shared machine).
    """

    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    encodings: list[str] = field(default_factory=lambda: list(DEFAULT_ENCODINGS))
    full: bool = False
    exclude: list[str] = field(default_factory=list)
    task_cfg: dict[str, dict[str, Any]] = field(default_factory=dict)
    task_settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=lambda: [0])
    encoding_cfg: dict[str, dict[str, Any]] = field(default_factory=dict)
    two_phase: dict[str, dict[str, Any]] = field(default_factory=lambda: {"drope": DROPE.config()})
    scale_with_length: list[str] = field(default_factory=lambda: ["yarn"])
    multiples: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    test_examples: int = 64
    results_dir: str = "runs/compare_tasks"
    retrain: bool = False
    num_threads: int = 0


class TasksCLI(RecipeCLI):
    options_class = TasksOptions
    recipe = "compare_tasks"
    results_group = "tasks"


def grid(cfg: TasksOptions) -> tuple[list[str], list[str]]:
    """The (tasks, encodings) the run covers.

    Raises:
        ValueError: an unknown task or encoding (the message lists the known ones).
    """
    tasks = sorted(TASKS) if cfg.full else list(cfg.tasks)
    names = available_encodings() if cfg.full or "all" in cfg.encodings else list(cfg.encodings)
    names = [n for n in names if n not in set(cfg.exclude)]
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ValueError(f"--tasks.tasks: unknown {bad}; known tasks: {sorted(TASKS)}")
    known = available_encodings() + available_presets()  # a preset is a layer schedule by name
    unknown = [n for n in names if n not in known and n not in cfg.two_phase]
    if unknown:
        raise ValueError(f"--tasks.encodings: unknown {unknown}; known: {known + sorted(cfg.two_phase)}")
    for n in names:
        spec = two_phase(cfg, n)
        bad = [e for e in ((spec.first, spec.then) if spec else ()) if e not in known]
        if bad:
            raise ValueError(f"--tasks.two_phase.{n}: unknown encodings {bad}; known: {known}")
    return tasks, names


def two_phase(cfg: TasksOptions, name: str) -> TwoPhase | None:
    """The `TwoPhase` entry ``name`` of ``--tasks.two_phase``, None for a one-phase encoding.

    Raises:
        ValueError: the entry does not build a `TwoPhase` (the message names its fields).
    """
    entry = cfg.two_phase.get(name)
    if entry is None:
        return None
    try:
        return TwoPhase(**dict(entry))
    except TypeError as e:
        raise ValueError(f"--tasks.two_phase.{name}: {e}; its fields: first, then, fraction, lr, source") from e


def main(args: list[str] | None = None) -> dict[str, Any]:
    cli = TasksCLI(TinyGPT, TaskDataModule, run=False, args=args, save_config_callback=RunDirSaveConfig,
                   save_config_kwargs={"overwrite": True}, trainer_defaults={"logger": False},
                   parser_kwargs=recipe_parser_kwargs("compare_tasks", __doc__))
    cfg: TasksOptions = cli.options_value
    if cfg.num_threads > 0:
        import torch

        torch.set_num_threads(cfg.num_threads)
    tasks, names = grid(cfg)
    out = Path(cfg.results_dir)
    data_cfg = {k: v for k, v in dict(cli.config["data"]).items() if k not in ("task", "task_cfg", "seed")}
    model_cfg = {k: v for k, v in dict(cli.config["model"]).items()
                 if k not in ("encoding", "encoding_cfg", "vocab_size", "max_seq_len")}
    trainer_cfg = dict(cli.config["trainer"])
    barebones = bool(trainer_cfg.get("barebones"))
    L = int(data_cfg["train_len"])
    command = " ".join(["python", "recipes/compare_tasks.py", *(sys.argv[1:] if args is None else args)])
    results: dict[str, Any] = {"recipe": "compare_tasks", "title": "compare_tasks", "command": command,
                               "train_len": L, "multiples": list(cfg.multiples), "model": model_cfg,
                               "data": data_cfg, "max_steps": trainer_cfg.get("max_steps"), "seeds": list(cfg.seeds),
                               "tasks": {}}
    total, k = len(tasks) * len(names) * len(cfg.seeds), 0
    for task in tasks:
        t_model, t_data, t_trainer, source = task_settings(cfg, task, model_cfg, data_cfg, trainer_cfg)
        t_len = int(t_data["train_len"])
        results["tasks"][task] = entry = {"config": build_task(task, **cfg.task_cfg.get(task, {})).config(),
                                          "source": source, "train_len": t_len, "model": t_model, "data": t_data,
                                          "max_steps": t_trainer.get("max_steps"), "exact_match": {},
                                          "token_accuracy": {}, "by_seed": {}, "failures": {}, "seconds": {},
                                          "steps": {}, "final_loss": {}}
        for name in names:
            enc_cfg = scaled_lengths(cfg.encoding_cfg.get(name, {}), L, t_len)
            phases = two_phase(cfg, name)
            cells: dict[int, dict[str, Any]] = {}
            for seed in cfg.seeds:
                k += 1
                dm = TaskDataModule(task=task, task_cfg=cfg.task_cfg.get(task, {}), seed=seed, **t_data)
                entry["min_train_len"] = dm.min_train_len
                signature = jsonable({"task": task, "task_cfg": dm.task.config(), "encoding": name,
                                      "encoding_cfg": enc_cfg, "model": _signed_model(t_model), "data": t_data,
                                      "seed": seed,
                                      "multiples": list(cfg.multiples), "test_examples": cfg.test_examples,
                                      "scale_with_length": name in cfg.scale_with_length,
                                      "trainer": {key: t_trainer.get(key) for key in ("max_steps", "precision",
                                                                                     "gradient_clip_val")},
                                      # only where set: one-phase cells keep their signature
                                      **({"two_phase": phases.signature()} if phases else {})})
                cell_file = out / "cells" / task / name / f"seed{seed}.json"
                cell = _finished(cell_file, signature) if not cfg.retrain else None
                where = f"{k}/{total} {task}/{name} seed {seed}"
                if cell is not None:
                    print(f"[compare_tasks] {where}: finished before, not retrained", flush=True)
                else:
                    print(f"[compare_tasks] {where}: training", flush=True)
                    cell = run_cell(cli, dm, Cell(task, name, seed, enc_cfg, t_model, t_trainer, phases), cfg, out,
                                    barebones)
                    if "error" not in cell:
                        cell_file.parent.mkdir(parents=True, exist_ok=True)
                        cell_file.write_text(json.dumps(jsonable({"signature": signature, **cell}), indent=1))
                cells[seed] = cell
            _collect(entry, name, cells)
            if pl.utilities.rank_zero.rank_zero_only.rank == 0:
                render_tasks(results, out, heatmaps=False)  # the table so far: a stopped run still shows its cells
    if pl.utilities.rank_zero.rank_zero_only.rank == 0:
        md = render_tasks(results, out, heatmaps=True)
        if not barebones:
            _tensorboard_summary(results, out, md)
        print(md, flush=True)
    return results


def _signed_model(model_cfg: dict[str, Any]) -> dict[str, Any]:
    """The model settings a cell's signature records: ``qkv_init_std`` only where it is set, so
    cells finished before the option existed keep their signature."""
    return {k: v for k, v in model_cfg.items() if not (k == "qkv_init_std" and v is None)}


def _finished(path: Path, signature: dict[str, Any]) -> dict[str, Any] | None:
    """The saved cell at ``path`` when it was run with the same ``signature``, else None."""
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return saved if saved.get("signature") == signature else None


@dataclass(frozen=True)
class Cell:
    """One trained model of the grid: a task, an encoding, a seed and the settings it trains under;
    ``phases`` for a two-phase entry (``name`` is then the entry's, not an encoding's)."""

    task: str
    name: str
    seed: int
    enc_cfg: dict[str, Any]
    model_cfg: dict[str, Any]
    trainer_cfg: dict[str, Any]
    phases: TwoPhase | None = None

    @property
    def encodings(self) -> list[tuple[str, dict[str, Any]]]:
        """``[(encoding, config)]`` of each training phase: the encoding, or a two-phase entry's two."""
        if self.phases is None:
            return [(self.name, self.enc_cfg)]
        return [(self.phases.first, self.enc_cfg), (self.phases.then, {})]


def task_settings(cfg: TasksOptions, task: str, model_cfg: dict[str, Any], data_cfg: dict[str, Any],
                  trainer_cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], str]:
    """``(model, data, trainer, source)`` of ``task``: the shared settings with the task's
    ``--tasks.task_settings`` entry over them.

    Raises:
        ValueError: an entry with an unknown section, or a ``source`` that is not a string.
    """
    over = dict(cfg.task_settings.get(task) or {})
    bad = sorted(set(over) - {"model", "data", "trainer", "source"})
    if bad:
        raise ValueError(f"--tasks.task_settings.{task}: unknown {bad}; known: data, model, source, trainer")
    if not isinstance(over.get("source", ""), str):  # "a: b" on the command line reads as a mapping
        raise ValueError(  # noqa: TRY004  a settings error, like the others here
            f"--tasks.task_settings.{task}.source must be a string, got {over['source']!r} "
            "(a ': ' inside it makes the command line read it as a mapping)")
    data = {**data_cfg, **(over.get("data") or {})}
    return ({**model_cfg, **(over.get("model") or {})}, data, {**trainer_cfg, **(over.get("trainer") or {})},
            str(over.get("source", "")))


def scaled_lengths(enc_cfg: dict[str, Any], shared_len: int, task_len: int) -> dict[str, Any]:
    """``enc_cfg`` for a task trained at ``task_len``: its `LENGTH_KEYS`, written for the shared
    ``shared_len``, times ``task_len / shared_len`` (rounded); every other argument as given."""
    return {k: (round(v * task_len / shared_len) if k in LENGTH_KEYS and isinstance(v, int) else v)
            for k, v in enc_cfg.items()}


def run_cell(cli: Any, dm: TaskDataModule, c: Cell, cfg: TasksOptions, out: Path, barebones: bool) -> dict[str, Any]:
    """Train one (task, encoding, seed) cell and evaluate it at every length: ``{exact_match: {n: acc},
    token_accuracy, steps, seconds, final_loss}`` (a two-phase cell adds ``phases``: each phase's
    encoding as read from the model after it, steps, stop reason and loss), or ``{error: ...}`` when
    the encoding cannot build in TinyGPT or training fails."""
    t0 = time.perf_counter()
    L = dm.train_len
    build = {**c.model_cfg, "vocab_size": dm.vocab_size, "max_seq_len": L, "encoding": None}
    try:  # a dry build: an encoding that cannot run in TinyGPT is reported, the rest go on
        for enc, enc_cfg in c.encodings:
            inject(TinyGPT(**build), enc, **enc_cfg)
    except Exception as e:  # noqa: BLE001
        return {"error": f"cannot build: {e}"}
    pl.seed_everything(c.seed)
    model = TinyGPT(**build)
    evaluator = TaskEvalCallback(multiples=cfg.multiples, base_len=L, examples=cfg.test_examples,
                                 scale_with_length=c.name in cfg.scale_with_length)
    logger = _logger(out, c, "", barebones)
    over = {k: c.trainer_cfg[k] for k in ("max_steps", "gradient_clip_val") if k in c.trainer_cfg}
    phases: list[dict[str, Any]] = []
    trainer, data = None, dm
    for i, (enc, enc_cfg) in enumerate(c.encodings):
        if trainer is not None and c.phases is not None:  # the next phase: the same model and weights,
            data = data.continued(trainer.global_step * dm.batch_size)  # on examples it has not seen
            over = {**over, "max_steps": c.phases.prepare(model, trainer.global_step)}
        trainer = cli.instantiate_trainer(logger=logger if i == 0 else _logger(out, c, f"_{enc}", barebones),
                                          callbacks=[PosEncCallback(enc, config=enc_cfg)], enable_checkpointing=False,
                                          limit_val_batches=0, **over)
        try:
            trainer.fit(model, data)
        except Exception as e:  # noqa: BLE001  one failing cell is reported, the grid goes on
            return {"error": f"training failed: {type(e).__name__}: {e}"}
        loss = trainer.callback_metrics.get("train/loss")
        phases.append({"encoding": encoding_name(model), "steps": trainer.global_step, "stopped": stop_reason(trainer),
                       "final_loss": float(loss) if loss is not None else math.nan})
    acc = evaluator.evaluate(model, trainer, datamodule=dm)
    steps = sum(p["steps"] for p in phases)
    cell = {"exact_match": acc, "token_accuracy": dict(evaluator.token_accuracy), "failures": dict(evaluator.failures),
            "steps": steps, "stopped": next((p["stopped"] for p in phases if p["stopped"]), None),
            "final_loss": phases[-1]["final_loss"], "seconds": time.perf_counter() - t0,
            **({"phases": phases} if c.phases is not None else {})}
    if logger:
        logger.log_metrics({**{f"task_eval/exact_match/{n}": v for n, v in acc.items()},
                            **{f"task_eval/token_accuracy/{n}": v for n, v in evaluator.token_accuracy.items()}},
                           step=steps)
        logger.save()
    print(f"[compare_tasks] {c.task}/{c.name} seed {c.seed}: " + ", ".join(f"{n}: {100 * v:.0f}%" for n, v in acc.items())
          + f" (loss {cell['final_loss']:.3f}, {cell['seconds']:.0f}s)", flush=True)
    return cell


def _logger(out: Path, c: Cell, suffix: str, barebones: bool) -> Any:
    """The cell's TensorBoard logger (``tb/<task>/<name>_seed<seed><suffix>``), False when barebones."""
    if barebones:
        return False
    from lightning.pytorch.loggers import TensorBoardLogger

    return TensorBoardLogger(str(out / "tb"), name=c.task, version=f"{c.name}_seed{c.seed}{suffix}",
                             default_hp_metric=False)


def _collect(entry: dict[str, Any], name: str, cells: dict[int, dict[str, Any]]) -> None:
    """The encoding's row: per-seed exact match under ``by_seed``, the seeds' mean in ``exact_match``."""
    errors = {s: c["error"] for s, c in cells.items() if "error" in c}
    if errors:
        entry["failures"][name] = "; ".join(f"seed {s}: {e}" for s, e in errors.items())
        return

    def table(cell: dict[str, Any], key: str) -> dict[int, float]:
        return {int(n): (math.nan if v is None else v) for n, v in cell[key].items()}

    by_seed = {s: table(c, "exact_match") for s, c in cells.items()}
    entry["by_seed"][name] = by_seed
    entry["exact_match"][name] = _mean([by_seed[s] for s in cells])
    entry["token_accuracy"][name] = _mean([table(c, "token_accuracy") for c in cells.values()])
    entry["seconds"][name] = sum(c["seconds"] for c in cells.values())
    entry["steps"][name] = max(c["steps"] for c in cells.values())
    entry["final_loss"][name] = sum(c["final_loss"] for c in cells.values()) / len(cells)
    fails = [f"seed {s}: {n}: {v}" for s, c in cells.items() for n, v in (c.get("failures") or {}).items()]
    if fails:
        entry["failures"][name] = "; ".join(fails)


def _mean(rows: list[dict[int, float]]) -> dict[int, float]:
    return {n: sum(r.get(n, math.nan) for r in rows) / len(rows) for n in rows[0]}


def _tensorboard_summary(results: dict[str, Any], out: Path, md: str) -> None:
    """The heatmaps and the table in TensorBoard (run ``tb/summary``)."""
    from torch.utils.tensorboard import SummaryWriter

    from posenc_lightning.eval.plots import families_of
    from posenc_lightning.eval.task_report import accuracy_heatmap

    writer = SummaryWriter(str(out / "tb" / "summary"))
    for task, r in results["tasks"].items():
        fam = families_of(list(r["exact_match"]))
        fig = accuracy_heatmap(r["exact_match"], None, f"compare_tasks: {task}", r["train_len"], fam)
        if fig is not None:
            writer.add_figure(f"compare_tasks/{task}", fig)  # closes the figure
    writer.add_text("compare_tasks/results", md)
    writer.close()


if __name__ == "__main__":
    main()
