"""Synthetic tasks: every generator builds exactly the requested length, its answers are what an
independent reading of the question gives, seeds reproduce, the loss sees only answer tokens, and
the exact-match metric counts what it says."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from posenc_lightning.data.tasks import (
    BOS,
    IGNORE,
    PAD,
    SEP,
    TASKS,
    ExactMatchByLength,
    TaskDataModule,
    build_task,
    exact_match,
)

LENGTHS = (0, 1, 7, 32, 100, 257)  # added to each task's min_len: the smallest, odd, even, long


def _examples(name: str, **cfg):
    task = build_task(name, **cfg)
    for extra in LENGTHS:
        n = task.min_len + extra
        for seed in range(5):
            yield task, n, task.sample(np.random.default_rng([seed, n]), n)


def _names(task, toks):
    return task.decode(toks)


def _strip(task, e):
    """The example's tokens from BOS on (leading PADs dropped), as names, and the answer flags."""
    start = int(np.argmax(e.tokens == BOS))
    assert (e.tokens[:start] == PAD).all() and not e.answer[:start].any()
    return _names(task, e.tokens[start:]), list(e.answer[start:])


@pytest.mark.parametrize("name", sorted(TASKS))
def test_exact_length_reproducible_and_answers_not_first(name):
    task = build_task(name)
    for _, n, e in _examples(name):
        assert e.tokens.shape == e.answer.shape == (n + 1,) and e.length == n
        assert e.tokens.dtype == np.int64 and 0 <= e.tokens.min() and e.tokens.max() < task.vocab_size
        assert e.answer.any() and not e.answer[0]
        x, y = e.input_target()
        assert x.shape == y.shape == (n,)
    n = task.min_len + 40
    a, b = (task.sample(np.random.default_rng(7), n) for _ in range(2))
    assert (a.tokens == b.tokens).all() and (a.answer == b.answer).all()  # a seed reproduces its example
    others = [task.sample(np.random.default_rng(s), n).tokens for s in range(8, 12)]
    assert any((o != a.tokens).any() for o in others)  # and other seeds give other examples
    with pytest.raises(ValueError, match=f"{name}: length n={task.min_len - 1} is shorter than .*min_len"):
        task.sample(np.random.default_rng(0), task.min_len - 1)


@pytest.mark.parametrize("name", ["copy", "reverse"])
def test_copy_and_reverse_answers(name):
    for task, n, e in _examples(name):
        toks, ans = _strip(task, e)
        sep = toks.index("<sep>")
        src, out = toks[1:sep], toks[sep + 1:]
        assert out == (src if name == "copy" else src[::-1]) and len(src) == (n - 1) // 2
        assert ans == [False] * (sep + 1) + [True] * len(out)


def test_addition_answers():
    for task, n, e in _examples("addition"):
        toks, ans = _strip(task, e)
        plus, eq = toks.index("+"), toks.index("=")
        a, b, c = toks[1:plus], toks[plus + 1:eq], toks[eq + 1:]
        value = lambda ds: sum(int(d) * 10 ** i for i, d in enumerate(ds))  # digits least significant first
        assert len(a) == len(b) == (n - 3) // 3 and len(c) == len(a) + 1
        assert value(c) == value(a) + value(b)
        assert ans == [False] * (eq + 1) + [True] * len(c)


def test_flip_flop_reads_return_the_last_write():
    task = build_task("flip_flop", p_ignore=0.5)
    for _, n, e in _examples("flip_flop", p_ignore=0.5):
        toks, ans = _strip(task, e)
        ops = list(zip(toks[1::2], toks[2::2]))
        assert len(ops) == n // 2 and ops[0][0] == "w" and ops[-1][0] == "r"
        memory, expected = None, [False]
        for op, bit in ops:
            if op == "r":
                assert bit == memory
            elif op == "w":
                memory = bit
            expected += [False, op == "r"]
        assert ans == expected


def test_selective_copy_answers_are_the_data_tokens_in_order():
    for task, n, e in _examples("selective_copy", n_items=3):
        toks, ans = _strip(task, e)
        sep = toks.index("<sep>")
        data = [t for t in toks[1:sep] if t != "."]
        assert data == toks[sep + 1:] and len(data) == 3 and sep == n - 3
        assert ans == [False] * (sep + 1) + [True] * 3


def test_counting_answer_is_the_interpreted_value():
    for task, n, e in _examples("counting", max_inc=4):
        toks, ans = _strip(task, e)
        assert toks[-2] == "?" and ans == [False] * (len(toks) - 1) + [True]
        value, i, incs = None, 1, 0
        while toks[i] != "?":
            if toks[i] == "set":
                value, incs, i = int(toks[i + 1]), 0, i + 2
                continue
            if toks[i] == "inc":
                value, incs = (value + 1 if value is not None else None), incs + 1
            i += 1
        assert int(toks[-1]) == value and incs <= 4


def test_mqar_queries_return_their_values():
    for task, n, e in _examples("mqar", n_pairs=5, n_keys=8, n_values=4):
        toks, ans = _strip(task, e)
        pairs = dict(zip(toks[1:11:2], toks[2:11:2]))
        assert len(pairs) == 5 and all(k.startswith("k") for k in pairs)  # distinct keys
        body, flags = toks[11:], ans[11:]
        queries = [(body[i], body[i + 1]) for i in range(len(body) - 1) if body[i].startswith("k")]
        assert sorted(q for q, _ in queries) == sorted(pairs)  # every key queried once
        assert all(pairs[k] == v for k, v in queries)
        assert [t for t, f in zip(body, flags) if f] == [v for _, v in queries]
        assert set(body) - set(pairs) - set(pairs.values()) <= {"."}


def test_mqar_queries_with_replacement_return_their_values():
    repeats = 0
    for task, n, e in _examples("mqar", n_pairs=5, n_keys=8, n_values=4, distinct_queries=False):
        toks, ans = _strip(task, e)
        pairs = dict(zip(toks[1:11:2], toks[2:11:2]))
        body, flags = toks[11:], ans[11:]
        queries = [(body[i], body[i + 1]) for i in range(len(body) - 1) if body[i].startswith("k")]
        assert len(queries) == 5 and all(pairs[k] == v for k, v in queries)
        assert [t for t, f in zip(body, flags) if f] == [v for _, v in queries]
        repeats += len({q for q, _ in queries}) < 5
    assert repeats > 0  # some key is queried twice: the values answered so far do not give the rest away
    assert build_task("mqar", distinct_queries=False).config()["distinct_queries"] is False
    assert "distinct_queries" not in build_task("mqar").config()  # the default keeps earlier cells' signature


def test_mqar_hidden_values_are_targets_never_inputs():
    """Zoology's format: the query key's next target is its value, the input there is filler."""
    for random_filler in (False, True):
        cfg = {"n_pairs": 5, "n_keys": 8, "n_values": 4, "hidden_values": True, "random_filler": random_filler}
        for task, n, e in _examples("mqar", **cfg):
            toks, ans = _strip(task, e)
            shown = task.decode(e.shown[len(e.tokens) - len(toks):])
            pairs = dict(zip(toks[1:11:2], toks[2:11:2]))
            assert len(pairs) == 5 and shown[:11] == toks[:11]  # the pairs are read as they are
            at = [i for i, f in enumerate(ans) if f]
            assert len(at) == 5 and sorted(toks[i - 1] for i in at) == sorted(pairs)  # every key queried once
            assert all(toks[i] == pairs[toks[i - 1]] and shown[i - 1] == toks[i - 1] for i in at)
            assert [i for i, (t, s) in enumerate(zip(toks, shown)) if t != s] == [i for i in at if shown[i] != toks[i]]
            if not random_filler:
                assert [shown[i] for i in at] == ["."] * 5
                assert set(shown[11:]) <= {".", *pairs}  # the values are never read after the pairs
            x, y = e.input_target()
            assert (x.numpy() == e.shown[:-1]).all() and (y[e.answer[1:]].numpy() == e.tokens[1:][e.answer[1:]]).all()
    plain = build_task("mqar", n_pairs=5, n_keys=8, n_values=4).sample(np.random.default_rng(0), 40)
    assert plain.shown is None  # the default format reads its tokens


def test_mqar_random_filler_draws_keys_and_values():
    task = build_task("mqar", n_pairs=2, n_keys=3, n_values=3, random_filler=True)
    seen: dict[str, int] = {}
    for seed in range(200):
        e = task.sample(np.random.default_rng(seed), 40)
        query = np.append(e.answer[1:], False)  # a query key: the token before an answer
        for t in task.decode(e.tokens[5:][~(e.answer | query)[5:]]):
            seen[t] = seen.get(t, 0) + 1
    assert "." not in seen and set(seen) == {"k0", "k1", "k2", "v0", "v1", "v2"}
    assert max(seen.values()) < 1.5 * min(seen.values())  # uniform but for the queried keys


