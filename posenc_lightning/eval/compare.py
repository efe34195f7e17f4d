"""The length-generalization comparison: train TinyGPT per encoding at L, perplexity at L..16L.

Used by ``recipes/compare_encodings.py`` (training) and ``posenc report RUN_DIR`` (rendering the
same table and plot from the TensorBoard event files of a run).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from posenc_lightning.callbacks.length_eval import length_plot, length_table

PPL_PREFIX = "length_eval/ppl/"


def read_run(run_dir: str | Path) -> tuple[dict[str, dict[int, float]], dict[str, dict[str, float]]]:
    """From every event file under ``run_dir``: ``({run: {length: last ppl}}, {run: {tag: last value}})``
    where ``run`` is the event file's directory relative to ``run_dir`` (the encoding's name)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(run_dir)
    files = sorted(root.rglob("events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"no TensorBoard event files under {root}; give the directory a "
                                f"compare_encodings run wrote (its compare.results_dir)")
    ppl: dict[str, dict[int, float]] = {}
    scalars: dict[str, dict[str, float]] = {}
    for d in sorted({f.parent for f in files}):
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0, "images": 1, "tensors": 1})
        acc.Reload()
        name = str(d.relative_to(root)) if d != root else root.name
        for tag in acc.Tags().get("scalars", []):
            ev = acc.Scalars(tag)
            if not ev:
                continue
            last = max(ev, key=lambda e: (e.step, e.wall_time)).value
            scalars.setdefault(name, {})[tag] = last
            if tag.startswith(PPL_PREFIX) and tag[len(PPL_PREFIX):].isdigit():
                ppl.setdefault(name, {})[int(tag[len(PPL_PREFIX):])] = last
    return ppl, scalars


def render(ppl: dict[str, dict[int, float]], out_dir: str | Path, base_len: int | None = None,
           failures: dict[str, dict[int, str]] | None = None, title: str = "compare_encodings",
           notes: str = "", steps: dict[str, int] | None = None, stopped: dict[str, str] | None = None) -> str:
    """Write ``results.md`` (markdown table), ``results.json`` and ``ppl_vs_length.png``; return
    the markdown. A NaN perplexity with no recorded reason shows as ``fails``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fails = {k: dict(v) for k, v in (failures or {}).items()}
    for name, r in ppl.items():
        for n, v in r.items():
            if not (v == v and math.isfinite(v)):
                fails.setdefault(name, {}).setdefault(n, "failed")
    if base_len is None and ppl:
        base_len = min(n for r in ppl.values() for n in r)
    table = length_table(ppl, fails, base_len)
    md = f"# {title}\n\nPerplexity (bytes) of TinyGPT trained at L={base_len}, evaluated at multiples of L.\n\n"
    md += table + "\n" + (f"\n{notes}\n" if notes else "")
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(json.dumps(
        {"base_len": base_len, "ppl": {k: {str(n): v for n, v in r.items()} for k, r in ppl.items()},
         "failures": {k: {str(n): v for n, v in r.items()} for k, r in fails.items()},
         "steps": dict(steps or {}), "stopped": dict(stopped or {})}, indent=2))
    fig = length_plot(ppl, str(out / "ppl_vs_length.png"), title=f"{title}: perplexity vs length (L={base_len})")
    if fig is not None:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return md


def flatness(ppl: dict[int, float]) -> float:
    """ppl at the longest finite length over ppl at the shortest (1.0 = perfectly flat)."""
    pts = sorted((n, v) for n, v in ppl.items() if v == v and math.isfinite(v))
    return pts[-1][1] / pts[0][1] if len(pts) > 1 else float("nan")


def report(run_dir: str | Path, out_dir: str | Path | None = None) -> str:
    """``posenc report RUN_DIR``: the table and plot of a run, from its TensorBoard logs."""
    ppl, _ = read_run(run_dir)
    if not ppl:
        raise ValueError(f"no {PPL_PREFIX}<length> scalars under {run_dir}: was LengthEvalCallback in the run?")
    return render(ppl, out_dir or run_dir, title=Path(run_dir).name)


def summary(meta: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in meta.items())
