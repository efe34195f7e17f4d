"""DDP with 2 gloo CPU processes under a ContextCurriculum: every rank sees the same stage at
the same step, and the loss equals a single-process run with the same global batch.

Tolerance: the mean of the two ranks' losses equals the 1-process loss to rtol 1e-5 / atol 1e-5
at every step (float32 gradients are all-reduced in a different summation order, so the
parameters, and from step 1 on the losses, differ only by float32 rounding)."""

from __future__ import annotations

import json

import torch

from posenc_lightning.curriculum.context import ContextCurriculum, Stage
from tests.curriculum_helpers import Recorder, losses, tiny_data, tiny_model, trainer

PI = {"factor": 1.0, "original_max_position_embeddings": 16}


def _curriculum() -> ContextCurriculum:
    return ContextCurriculum([Stage(0, 16), Stage(3, 32, scale=2.0), Stage(5, 48, scale=3.0)],
                             keep_tokens_per_batch=True, seed=7)


def test_ddp_two_cpu_processes_match_one_process(tmp_path):
    steps = 7
    # 2 processes x 4 windows ...
    ddp_dir = tmp_path / "ddp"
    ddp_dir.mkdir()
    trainer(steps, [_curriculum(), Recorder(str(ddp_dir))], devices=2, strategy="ddp_spawn",
            ).fit(tiny_model("pi", encoding_cfg=PI), tiny_data(batch_size=4))
    ranks = [json.loads((ddp_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    # ... against 1 process x 8 windows (the same global batch: the sampler splits it by rank)
    one = Recorder()
    trainer(steps, [_curriculum(), one]).fit(tiny_model("pi", encoding_cfg=PI),
                                             tiny_data(batch_size=8))

    for r in ranks:
        assert r[0]["world"] == 2 and [row["step"] for row in r] == list(range(steps))
    def stage(rows):
        return [(x["step"], x["seq_len"], x["batch"], x["scale"]) for x in rows]
    assert stage(ranks[0]) == stage(ranks[1])  # same stage at the same step on every rank
    assert [x["seq_len"] for x in ranks[0]] == [16, 16, 16, 32, 32, 48, 48]
    assert [x["scale"] for x in ranks[0]] == [1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert [x["batch"] for x in ranks[0]] == [4, 4, 4, 2, 2, 1, 1]  # per rank; tokens per batch constant
    assert [x["batch"] for x in one.rows] == [8, 8, 8, 4, 4, 2, 2]  # the same global batch
    assert losses(ranks[0]).ne(losses(ranks[1])).any()  # the ranks did see different windows
    ddp_loss = (losses(ranks[0]) + losses(ranks[1])) / 2
    print(f"max |mean DDP loss - 1-process loss| = {(ddp_loss - losses(one.rows)).abs().max():.3g}")
    torch.testing.assert_close(ddp_loss, losses(one.rows), rtol=1e-5, atol=1e-5)
