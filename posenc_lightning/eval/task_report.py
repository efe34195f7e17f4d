"""The synthetic-task comparison's results: per-task accuracy tables, heatmaps (encodings grouped
by family) and the papers' expectations checked against the measured numbers.

Used by ``recipes/compare_tasks.py``; ``posenc report`` shows its ``results.md``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: exact match at the training length the baseline (an ordering's loser) must reach for a verdict:
#: below it the task was not learned in distribution and "beyond L" compares nothing
LEARNED = 0.9


@dataclass(frozen=True)
class Expectation:
    """A published ordering: ``winner`` beats ``loser`` on ``task`` beyond the training length
    (mean exact match over the lengths > L); with ``threshold``, every encoding in the grid
    reaches at least ``threshold`` exact match at the training length; with ``glitches``, no
    encoding is exact on every test sequence at every length > L."""

    task: str
    claim: str
    source: str
    winner: str | None = None
    loser: str | None = None
    threshold: float | None = None
    glitches: bool = False
    #: with ``threshold``: the paper's baseline, which must itself reach `LEARNED` at L for a verdict
    #: (below it the setting is too small to test the claim)
    baseline: str | None = None


EXPECTATIONS = (
    Expectation("copy", "NoPE beats RoPE beyond the training length",
                "Kazemnejad et al. 2023, The Impact of Positional Encoding on Length Generalization", "nope", "rope"),
    Expectation("reverse", "NoPE beats RoPE beyond the training length", "Kazemnejad et al. 2023", "nope", "rope"),
    Expectation("addition", "NoPE beats RoPE beyond the training length", "Kazemnejad et al. 2023", "nope", "rope"),
    Expectation("flip_flop", "CoPE beats RoPE beyond the training length", "Golovneva et al. 2024 (CoPE), Table 1",
                "cope", "rope"),
    Expectation("flip_flop", "no encoding is free of sporadic errors beyond the training length (attention glitches)",
                "Liu et al. 2023, Exposing Attention Glitches with Flip-Flop Language Modeling", glitches=True),
    Expectation("selective_copy", "CoPE beats RoPE beyond the training length", "Golovneva et al. 2024 (CoPE)",
                "cope", "rope"),
    Expectation("counting", "CoPE beats RoPE beyond the training length", "Golovneva et al. 2024 (CoPE)",
                "cope", "rope"),
    Expectation("mqar", "attention solves MQAR at the training length (every encoding >= 90% exact match)",
                "Arora et al. 2023, Zoology", threshold=0.9, baseline="rope"),
    Expectation("passkey", "YaRN (zero-shot, factor n/L) beats RoPE beyond the training length",
                "Peng et al. 2023, YaRN", "yarn", "rope"),
    # the layer schedules and PaTH (configs/compare_tasks_layer_schedules.yaml)
    Expectation("passkey", "RNoPE-SWA (windowed RoPE layers, global NoPE layers) beats RoPE beyond the training length",
                "Yang et al. 2025, Rope to Nope and Back Again (needle retrieval beyond the training length)",
                "rnope_swa", "rope"),
    Expectation("passkey", "iRoPE (chunked RoPE layers, global NoPE layers with temperature) beats RoPE beyond "
                "the training length", "Meta 2025, Llama 4 (iRoPE, for length generalization)", "irope", "rope"),
    Expectation("flip_flop", "PaTH beats RoPE beyond the training length",
                "Yang et al. 2025, PaTH Attention, sec. 4.1 (flip-flop: RoPE errs where PaTH does not)", "path", "rope"),
    # DroPE: compare_tasks' two-phase entry drope (RoPE for the task's steps, then NoPE recalibrated)
    Expectation("passkey", "DroPE (RoPE dropped after training, NoPE recalibrated at L) beats RoPE beyond the "
                "training length", "Gelberg et al. 2025, DroPE (zero-shot context extension; needle-in-a-haystack "
                "retrieval beyond the training context)", "drope", "rope"),
    Expectation("passkey", "DroPE beats YaRN (zero-shot, factor n/L) beyond the training length",
                "Gelberg et al. 2025, DroPE (needle-in-a-haystack beyond the training context: DroPE far above PI, "
                "NTK and YaRN)", "drope", "yarn"),
)


def beyond(acc: dict[int, float], base_len: int) -> float:
    """Mean exact match over the finite lengths > ``base_len`` (NaN if none)."""
    vals = [v for n, v in acc.items() if n > base_len and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def verdict(e: Expectation, acc: dict[str, dict[int, float]], base_len: int) -> tuple[str, str]:
    """``(held | not held | no verdict, the numbers)`` of one expectation on one task's table
    ``{encoding: {length: exact match}}``."""
    if e.glitches:
        perfect = sorted(k for k, r in acc.items()
                         if [v for n, v in r.items() if n > base_len] and all(v == 1.0 for n, v in r.items() if n > base_len))
        if not acc:
            return "no verdict", "no encoding ran"
        return (("not held", f"exact on every test sequence at every length > L: {', '.join(perfect)}") if perfect
                else ("held", "every encoding errs on some sequence beyond L"))
    if e.threshold is not None:
        at_l = {k: r.get(base_len, math.nan) for k, r in acc.items()}
        if not at_l:
            return "no verdict", "no encoding ran"
        below = sorted(k for k, v in at_l.items() if not v >= e.threshold)
        detail = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(at_l.items(), key=lambda kv: -kv[1]))
        if e.baseline in at_l and not at_l[e.baseline] >= LEARNED:
            return "no verdict", (f"at L: {detail}; the baseline {e.baseline} is below {100 * LEARNED:.0f}% at L: "
                                  "not learned at this scale")
        return ("held" if not below else "not held"), f"at L: {detail}" + (f"; below: {', '.join(below)}" if below else "")
    if e.winner not in acc or e.loser not in acc:
        return "no verdict", f"needs {e.winner} and {e.loser} in the grid"
    w, lo = acc[e.winner], acc[e.loser]
    bw, bl = beyond(w, base_len), beyond(lo, base_len)
    detail = (f"{e.winner} {100 * bw:.0f}% vs {e.loser} {100 * bl:.0f}% beyond L "
              f"(at L: {100 * w.get(base_len, math.nan):.0f}% vs {100 * lo.get(base_len, math.nan):.0f}%)")
    if not lo.get(base_len, 0.0) >= LEARNED:
        return "no verdict", detail + (f"; the baseline {e.loser} is below {100 * LEARNED:.0f}% at L: "
                                       "not learned at this scale")
    return ("held" if bw > bl else "not held"), detail


def seed_verdict(e: Expectation, by_seed: dict[str, dict[int, dict[int, float]]], base_len: int) -> tuple[str, str]:
    """`verdict` at every seed (``by_seed``: ``{encoding: {seed: {length: exact match}}}``): the
    common verdict when every seed gives the same one, else ``no verdict`` naming each seed's."""
    seeds = sorted({s for r in by_seed.values() for s in r})
    if not seeds:
        return "no verdict", "no encoding ran"
    each = {s: verdict(e, {k: r[s] for k, r in by_seed.items() if s in r}, base_len) for s in seeds}
    kinds = {v for v, _ in each.values()}
    text = "; ".join(f"seed {s}: {why}" for s, (_, why) in each.items())
    if len(seeds) == 1:
        return each[seeds[0]]
    if len(kinds) == 1:
        return kinds.pop(), text
    return "no verdict", "the seeds disagree (" + ", ".join(f"seed {s} {v}" for s, (v, _) in each.items()) + "): " + text


