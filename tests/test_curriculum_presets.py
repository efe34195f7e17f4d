"""LongRoPE search and CLEX presets of the context curriculum."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from posenc_lightning.curriculum import (
    N_HAT_CANDIDATES,
    CLEXCurriculum,
    EvolutionarySearch,
    LongRoPECurriculum,
    law_factors,
    windows_nll,
)
from posenc_lightning.curriculum.context import encodings_of
from posenc_lightning.functional.rope_scaling import yarn_find_correction_range
from tests.curriculum_helpers import Recorder, tiny_data, tiny_model, trainer


def test_law_factors_are_the_papers_laws():
    d, s, L = 16, 8.0, 128
    f = law_factors(d, 10000.0, s, L)
    assert f["pi"] == (8.0,) * 8
    # NTK-aware: base b * s^(d/(d-2)) -> lambda_i = s^(2i/(d-2)): 1 for the highest frequency, s for the lowest
    assert f["ntk"] == pytest.approx([s ** (2 * i / (d - 2)) for i in range(8)], abs=1e-4)
    # YaRN: extrapolated (1) below the ramp, interpolated (s) above it
    low, high = yarn_find_correction_range(32, 1, d, 10000.0, L)
    assert all(x == pytest.approx(1.0) for i, x in enumerate(f["yarn"]) if i < low)
    assert all(x == pytest.approx(s) for i, x in enumerate(f["yarn"]) if i >= high)
    assert all(f[k] == tuple(sorted(f[k])) for k in f)  # each law satisfies the monotonicity constraint


def test_evolutionary_search_respects_constraint_and_beats_its_seeds():
    target = np.array([1.0, 1.3, 2.0, 2.2, 5.0, 6.1, 7.7, 9.0])
    def score(c):
        return float(((np.asarray(c) - target) ** 2).sum())
    seeds = list(law_factors(16, 10000.0, 8.0, 128).values())
    runs = [EvolutionarySearch(8, 1.0, 10.0, population=16, parents=4, iterations=8, seed=3).run(score, seeds)
            for _ in range(2)]
    res = runs[0]
    assert res.best == runs[1].best  # deterministic given the seed (DDP ranks agree)
    assert res.best_score < min(score(s) for s in seeds) / 2
    for c in res.scores:
        assert all(a <= b for a, b in itertools.pairwise(c)), c  # lambda_i <= lambda_{i+1}
        assert all(1.0 <= x <= 10.0 and abs(x * 100 - round(x * 100)) < 1e-6 for x in c)  # range, 0.01 grid
    bests = [h["best"] for h in res.history]
    assert bests == sorted(bests, reverse=True) and len(bests) == 8  # elitist: never gets worse
    with pytest.raises(ValueError, match="parents"):
        EvolutionarySearch(8, 1.0, 10.0, population=4, parents=4)


def test_windows_nll_is_the_mean_token_cross_entropy():
    model = tiny_model()
    tokens = torch.randint(0, 256, (3 * 16 + 1,), dtype=torch.uint8)
    w = tokens[16:16 * 3 + 1].long()
    x, y = torch.stack([w[:16], w[16:32]]), torch.stack([w[1:17], w[17:33]])
    with torch.no_grad():
        want = model.token_nll(x, y).mean()
    assert windows_nll(model, tokens, 16, 2, offset=1, batch_size=1) == pytest.approx(float(want), rel=1e-5)
    with pytest.raises(ValueError, match="fewer windows"):
        windows_nll(model, tokens, 16, 3, offset=1)


class CountingLongRoPE(LongRoPECurriculum):
    searches = 0

    def search(self, *a, **kw):
        type(self).searches += 1
        return super().search(*a, **kw)


def _lr_cur():
    return CountingLongRoPE(original_length=16, target_length=64, steps_per_stage=3, start_length=32,
                            population=4, parents=2, iterations=2, search_windows=2, seed=0,
                            n_hat_candidates=list(N_HAT_CANDIDATES))


def test_longrope_curriculum_searches_each_long_stage_saves_and_resumes(tmp_path):
    cfg = {"original_max_position_embeddings": 16, "max_position_embeddings": 64}
    cur, rec = _lr_cur(), Recorder()
    ck = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    model = tiny_model("long_rope", encoding_cfg=cfg)
    trainer(6, [cur, rec, ck], enable_checkpointing=True).fit(model, tiny_data(max_val_windows=None))
    assert [s.seq_len for s in cur.stages] == [32, 64] and [s.scale for s in cur.stages] == [2.0, 4.0]
    assert sorted(cur.found) == [0, 1] and CountingLongRoPE.searches == 3  # two stages + short re-search
    for k in (0, 1):
        f = cur.found[k]
        assert len(f) == 8 and f == sorted(f) and all(1.0 <= x <= 1.25 * cur.stages[k].scale for x in f)
        h = cur.histories[f"long_{cur.stages[k].seq_len}"]
        assert h[-1]["best"] <= h[0]["best"]
    for k in (0, 1):  # n_hat: the candidate below the stage length with the least perplexity
        tried = {int(r["n_hat"]): r["ppl"] for r in cur.histories[f"n_hat_{cur.stages[k].seq_len}"]}
        assert sorted(tried) == [n for n in (0, 1, 2, 4, 8, 12, 16, 20, 24, 28, 32) if n < cur.stages[k].seq_len]
        assert cur.found_n_hat[k] == min(tried, key=lambda n: (tried[n], n))
    enc = encodings_of(model)[0]
    assert enc.long_factor == cur.found[1] and enc.short_factor == cur.short and enc.factor == 4.0
    assert enc.n_hat == cur.found_n_hat[1]
    assert [r["seq_len"] for r in rec.rows] == [32, 32, 32, 64, 64, 64]
    ckpt = torch.load(next(tmp_path.glob("*step=4*.ckpt")), weights_only=False)
    state = next(v for k, v in ckpt["callbacks"].items() if "LongRoPE" in k)
    assert state["found"][0] == cur.found[0] and state["found"][1] == cur.found[1]
    assert ckpt["posenc_lightning"]["config"]["long_factor"] == cur.found[1]  # reload rebuilds the factors
    assert state["found_n_hat"] == {0: cur.found_n_hat[0], 1: cur.found_n_hat[1]}
    assert ckpt["posenc_lightning"]["config"]["n_hat"] == cur.found_n_hat[1]
    # resume at step 4 (inside stage 1): the factors come from the checkpoint, no new long search
    CountingLongRoPE.searches = 0
    cur2 = _lr_cur()
    cur2.research_short = False
    trainer(6, [cur2], enable_checkpointing=False).fit(tiny_model("long_rope", encoding_cfg=cfg),
                                                      tiny_data(max_val_windows=None),
                                                      ckpt_path=str(next(tmp_path.glob("*step=4*.ckpt"))))
    assert CountingLongRoPE.searches == 0 and cur2.found == {0: cur.found[0], 1: cur.found[1]}
    assert cur2.found_n_hat == cur.found_n_hat


def test_longrope_curriculum_needs_long_rope():
    with pytest.raises(ValueError, match="long_rope"):
        trainer(1, [_lr_cur()]).fit(tiny_model("rope"), tiny_data(max_val_windows=None))
    with pytest.raises(ValueError, match="n_hat_candidates must be whole numbers"):
        LongRoPECurriculum(original_length=16, target_length=64, steps_per_stage=3, n_hat_candidates=[-1])


def test_clex_curriculum_samples_t_per_step_and_evaluates_at_length_ratio():
    cur = CLEXCurriculum(train_length=16, t_max=4.0, seed=5, keep_tokens_per_batch=True)
    ts = [cur.scale_at(s) for s in range(200)]
    assert ts == [CLEXCurriculum(16, 4.0, seed=5).scale_at(s) for s in range(200)]  # pure function of the step
    assert min(ts) >= 1.0 and max(ts) <= 4.0 and max(ts) - min(ts) > 2.5
    assert {CLEXCurriculum(16, 4.0, integer_scales=True).scale_at(s) for s in range(100)} == {1.0, 2.0, 3.0, 4.0}
    assert all(cur.stage_at(s).seq_len == min(64, 8 * math.ceil(16 * t / 8)) for s, t in enumerate(ts))
    assert cur.eval_scale(48, 0) == 3.0 and cur.eval_scale(8, 0) == 1.0

    class Seen(Recorder):
        def on_validation_start(self, trainer, pl_module):
            self.val_t = encodings_of(pl_module)[0].factor

    rec = Seen()
    model = tiny_model("clex", encoding_cfg={"max_scale": 4.0, "original_max_position_embeddings": 16})
    trainer(4, [cur, rec], limit_val_batches=1, val_check_interval=4).fit(
        model, tiny_data(batch_size=4, val_seq_len=40))
    for r in rec.rows:
        st = cur.stage_at(r["step"])
        assert (r["seq_len"], r["scale"]) == (st.seq_len, st.scale)
        assert r["batch"] == max(1, 4 * 16 // st.seq_len)
    assert rec.val_t == pytest.approx(40 / 16)  # evaluation: t = length / trained length
