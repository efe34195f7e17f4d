"""The length-generalization report: a markdown table and a perplexity-vs-length plot, shared by
`LengthEvalCallback` (logged during training) and ``posenc report`` (`posenc_lightning.eval.compare`)."""

from __future__ import annotations

import math


def length_table(results: dict[str, dict[int, float]], failures: dict[str, dict[int, str]] | None = None,
                 base_len: int | None = None) -> str:
    """Markdown: one row per run, one column per length (``fails`` where the model could not run)."""
    lengths = sorted({n for r in results.values() for n in r})
    head = [f"{n // base_len}x ({n})" if base_len else str(n) for n in lengths]
    out = ["| encoding | " + " | ".join(head) + " |", "|---" * (len(lengths) + 1) + "|"]
    for name, r in results.items():
        cells = []
        for n in lengths:
            v = r.get(n, float("nan"))
            if failures and n in failures.get(name, {}):
                cells.append("fails (beyond table)" if "table" in failures[name][n] else "fails")
            else:
                cells.append("" if math.isnan(v) else f"{v:.2f}")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def length_plot(results: dict[str, dict[int, float]], path: str | None = None, title: str = "perplexity vs length"):
    """A log-log perplexity-vs-length figure (matplotlib, the ``viz`` extra); saved to ``path`` if
    given. Returns the figure, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    for i, (name, r) in enumerate(results.items()):
        pts = sorted((n, v) for n, v in r.items() if math.isfinite(v))
        if pts:  # 10 colors x 3 line styles x 2 markers: every curve distinct
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os"[i // 30 % 2], label=name,
                    linestyle=["-", "--", ":"][i // 10 % 3])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig
