"""Perplexity-vs-length pictures that stay readable for many encodings.

`ppl_heatmap` draws one row per encoding, grouped by family, one column per evaluation length:
the colour is ppl(n) / ppl(L) (white = flat, red = worse at length, blue = better) and each cell
shows the perplexity itself; a run that cannot evaluate a length shows ``fails``. Unlike one line
per encoding (27 lines, 10 colours) every row is labelled where it is drawn.
"""

from __future__ import annotations

import math
from typing import Any

#: the order of the families in the picture (unknown ones follow, then ``other``)
FAMILY_ORDER = ["none", "embed", "rotate", "bias", "normalize", "hybrid"]


def families_of(names: list[str]) -> dict[str, str]:
    """``{name: family}`` from the encoding registry; ``other`` for names it does not know."""
    from posenc_lightning.encodings.registry import describe

    known = {n: f for n, f, _ in describe()}
    return {n: known.get(n, "other") for n in names}


def grouped_rows(ppl: dict[str, dict[int, float]], families: dict[str, str]) -> list[tuple[str, str]]:
    """``[(family, name)]`` sorted by family (FAMILY_ORDER), then by flatness ppl(longest)/ppl(L)."""
    def flat(r: dict[int, float]) -> float:
        pts = sorted((n, v) for n, v in r.items() if math.isfinite(v))
        return pts[-1][1] / pts[0][1] if len(pts) > 1 else math.inf

    order = {f: i for i, f in enumerate(FAMILY_ORDER)}
    rows = [(families.get(n, "other"), n) for n in ppl]
    return sorted(rows, key=lambda fn: (order.get(fn[0], len(order)), fn[0], flat(ppl[fn[1]]), fn[1]))


def ppl_heatmap(ppl: dict[str, dict[int, float]], path: str | None = None, title: str = "perplexity vs length",
                base_len: int | None = None, families: dict[str, str] | None = None) -> Any:
    """The heatmap figure (matplotlib, the ``viz`` extra), saved to ``path`` if given; None
    without matplotlib or data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
        from matplotlib.colors import TwoSlopeNorm
    except ImportError:
        return None
    lengths = sorted({n for r in ppl.values() for n in r})
    if not lengths:
        return None
    base = base_len or lengths[0]
    rows = grouped_rows(ppl, families if families is not None else families_of(list(ppl)))
    val = np.array([[ppl[n].get(L, math.nan) for L in lengths] for _, n in rows], dtype=float)
    first = np.array([ppl[n].get(base, math.nan) for _, n in rows], dtype=float)
    ratio = val / first[:, None]
    finite = ratio[np.isfinite(ratio)]
    hi = max(1.05, float(finite.max()) if finite.size else 2.0)
    lo = min(0.95, float(finite.min()) if finite.size else 0.5)
    fig, ax = plt.subplots(figsize=(2.2 + 1.1 * len(lengths), 1.2 + 0.32 * len(rows)))
    cmap = plt.get_cmap("RdBu_r").copy()
    cmap.set_bad("#d9d9d9")
    img = ax.imshow(np.ma.masked_invalid(ratio), cmap=cmap, norm=TwoSlopeNorm(1.0, lo, hi), aspect="auto")
    for i in range(len(rows)):
        for j in range(len(lengths)):
            v, q = val[i, j], ratio[i, j]
            text = "fails" if not math.isfinite(v) else f"{v:.2f}"
            dark = math.isfinite(q) and (q > 1 + 0.6 * (hi - 1) or q < 1 - 0.6 * (1 - lo))
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(lengths)), [f"{L / base:g}x ({L})" for L in lengths], fontsize=8)
    ax.set_yticks(range(len(rows)), [n for _, n in rows], fontsize=8)
    ax.xaxis.tick_top()
    start = 0
    for k in range(1, len(rows) + 1):  # family bands: a rule between families, the name at the right
        if k == len(rows) or rows[k][0] != rows[start][0]:
            if k < len(rows):
                ax.axhline(k - 0.5, color="black", linewidth=1.2)
            ax.text(len(lengths) - 0.4, (start + k - 1) / 2, rows[start][0], rotation=90, ha="left", va="center",
                    fontsize=8, fontweight="bold")
            start = k
    fig.colorbar(img, ax=ax, fraction=0.04, pad=0.09, label="ppl(n) / ppl(L)")
    ax.set_title(f"{title}\ncells: perplexity; colour: ratio to the training length L={base}", fontsize=9)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig
