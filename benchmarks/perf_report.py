"""benchmarks/gpu_perf.py's results page (markdown) and record (JSON), and the per-path times
that ``benchmarks/gpu_proven.py --times`` turns into `proven_on_gpu.Proven` entries."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.perf_cases import SECTIONS, Case

#: (N, head_dim) of the forward+backward time a `Proven` entry records (`proven_on_gpu.REFERENCE_CASE`)
REFERENCE = (4096, 128)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _over(x: float | None, floor: float) -> str:
    return "-" if x is None else f"{x / floor:.2f}"


def _rates(info: dict) -> str:
    r = info["rates"]
    return (f"matrix {r['flops_per_s'] / 1e12:.0f} TFLOP/s, copy {r['bytes_per_s'] / 1e12:.2f} TB/s "
            f"({r['source']})")


def path_times(rows: list[dict], reference: tuple[int, int] = REFERENCE) -> dict[tuple[str, str], float]:
    """(backend that ran, encoding) -> forward+backward ms at ``reference`` (N, head_dim), from the
    encoding sections of a results JSON's rows (each path once: ``auto``'s rows name what ran)."""
    out: dict[tuple[str, str], float] = {}
    for r in rows:
        if r["section"] in ("auto", "triton", "flex") and (r["n"], r["d"]) == reference \
                and r.get("fwd_bwd_ms") is not None and r["status"].startswith("timed") \
                and not r["status"].startswith("timed once"):
            out.setdefault((r["ran"], r["label"]), r["fwd_bwd_ms"])
    return out


def render(cases: list[Case], info: dict, dry: bool = False) -> str:
    """The results page: the run's facts, then one table per section (times over their floors)."""
    rates = info["rates"]
    counts: dict[str, int] = {}
    for c in cases:
        word = c.status.split(":")[0]
        counts[word] = counts.get(word, 0) + 1
    picked = [c.note for c in cases if c.label == "sdpa-default" and c.section == "baseline" and c.note]
    lines = [f"# GPU speed{' plan (dry run)' if dry else ''}: {info['device']} ({info['date']})", "",
             f"- command: `{info['command']}` at commit {info['commit']}; {info['versions']}",
             f"- rates for the floors: {_rates(info)}",
             (f"- SDPA backends enabled: {info['sdpa_backends_enabled']}; sdpa-default ran: "
             f"{picked[0] if picked else '(not run)'}"),
             f"- budget {info['budget_s']:.0f} s (section shares {dict(SECTIONS)}); cases: {counts}",
             ("- floor: max(FLOPs / matrix rate, bytes / copy rate); FLOPs = 4 B H N^2 D / 2 forward (causal), "
             "3x that forward+backward; bytes = 4 (forward) or 12 (forward+backward) tensors of B H N D. "
             "x floor: measured / floor. Times: medians of do_bench (L2 flushed), ms."), ""]
    for section, _ in SECTIONS:
        rows = [c for c in cases if c.section == section]
        if not rows:
            continue
        lines += [f"## {section}", "",
                  ("| N | D | B | case | backend | variant | ran | fwd ms | floor | x floor | fwd+bwd ms | floor "
                  "| x floor | first call s | status |"), "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in rows:
            fl = c.floors(rates["flops_per_s"], rates["bytes_per_s"])
            lines.append(f"| {c.n} | {c.d} | {c.batch} | {c.label} | {c.backend} | {c.variant or '-'} | {c.ran or '-'} "
                         f"| {_ms(c.fwd_ms)} | {_ms(fl['fwd']['floor_ms'])} | {_over(c.fwd_ms, fl['fwd']['floor_ms'])} "
                         f"| {_ms(c.fwd_bwd_ms)} | {_ms(fl['fwd_bwd']['floor_ms'])} "
                         f"| {_over(c.fwd_bwd_ms, fl['fwd_bwd']['floor_ms'])} "
                         f"| {'-' if c.first_s is None else f'{c.first_s:.1f}'} | {c.status}{f' ({c.note})' if c.note else ''} |")
        lines.append("")
    return "\n".join(lines)


def write_results(base: Path, cases: list[Case], info: dict, rows: list[dict]) -> None:
    """``base``.md (`render`) and ``base``.json (the run's facts, every case with its floors, and the
    per-path times at `REFERENCE`), rewritten whole."""
    times = {f"{b}|{e}": ms for (b, e), ms in path_times(rows).items()}
    base.with_suffix(".json").write_text(json.dumps({"meta": info, "reference": list(REFERENCE),
                                                     "path_times_ms": times, "cases": rows}, indent=1))
    base.with_suffix(".md").write_text(render(cases, info) + "\n")