def test_mqar_power_law_query_slots():
    """``power_a``: slot s (1 right after the pairs) drawn with probability proportional to s ** (a - 1)."""
    task = build_task("mqar", n_pairs=1, power_a=0.01)
    p = task.slot_probabilities(12)
    assert p.sum() == pytest.approx(1.0) and p[0] / p[1] == pytest.approx(2 ** 0.99) and p[0] == pytest.approx(0.3190, abs=1e-4)
    assert build_task("mqar", power_a=1.0).slot_probabilities(12) == pytest.approx(np.full(12, 1 / 12))
    counts = np.zeros(12)
    for seed in range(4000):  # one pair at n = 27: 24 body tokens, 12 query slots
        e = task.sample(np.random.default_rng(seed), 27)
        counts[(int(np.flatnonzero(e.answer)[0]) - 4) // 2] += 1
    assert np.abs(counts / counts.sum() - p).max() < 0.02  # 3 standard errors of the largest slot's frequency
    assert task.config() == {"n_pairs": 1, "n_keys": 32, "n_values": 32, "power_a": 0.01}
    assert build_task("mqar", hidden_values=True, random_filler=True).config() == {
        "n_pairs": 6, "n_keys": 32, "n_values": 32, "hidden_values": True, "random_filler": True}
    with pytest.raises(ValueError, match="power_a=0.0 must be in"):
        build_task("mqar", power_a=0.0)


def test_passkey_answer_is_the_key():
    for task, n, e in _examples("passkey", n_digits=4):
        toks, ans = _strip(task, e)
        s, q = toks.index("<sep>"), toks.index("?")
        assert toks[s + 1:s + 5] == toks[q + 1:] and all(d.isdigit() for d in toks[q + 1:])
        assert ans == [False] * (q + 1) + [True] * 4
        fill = [t for t in toks[1:s] + toks[s + 5:q]]
        assert fill == [f"f{i % 5}" for i in range(len(fill))]  # the filler is the repeated pattern


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match=r"unknown task 'copyy'; known tasks: \['addition', 'copy'"):
        build_task("copyy")
    with pytest.raises(ValueError, match="n_pairs=9 needs n_keys >= n_pairs"):
        build_task("mqar", n_pairs=9, n_keys=8)
    with pytest.raises(ValueError, match="counting: max_inc=10 must be at most 9"):
        build_task("counting", max_inc=10)
    with pytest.raises(ValueError, match="task 'copy': bad arguments"):
        build_task("copy", n_items=3)
    with pytest.raises(ValueError, match="train_len=10 is shorter than mqar's min_len=24"):
        TaskDataModule("mqar", train_len=10)


def test_datamodule_batches_mask_everything_but_answers():
    dm = TaskDataModule("reverse", train_len=24, batch_size=8, test_examples=5, seed=3)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (8, 24)
    ends = []
    for xi, yi in zip(x, y):
        bos, sep = xi.tolist().index(BOS), xi.tolist().index(SEP)
        m = sep - bos - 1
        scored = (yi != IGNORE).nonzero().flatten().tolist()
        assert scored == list(range(sep, sep + m))  # the answer: predicted from <sep> on
        assert yi[scored].tolist() == xi[bos + 1:sep].flip(0).tolist()
        assert (xi[sep + m:] == PAD).all() and (yi[sep + m:] == IGNORE).all()  # right padding, unscored
        ends.append(sep + m)  # the example's input length
    assert min(ends) >= dm.min_train_len and max(ends) <= 24 and len(set(ends)) > 1
    again = next(iter(TaskDataModule("reverse", train_len=24, batch_size=8, seed=3).train_dataloader()))
    assert torch.equal(again[0], x) and torch.equal(again[1], y)  # the seed reproduces the stream
    for n in (24, 96):
        batches = list(dm.length_dataloader(n))
        xs = torch.cat([b[0] for b in batches])
        assert xs.shape == (5, n) and torch.equal(xs, torch.cat([b[0] for b in dm.length_dataloader(n)]))
    assert not any(torch.equal(xs[0], row) for row in x)  # test examples are not training examples


