"""Build lm-eval tasks once (offline, seeded) and evaluate them with `limit` samples per length."""

from __future__ import annotations

import contextlib
import logging
import random
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posenc_lightning.eval.offline import OfflineTaskError, check_lengths, check_offline, offline_env, ruler_patches

TASKS_DIR = Path(__file__).parent / "tasks"


@contextlib.contextmanager
def preserved_rng(seed: int | None = None) -> Iterator[None]:
    """Save python/numpy/torch (CPU and CUDA) RNG states, optionally seed, and restore them after."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        if seed is not None:
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@dataclass
class BuiltTasks:
    """Tasks built by `build_tasks`: lm-eval's task dict and the doc indices to evaluate."""

    task_dict: dict[str, Any]
    samples: dict[str, list[int]]
    lengths: dict[str, list[int | None]] = field(default_factory=dict)


def _task_manager(names: Sequence[str], include_path: Sequence[str] | None, metadata: dict[str, Any]):
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)] + [str(p) for p in include_path or []]
    ruler = str(Path(lm_eval.tasks.__file__).parent / "ruler")
    fast = TaskManager(include_path=paths + [ruler], include_defaults=False, metadata=metadata)
    if all(n in fast.all_tasks for n in names):  # indexing every lm-eval task takes ~10 s: avoid it
        return fast
    return TaskManager(include_path=paths, metadata=metadata)


_BUILT: dict[str, BuiltTasks] = {}


def build_tasks(tasks: Sequence[str], max_seq_lengths: Sequence[int], limit: int | None = None,
                tokenizer: str | None = None, seed: int = 1234, haystack_files: Sequence[str] | None = None,
                include_path: Sequence[str] | None = None, metadata: dict[str, Any] | None = None,
                reuse: bool = True) -> BuiltTasks:
    """Load ``tasks`` offline at ``max_seq_lengths`` with a fixed seed (the same data on every rank;
    the caller's RNG streams are left as they were).

    ``limit`` is samples *per length*: documents are grouped by their ``max_length`` field (RULER
    and our tasks set it) and the first ``limit`` of each group are kept.
    """
    from posenc_lightning.eval.tokenizer import byte_tokenizer_dir

    tasks = list(tasks)
    check_offline(tasks)
    check_lengths(tasks, max_seq_lengths)
    tok = tokenizer or byte_tokenizer_dir()
    meta = {"max_seq_lengths": [int(x) for x in max_seq_lengths], "tokenizer": tok, "pretrained": tok,
            "seed": seed, **({"num_samples": limit} if limit else {}), **(metadata or {})}
    if haystack_files:
        meta["files"] = list(haystack_files)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    uses_ruler = any(t.startswith(("niah_", "ruler")) or t == "longcxt" for t in tasks)
    patches = (ruler_patches(num_samples=limit, haystack_files=haystack_files) if uses_ruler
               else contextlib.nullcontext())
    with offline_env(), preserved_rng(seed), patches:
        try:
            tm = _task_manager(tasks, include_path, meta)
            unknown = [t for t in tasks if t not in tm.all_tasks]
            if unknown:
                raise ValueError(f"unknown lm-eval task(s) {unknown}; ours are passkey_generate, "
                                 f"passkey_loglikelihood, ppl_by_length, and RULER's niah_* run offline")
            loaded = tm.load(tasks)
        except (ConnectionError, OSError) as e:
            if "offline" in str(e).lower() or "connect" in str(e).lower() or "resolve" in str(e).lower():
                raise OfflineTaskError(f"an lm-eval task in {tasks} needs a download that is not cached here "
                                       f"(downloads are off in the eval path): {e}") from e
            raise
    samples, lengths = {}, {}
    for name, task in loaded["tasks"].items():
        docs = list(task.eval_docs)
        groups: dict[int | None, list[int]] = defaultdict(list)
        for i, doc in enumerate(docs):
            groups[doc.get("max_length") if isinstance(doc, dict) else None].append(i)
        keep = [i for g in groups.values() for i in (g[:limit] if limit else g)]
        samples[name] = sorted(keep)
        lengths[name] = list(groups)
    return BuiltTasks(loaded, samples, lengths)


def evaluate_tasks(lm: Any, built: BuiltTasks) -> dict[str, Any] | None:
    """Run lm-eval's ``evaluate`` (which does not reseed, unlike ``simple_evaluate``) on the built
    tasks; returns lm-eval's results on rank 0 (None elsewhere) plus ``per_length``:
    ``{task: {length: mean primary metric}}`` computed from the per-sample metrics."""
    from lm_eval.evaluator import evaluate

    with offline_env():
        res = evaluate(lm, built.task_dict, samples=built.samples, log_samples=True, bootstrap_iters=0,
                       verbosity="WARNING")
    if res is None:
        return None
    res["per_length"] = per_length(res.get("samples", {}))
    return res


def per_length(samples: dict[str, list[dict]]) -> dict[str, dict[Any, float]]:
    """Mean of each sample's primary metric grouped by its document's ``max_length``: for RULER the
    metric named by the length, otherwise the task's first metric."""
    out: dict[str, dict[Any, float]] = {}
    for task, rows in samples.items():
        acc: dict[Any, list[float]] = defaultdict(list)
        for row in sorted(rows, key=lambda r: r["doc_id"]):  # rank order must not matter
            doc, metrics = row["doc"], row["metrics"]
            length = doc.get("max_length") if isinstance(doc, dict) else None
            key = str(length) if str(length) in metrics else metrics[0]
            acc[length].append(float(row[key]))
        out[task] = {k: sum(v) / len(v) for k, v in sorted(acc.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))}
    return out
