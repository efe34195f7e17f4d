"""The length-generalization comparison: train TinyGPT per encoding at L, perplexity at L..16L.

Used by ``recipes/compare_encodings.py`` (training) and ``posenc report RUN_DIR`` (rendering the
same table and plot from the TensorBoard event files of a run).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from posenc_lightning.eval.length_report import length_table

PPL_PREFIX = "length_eval/ppl/"


def scalar_series(run_dir: str | Path, skip: Path | None = None) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Every scalar series of every event file under ``run_dir`` (except under ``skip``):
    ``{run: {tag: [(step, value), ...]}}``, ``run`` being the event file's directory relative to
    ``run_dir`` (``.`` for ``run_dir`` itself). The last value of a step wins."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(run_dir)
    files = [f for f in root.rglob("events.out.tfevents.*") if skip is None or skip not in f.parents]
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for d in sorted({f.parent for f in files}):
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0, "images": 1, "tensors": 1})
        acc.Reload()
        name = str(d.relative_to(root))
        for tag in acc.Tags().get("scalars", []):
            by_step: dict[int, float] = {}
            for e in sorted(acc.Scalars(tag), key=lambda e: (e.step, e.wall_time)):
                by_step[e.step] = e.value
            if by_step:
                out.setdefault(name, {})[tag] = sorted(by_step.items())
    return out


def length_curves(series: dict[str, dict[str, list[tuple[int, float]]]]) -> dict[str, dict[int, float]]:
    """``{run: {length: last ppl}}`` from the ``length_eval/ppl/<length>`` scalars."""
    ppl: dict[str, dict[int, float]] = {}
    for run, tags in series.items():
        for tag, pts in tags.items():
            if tag.startswith(PPL_PREFIX) and tag[len(PPL_PREFIX):].isdigit():
                ppl.setdefault(run, {})[int(tag[len(PPL_PREFIX):])] = pts[-1][1]
    return ppl


def read_run(run_dir: str | Path) -> tuple[dict[str, dict[int, float]], dict[str, dict[str, float]]]:
    """``({run: {length: last ppl}}, {run: {tag: last value}})`` from the event files under ``run_dir``."""
    series = scalar_series(run_dir)
    return length_curves(series), {r: {t: pts[-1][1] for t, pts in tags.items()} for r, tags in series.items()}


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
            if not math.isfinite(v):
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
    from posenc_lightning.eval.plots import ppl_heatmap

    fig = ppl_heatmap(ppl, str(out / "ppl_vs_length.png"), title=f"{title}: perplexity vs length", base_len=base_len)
    if fig is not None:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return md


def flatness(ppl: dict[int, float]) -> float:
    """ppl at the longest finite length over ppl at the shortest (1.0 = perfectly flat)."""
    pts = sorted((n, v) for n, v in ppl.items() if math.isfinite(v))
    return pts[-1][1] / pts[0][1] if len(pts) > 1 else float("nan")


def _ppl_from_results(payload: dict[str, Any]) -> dict[str, dict[int, float]]:
    return {k: {int(n): float("nan") if v is None else float(v) for n, v in r.items()}
            for k, r in (payload.get("ppl") or {}).items()}


_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


def rebase_links(markdown: str, src_dir: Path, out_dir: Path) -> str:
    """``markdown`` written in ``src_dir`` with its relative links (``![t](heatmap_t.png)``) made
    relative to ``out_dir``, where it is copied to (the report): the links still reach the files.
    Absolute paths, URLs and ``#anchors`` are kept."""
    def fix(m: re.Match) -> str:
        target = m.group(2)
        if target.startswith(("#", "/")) or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            return m.group(0)
        rel = os.path.relpath(Path(src_dir).resolve() / target, Path(out_dir).resolve())
        return f"{m.group(1)}{Path(rel).as_posix()}{m.group(3)}"

    return _LINK.sub(fix, markdown)


def report(run_dir: str | Path, out_dir: str | Path | None = None) -> str:
    """``posenc report RUN_DIR``: what a run has, in ``report.md`` / ``report.json`` (+
    ``report_ppl_vs_length.png`` when it has perplexity-by-length data) under ``out_dir``
    (default ``RUN_DIR/report``); never a recipe's own files. The report holds every recipe
    table (``results.md``) under the run, the length table (``length_eval/ppl/<n>`` scalars or a
    compare_encodings ``results.json``) and every scalar series (points, steps, last, min, max)."""
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"posenc report: run_dir={str(root)!r} is not a directory")
    out = Path(out_dir) if out_dir else root / "report"
    skip = out if out.resolve() != root.resolve() else None
    recipes = [p for p in sorted(root.rglob("results.json")) if skip is None or skip not in p.parents]
    series = scalar_series(root, skip)
    ppl = length_curves(series)
    md = [f"# posenc report: {root}", ""]
    base_len = None
    for res in recipes:
        payload = json.loads(res.read_text())
        if not ppl and payload.get("ppl"):
            ppl, base_len = _ppl_from_results(payload), payload.get("base_len")
        table = res.with_name("results.md")
        if table.is_file():
            body = rebase_links(table.read_text(), table.parent, out).replace("\n# ", "\n### ")
            body = "### " + body[2:] if body.startswith("# ") else body
            md += [f"## Recipe results: {res.parent.relative_to(root) if res.parent != root else '.'}", "", body.strip(), ""]
    if ppl:
        png = out / "report_ppl_vs_length.png"
        out.mkdir(parents=True, exist_ok=True)
        from posenc_lightning.eval.plots import ppl_heatmap

        fig = ppl_heatmap(ppl, str(png), title=f"{root.name}: perplexity vs length", base_len=base_len)
        if fig is not None:
            import matplotlib.pyplot as plt

            plt.close(fig)
        fails = {k: {n: "failed" for n, v in r.items() if not math.isfinite(v)} for k, r in ppl.items()}
        md += ["## Perplexity by length", "", length_table(ppl, fails, base_len), "",
               f"![ppl vs length]({png.name})" if fig is not None else "", ""]
    if series:
        md += ["## Scalars (TensorBoard)", "", "| run | tag | points | steps | last | min | max |",
               "|---|---|---|---|---|---|---|"]
        for run, tags in series.items():
            for tag, pts in sorted(tags.items()):
                vals = [v for _, v in pts]
                md.append(f"| {run} | {tag} | {len(pts)} | {pts[0][0]}-{pts[-1][0]} | {vals[-1]:.4g} | "
                          f"{min(vals):.4g} | {max(vals):.4g} |")
        md.append("")
    if not recipes and not series:
        raise ValueError(f"posenc report: nothing to report under {root}: no TensorBoard event files and no "
                         f"results.json (give a run directory: a logger's version dir or a recipe's results_dir)")
    out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(md)
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps(
        {"run_dir": str(root), "recipes": [str(p.relative_to(root)) for p in recipes],
         "ppl": {k: {str(n): v for n, v in r.items()} for k, r in ppl.items()},
         "scalars": {r: {t: {"steps": [s for s, _ in p], "values": [v for _, v in p]} for t, p in tags.items()}
                     for r, tags in series.items()}}, indent=1))
    return text


def summary(meta: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in meta.items())