def test_tinygpt_loss_is_the_mean_over_answer_tokens_only():
    from posenc_lightning.models import TinyGPT

    dm = TaskDataModule("copy", train_len=16, batch_size=4)
    x, y = next(iter(dm.train_dataloader()))
    model = TinyGPT(vocab_size=dm.vocab_size, d_model=16, n_layers=1, n_heads=2, encoding="rope")
    loss = model.training_step((x, y), 0)
    logits = model(x)
    ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE)
    assert torch.allclose(loss, ref, rtol=1e-5)
    assert not torch.allclose(loss, F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean())
    y2 = y.clone()
    y2[y == IGNORE] = 0  # what the loss would be were the question scored too
    assert not torch.allclose(model.training_step((x, y2), 0), loss)


def test_exact_match_and_metric_by_length():
    targets = torch.tensor([[IGNORE, 3, 4], [IGNORE, 3, 4], [IGNORE, IGNORE, 2], [IGNORE, IGNORE, IGNORE]])
    preds = torch.tensor([[9, 3, 4], [3, 3, 5], [0, 0, 2], [1, 1, 1]])  # right; one wrong; right; no answer
    ok, hit, n = exact_match(preds, targets)
    assert ok.tolist() == [True, False, True, True] and hit.tolist() == [2, 1, 1, 0] and n.tolist() == [2, 2, 1, 0]
    logits = F.one_hot(preds, 10).float()
    assert torch.equal(exact_match(logits, targets)[0], ok)
    m = ExactMatchByLength([3, 6, 12])
    m.update(logits, targets, 3)
    m.update(logits[:1], targets[:1], 6)
    res = m.compute()
    assert res["exact_match"][:2].tolist() == [2 / 3, 1.0] and math.isnan(res["exact_match"][2])
    assert res["token_accuracy"][:2].tolist() == [4 / 5, 1.0]
    with pytest.raises(ValueError, match="length=5 is not one of lengths=\\[3, 6, 12\\]"):
        m.update(logits, targets, 5)
    with pytest.raises(ValueError, match="predictions .* and targets .* differ"):
        exact_match(preds[:, :2], targets)


def test_exact_match_under_teacher_forcing_is_greedy_decoding():
    """A model is exact on a sequence iff greedy decoding from the question reproduces the answer."""
    from posenc_lightning.models import TinyGPT

    dm = TaskDataModule("copy", {"n_symbols": 2}, train_len=8, batch_size=16)
    task = dm.task
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=task.vocab_size, d_model=16, n_layers=1, n_heads=2, encoding="rope")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _, (x, y) in zip(range(30), dm.train_dataloader()):  # a little training: right on some, wrong on others
        opt.zero_grad()
        F.cross_entropy(model(x).transpose(1, 2), y).backward()
        opt.step()
    model.eval()
    agree = []
    for seed in range(150):
        e = task.sample(np.random.default_rng(seed), 5)  # <bos> a b <sep> | a b
        x, y = e.input_target()
        ok = bool(exact_match(model(x[None]), y[None])[0])
        q = int(np.argmax(e.tokens == SEP)) + 1
        gen = model.generate(torch.from_numpy(e.tokens[:q])[None], len(e.tokens) - q, use_cache=False)
        agree.append((ok, gen[0].tolist() == e.tokens.tolist()))
    assert all(a == b for a, b in agree) and {a for a, _ in agree} == {True, False}


def test_task_eval_callback_logs_exact_match_per_length_in_a_trainer():
    import lightning.pytorch as pl

    from posenc_lightning.callbacks import PosEncCallback, TaskEvalCallback
    from posenc_lightning.models import TinyGPT

    dm = TaskDataModule("passkey", train_len=16, batch_size=4, test_examples=6)
    model = TinyGPT(vocab_size=dm.vocab_size, d_model=16, n_layers=1, n_heads=2, max_seq_len=16, encoding=None)
    cb = TaskEvalCallback(multiples=[1, 3], examples=5)
    trainer = pl.Trainer(max_steps=2, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[PosEncCallback("alibi"), cb])
    trainer.fit(model, dm)
    assert set(cb.results) == {16, 48}
    for n in (16, 48):
        assert float(trainer.callback_metrics[f"task_eval/exact_match/{n}"]) == pytest.approx(cb.results[n])
        assert 0.0 <= cb.results[n] <= cb.token_accuracy[n] <= 1.0  # a sequence right means all its tokens right
    x = torch.cat([b[0] for b in dm.length_dataloader(48, max_windows=5)])
    logits = model.eval()(x)
    y = torch.cat([b[1] for b in dm.length_dataloader(48, max_windows=5)])
    assert exact_match(logits, y)[0].float().mean().item() == pytest.approx(cb.results[48])