def _pct(v: float) -> str:
    return "fails" if not math.isfinite(v) else f"{100 * v:.0f}"


def task_table(acc: dict[str, dict[int, float]], base_len: int, families: dict[str, str],
               tokens: dict[str, dict[int, float]] | None = None,
               by_seed: dict[str, dict[int, dict[int, float]]] | None = None) -> str:
    """Markdown: one row per encoding (grouped by family, best first), exact match % per length,
    and (given ``tokens``, answer-token accuracy per length) answer-token accuracy at L and beyond.
    Given ``by_seed`` (``{encoding: {seed: {length: exact match}}}``) with several seeds, a cell
    is the seeds' mean with their range, ``mean (min-max)``, where they differ."""
    from posenc_lightning.eval.plots import FAMILY_ORDER

    lengths = sorted({n for r in acc.values() for n in r})
    order = {f: i for i, f in enumerate(FAMILY_ORDER)}
    rows = sorted(acc, key=lambda k: (order.get(families.get(k, "other"), len(order)), -_score(acc[k], base_len), k))
    head = "| encoding | family | " + " | ".join(f"{n // base_len}x ({n})" for n in lengths) + " | beyond L |"
    head += " tokens at L | tokens beyond L |" if tokens else ""
    lines = [head, "|" + "---|" * (len(lengths) + 3 + (2 if tokens else 0))]
    for k in rows:
        runs = list((by_seed or {}).get(k, {}).values())
        cells = " | ".join(_spread(acc[k].get(n, math.nan), [r.get(n, math.nan) for r in runs]) for n in lengths)
        line = f"| {k} | {families.get(k, 'other')} | {cells} | {_pct(beyond(acc[k], base_len))} |"
        if tokens:
            t = tokens.get(k, {})
            line += f" {_pct(t.get(base_len, math.nan))} | {_pct(beyond(t, base_len))} |"
        lines.append(line)
    return "\n".join(lines)


