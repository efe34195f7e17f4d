"""``posenc report runs/compare_tasks`` (issue 46): the task heatmaps linked from ``report/report.md``
resolve from the report's own folder, and each heatmap's colour bar reads in the cells' unit
(percent, 0-100), not 0-1."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from posenc_lightning.cli import main
from posenc_lightning.eval.compare import rebase_links
from posenc_lightning.eval.task_report import accuracy_heatmap, render_tasks

pytest.importorskip("matplotlib")


def _results() -> dict:
    acc = {"nope": {16: 1.0, 32: 0.25}, "rope": {16: 0.75, 32: 0.0}}
    return {"train_len": 16, "multiples": [1, 2], "tasks": {
        "copy": {"exact_match": acc, "token_accuracy": acc, "steps": {"nope": 3, "rope": 3}}}}


def test_report_links_resolve_from_the_report_file(tmp_path):
    run = tmp_path / "runs" / "compare_tasks"
    render_tasks(_results(), run)
    assert main(["report", str(run)]) == 0
    report = run / "report" / "report.md"
    targets = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report.read_text())
    assert targets == ["../heatmap_copy.png"]
    for t in targets:  # as a Markdown viewer resolves them: from the report's folder
        assert (report.parent / t).resolve() == (run / "heatmap_copy.png").resolve() and (report.parent / t).is_file()


def test_rebase_keeps_urls_anchors_and_absolute_paths():
    md = "![a](a.png) [b](sub/b.md) [c](https://x.org/c) [d](#d) ![e](/abs/e.png)"
    assert rebase_links(md, Path("/r/run"), Path("/r/run/report")) == (
        "![a](../a.png) [b](../sub/b.md) [c](https://x.org/c) [d](#d) ![e](/abs/e.png)")


def test_task_heatmap_colour_bar_is_in_percent_like_its_cells():
    acc = _results()["tasks"]["copy"]["exact_match"]
    fig = accuracy_heatmap(acc, None, "copy", 16, {"nope": "none", "rope": "rotate"})
    ax, cbar_ax = fig.axes
    img = ax.images[0]
    assert img.get_clim() == (0.0, 100.0)
    assert cbar_ax.get_ylim() == (0.0, 100.0) and cbar_ax.get_ylabel() == "exact match (%)"
    cells = sorted(t.get_text() for t in ax.texts if t.get_text().isdigit())
    assert cells == sorted(["100", "25", "75", "0"])  # the labels are percent: the bar spans them
    assert img.get_array().max() == 100.0
    import matplotlib.pyplot as plt

    plt.close(fig)
