"""DroPE recipe (recipes/drope_extend.py, posenc_lightning/recipes/drope.py): dropping RoPE keeps
every trained weight; every method starts from the same pre-trained weights (each law at factor 1
equals RoPE at L, whichever fine-tune ran before it); the results table is the perplexities it
reports; the paper's expectations are checked by their rules."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from posenc_lightning import inject
from posenc_lightning.inject import injected_spec
from posenc_lightning.models import TinyGPT
from posenc_lightning.recipes.drope import check_expectations, restore_weights, trained_weights
from tests.helpers import recipe_module

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--trainer.max_steps=4", "--trainer.val_check_interval=4", "--trainer.limit_val_batches=1",
        "--data.max_bytes=200000", "--data.batch_size=4", "--extend.eval_tokens=1024", "--trainer.logger=false",
        "--trainer.enable_progress_bar=false", "--extend.lengths=[1.0,2.0,16.0]", "--extend.recalibrate_fraction=0.5"]


@pytest.fixture
def drope_extend():
    return recipe_module("drope_extend")


def test_dropping_rope_keeps_every_weight():
    torch.manual_seed(0)
    m = TinyGPT(d_model=32, n_layers=2, n_heads=2, max_seq_len=32, encoding=None)
    inject(m, "rope", theta=500.0)
    before = trained_weights(m)
    x = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        rope_logits = m(x)
    inject(m, "nope")
    after = m.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert injected_spec(m)["encoding"] == "nope" and all(b.attn.posenc is None for b in m.blocks)
    with torch.no_grad():
        assert not torch.allclose(m(x), rope_logits)  # the positions are gone, nothing else
    restore_weights(m, before)  # a no-op here: the weights are the same tensors' values
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())


def test_restore_weights_refuses_another_models_weights():
    a = TinyGPT(d_model=32, n_layers=2, n_heads=2, max_seq_len=32, encoding="rope")
    b = TinyGPT(d_model=32, n_layers=1, n_heads=2, max_seq_len=32, encoding="rope")
    with pytest.raises(ValueError, match=r"restore_weights: the weights are not this model's .*unexpected \['blocks\.1"):
        restore_weights(b, trained_weights(a))


def test_recipe_runs_and_writes_its_table(drope_extend, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "res"
    r = drope_extend.main(["--config", str(ROOT / "configs" / "drope_extend.yaml"), *TINY,
                           f"--extend.results_dir={out}"])
    saved = json.loads((out / "results.json").read_text())
    assert saved["recipe"] == "drope_extend" and saved["results"] == json.loads(json.dumps(r))
    assert (r["L"], r["pretrain_steps"]) == (64, 4)
    assert r["finetune_steps"] == {"pi": 2, "yarn": 2, "ntk": 2, "drope": 2}  # the same steps, 50% of 4
    rows = ["rope", "pi zero-shot", "pi fine-tuned", "yarn zero-shot", "yarn fine-tuned", "ntk zero-shot",
            "ntk fine-tuned", "drope zero-shot", "drope"]
    for row in rows:
        for n in (64, 128, 1024):
            assert math.isfinite(r[f"ppl/{row}/{n}"]) and 1.0 < r[f"ppl/{row}/{n}"] < 256.0
    # at L every law's zero-shot factor is 1, which is RoPE itself: yarn and ntk come after pi's and
    # yarn's fine-tunes, so this holds only if each method starts again from the pre-trained weights
    for law in ("pi", "yarn", "ntk"):
        assert r[f"ppl/{law} zero-shot/64"] == pytest.approx(r["ppl/rope/64"], rel=1e-5)
    assert r["ppl/drope zero-shot/64"] != pytest.approx(r["ppl/rope/64"], rel=1e-7)  # the positions dropped
    assert r["ppl/drope/64"] != pytest.approx(r["ppl/drope zero-shot/64"], rel=1e-5)  # recalibrated
    md = (out / "results.md").read_text()
    assert "| model | 64 (1 L) | 128 (2 L) | 1024 (16 L) |" in md
    assert f"| drope | {r['ppl/drope/64']:.4f} | {r['ppl/drope/128']:.4f} | {r['ppl/drope/1024']:.4f} |" in md
    assert [c["verdict"] for c in r["expectations"]] == ["no verdict"] * 3  # 4 steps learn nothing
    assert "does not beat a byte bigram" in r["expectations"][0]["measured"] and "Gelberg et al. 2025" in md


def test_recipe_refuses_bad_options(drope_extend, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = ["--config", str(ROOT / "configs" / "drope_extend.yaml"), *TINY]
    with pytest.raises(ValueError, match=r"--extend.recalibrate_fraction must be in \(0, 1\], got 0.0"):
        drope_extend.main([*cfg, "--extend.recalibrate_fraction=0.0"])


def _table(rope, drop, drope, **laws):
    L = 64
    t = {"rope": dict(zip((L, 128, 256), rope)), "drope zero-shot": dict(zip((L, 128, 256), drop)),
         "drope": dict(zip((L, 128, 256), drope))}
    t.update({k.replace("_", " ", 1).replace("_", "-"): dict(zip((L, 128, 256), v)) for k, v in laws.items()})
    return t


def test_expectations_by_their_rules():
    t = _table(rope=(5.0, 9.0, 20.0), drop=(7.0, 8.0, 9.0), drope=(5.2, 6.0, 6.0),
               pi_zero_shot=(5.0, 7.0, 8.0), pi_fine_tuned=(5.1, 6.0, 7.0))
    checks = {c["id"]: c for c in check_expectations(t, 64, bigram_ppl=10.0)}
    assert {k: c["verdict"] for k, c in checks.items()} == {
        "drop_hurts": "held", "recal_recovers": "held", "beats_scaling": "held"}
    # geometric means beyond L: drope sqrt(6 * 6) = 6 vs pi fine-tuned sqrt(6 * 7)
    assert f"drope 6.000; pi zero-shot {math.sqrt(56):.3f}, pi fine-tuned {math.sqrt(42):.3f}" in checks[
        "beats_scaling"]["measured"]
    assert "+4.0%" in checks["recal_recovers"]["measured"]
    t = _table(rope=(5.0, 9.0, 20.0), drop=(4.9, 8.0, 9.0), drope=(5.3, 6.0, 6.0), yarn_fine_tuned=(5.0, 5.0, 8.0))
    checks = {c["id"]: c["verdict"] for c in check_expectations(t, 64, bigram_ppl=10.0)}
    # 5.3 is 6% over 5.0; drope sqrt(36) = 6 beats yarn sqrt(40) = 6.32
    assert checks == {"drop_hurts": "not held", "recal_recovers": "not held", "beats_scaling": "held"}
    t["yarn fine-tuned"] = {64: 5.0, 128: 5.0, 256: 7.0}  # sqrt(35) = 5.92 < 6
    assert check_expectations(t, 64, bigram_ppl=10.0)[2]["verdict"] == "not held"
    assert {c["verdict"] for c in check_expectations(t, 64, bigram_ppl=4.0)} == {"no verdict"}
    assert {c["verdict"] for c in check_expectations(t, 64, 10.0, pretrain_complete=False)} == {"no verdict"}