def _spread(mean: float, runs: list[float]) -> str:
    """``mean`` in percent, with the runs' range when there are several and they differ."""
    if len(runs) < 2 or not all(math.isfinite(v) for v in runs) or _pct(min(runs)) == _pct(max(runs)):
        return _pct(mean)
    return f"{_pct(mean)} ({_pct(min(runs))}-{_pct(max(runs))})"


def _score(r: dict[int, float], base_len: int) -> float:
    b = beyond(r, base_len)
    return b if math.isfinite(b) else -1.0


def accuracy_heatmap(acc: dict[str, dict[int, float]], path: str | None, title: str, base_len: int,
                     families: dict[str, str]) -> Any:
    """Exact match per (encoding, length): rows grouped by family (a rule between families, the
    family named at the right), colour 0..100%, each cell labelled; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return None
    from posenc_lightning.eval.plots import FAMILY_ORDER

    lengths = sorted({n for r in acc.values() for n in r})
    if not lengths:
        return None
    order = {f: i for i, f in enumerate(FAMILY_ORDER)}
    rows = sorted(acc, key=lambda k: (order.get(families.get(k, "other"), len(order)), -_score(acc[k], base_len), k))
    val = np.array([[acc[k].get(n, math.nan) for n in lengths] for k in rows], dtype=float)
    fig, ax = plt.subplots(figsize=(2.4 + 0.9 * len(lengths), 1.2 + 0.32 * len(rows)))
    cmap = plt.get_cmap("viridis").with_extremes(bad="#d9d9d9")
    # drawn in percent, the cells' unit, so the colour bar reads 0-100 like the labels
    img = ax.imshow(np.ma.masked_invalid(100.0 * val), cmap=cmap, vmin=0.0, vmax=100.0, aspect="auto")
    for i in range(len(rows)):
        for j in range(len(lengths)):
            v = val[i, j]
            ax.text(j, i, _pct(v), ha="center", va="center", fontsize=8,
                    color="black" if math.isfinite(v) and v > 0.6 else "white")
    ax.set_xticks(range(len(lengths)), [f"{n // base_len}x ({n})" for n in lengths], fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.xaxis.tick_top()
    start = 0
    for k in range(1, len(rows) + 1):
        if k == len(rows) or families.get(rows[k], "other") != families.get(rows[start], "other"):
            if k < len(rows):
                ax.axhline(k - 0.5, color="white", linewidth=1.5)
            ax.text(len(lengths) - 0.4, (start + k - 1) / 2, families.get(rows[start], "other"), rotation=90,
                    ha="left", va="center", fontsize=8, fontweight="bold")
            start = k
    fig.colorbar(img, ax=ax, fraction=0.04, pad=0.1, label="exact match (%)")
    ax.set_title(f"{title}\nexact match (%) by input length; trained at L={base_len}", fontsize=9)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def render_tasks(results: dict[str, Any], out_dir: str | Path, heatmaps: bool = True) -> str:
    """Write ``results.json``, ``results.md`` and ``heatmap_<task>.png`` into ``out_dir`` from
    ``results`` (``tasks: {task: {exact_match: {encoding: {length: acc}}, ...}}``, ``train_len``,
    ...); return the markdown. The expectations' verdicts are added to ``results["expectations"]``."""
    from posenc_lightning.eval.plots import families_of

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    L = int(results["train_len"])
    tasks = results["tasks"]
    for r in tasks.values():  # lengths as ints, NaN for null: results read back from results.json render too
        for key in ("exact_match", "token_accuracy"):
            r[key] = {k: {int(n): _num(v) for n, v in a.items()} for k, a in (r.get(key) or {}).items()}
        r["by_seed"] = {k: {int(s): {int(n): _num(v) for n, v in a.items()} for s, a in per.items()}
                        for k, per in (r.get("by_seed") or {}).items()}
    fam = families_of(sorted({k for t in tasks.values() for k in t["exact_match"]}))
    checks = []
    for e in EXPECTATIONS:
        grid = tasks[e.task]["exact_match"] if e.task in tasks else {}
        if not grid or (e.winner is not None and not {e.winner, e.loser} <= set(grid)):
            continue  # an ordering between encodings this grid did not train says nothing here
        r = tasks[e.task]
        t_len = int(r.get("train_len") or L)
        v, why = (seed_verdict(e, r["by_seed"], t_len) if r.get("by_seed") else verdict(e, r["exact_match"], t_len))
        checks.append({"task": e.task, "claim": e.claim, "source": e.source, "verdict": v, "measured": why})
    results["expectations"] = checks
    md = [f"# {results.get('title', 'compare_tasks')}", "",
          f"Exact-match accuracy (%) of TinyGPT trained per encoding per task on input lengths up to L={L} "
          f"(or the task's own L, where its section gives one), tested on lengths L x "
          f"{'/'.join(str(m) for m in results.get('multiples', []))}; a sequence counts when every answer token is "
          f"the model's argmax. \"tokens\": the share of answer tokens right (at L, and the mean beyond L). "
          f"{results.get('notes', '')}".rstrip(), ""]
    if len(results.get("seeds") or []) > 1:
        md += [(f"Seeds {', '.join(map(str, results['seeds']))}: a cell is their mean, with their range where they "
               f"differ; an ordering gets a verdict only where every seed gives the same one and its baseline "
               f"reaches {100 * LEARNED:.0f}% at L."), ""]
    if results.get("command"):
        md += [f"Command: `{results['command']}`", ""]
    if checks:
        md += ["## The papers' expectations", "", "| task | expectation | source | verdict | measured |",
               "|---|---|---|---|---|"]
        md += [f"| {c['task']} | {c['claim']} | {c['source']} | **{c['verdict']}** | {c['measured']} |" for c in checks]
        md.append("")
    for t, r in tasks.items():
        acc = r["exact_match"]
        t_len = int(r.get("train_len") or L)  # a task_settings entry may give the task its own L
        about = (f"Task arguments: `{json.dumps(r.get('config', {}))}`; training lengths "
                 f"{r.get('min_train_len', '?')}..{t_len}{'' if t_len == L else f' (its own L={t_len})'}; "
                 f"{_steps(r)}.")
        if r.get("source"):
            about += f" Setting: {r['source']}."
        md += [f"## {t}", "", about, "", task_table(acc, t_len, fam, r["token_accuracy"], r["by_seed"]), ""]
        if r.get("failures"):
            md += ["Failures: " + "; ".join(f"{k}: {v}" for k, v in r["failures"].items()), ""]
        if heatmaps:
            fig = accuracy_heatmap(acc, str(out / f"heatmap_{t}.png"), f"compare_tasks: {t}", t_len, fam)
            if fig is not None:
                import matplotlib.pyplot as plt

                plt.close(fig)
                md += [f"![{t}](heatmap_{t}.png)", ""]
    text = "\n".join(md)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(jsonable(results), indent=1))
    return text


def _steps(r: dict[str, Any]) -> str:
    """``500 steps`` (or each encoding's count when they differ) and the slowest cell's seconds."""
    steps = sorted(set((r.get("steps") or {}).values()))
    secs = [v for v in (r.get("seconds") or {}).values() if v is not None]
    text = f"{'/'.join(map(str, steps)) or '?'} steps"
    return text + (f", {min(secs):.0f}-{max(secs):.0f} s per encoding" if secs else "")


def _num(v: Any) -> float:
    return math.nan if v is None else float(v)


def jsonable(v: Any) -> Any:
    """``v`` with non-finite floats as None and keys as strings (strict JSON)."""
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
