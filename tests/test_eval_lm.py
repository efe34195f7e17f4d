"""The lm-eval wrapper, the offline byte tokenizer and the offline task guards."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance

from posenc_lightning.eval import LightningLM, OfflineTaskError, build_tasks, load_byte_tokenizer
from posenc_lightning.eval.offline import local_haystack, offline_env, ruler_patches
from posenc_lightning.models import TinyGPT


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = TinyGPT(d_model=32, n_layers=2, n_heads=2, max_seq_len=64).eval()
    with torch.no_grad():  # a less uniform model than the init: greedy choices are not ties
        for p in m.parameters():
            p.mul_(8.0) if p.dim() > 1 else None
    return m


def _req(kind, args, i=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=i)


def test_byte_tokenizer_roundtrip_and_loads_by_path(tmp_path):
    tok = load_byte_tokenizer(str(tmp_path / "tok"))
    s = "héllo\x00 wörld\n\t  def f(x):  return 😀"
    assert tok(s).input_ids == list(s.encode("utf-8"))  # id = byte, no BOS/EOS added
    assert tok.decode(list(s.encode())) == s
    assert tok.eos_token_id == 0 and len(tok) == 256
    from transformers import AutoTokenizer

    with offline_env():
        again = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))  # how RULER loads it
    assert again("abc").input_ids == [97, 98, 99]


def test_loglikelihood_equals_model_token_logprobs(model):
    lm = LightningLM(model)
    ctx, cont = "def add(a, b):", "\n    return a + b"  # lm-eval moves trailing spaces to cont
    (ll, greedy), = lm.loglikelihood([_req("loglikelihood", (ctx, cont))])
    ids = torch.tensor([list((ctx + cont).encode())])
    nll = model.token_nll(ids[:, :-1], ids[:, 1:])[0]  # the model's own per-token NLL
    n_cont = len(cont.encode())
    assert ll == pytest.approx(-nll[-n_cont:].sum().item(), rel=1e-5, abs=1e-4)
    logits = model(ids[:, :-1])[0, -n_cont:]
    assert greedy == bool((logits.argmax(-1) == ids[0, -n_cont:]).all())
    # rolling: log p(text | eot) summed over every token
    (roll,) = lm.loglikelihood_rolling([_req("loglikelihood_rolling", (ctx + cont,))])
    full = torch.tensor([[0] + list((ctx + cont).encode())])
    assert roll == pytest.approx(-model.token_nll(full[:, :-1], full[:, 1:]).sum().item(), rel=1e-5)
    # windows of max_length give the same total when the text fits one window
    assert LightningLM(model, max_length=256).loglikelihood_rolling(
        [_req("loglikelihood_rolling", (ctx + cont,))])[0] == pytest.approx(roll, rel=1e-5)


def test_generate_until_cache_equals_no_cache(model):
    prompts = ["import os\nimport sys\n", "class Foo:\n    def __init__(self):", "x = [1, 2, 3"]
    reqs = [_req("generate_until", (p, {"until": [], "max_gen_toks": 24}), i) for i, p in enumerate(prompts)]
    cached = LightningLM(model, use_cache=True).generate_until(reqs)
    plain = LightningLM(model, use_cache=False).generate_until(reqs)
    assert cached == plain
    # and both equal the model's own greedy decoding, token for token
    for p, text in zip(prompts, cached):
        ids = torch.tensor([list(p.encode())])
        ref = model.generate(ids, 24, use_cache=False)[0, ids.shape[1]:].tolist()
        if 0 in ref:
            ref = ref[:ref.index(0)]
        assert text == load_byte_tokenizer().decode(ref)
    # stop sequences cut the text
    lm = LightningLM(model)
    full = lm.generate_until([_req("generate_until", (prompts[0], {"until": [], "max_gen_toks": 24}))])[0]
    stop = full[5:7]
    cut = lm.generate_until([_req("generate_until", (prompts[0], {"until": [stop], "max_gen_toks": 24}))])[0]
    assert cut == full.split(stop)[0]


def test_download_tasks_fail_fast_with_a_clear_message():
    with pytest.raises(OfflineTaskError, match="ruler_qa_squad needs the SQuAD"):
        build_tasks(["ruler_qa_squad"], [512], limit=1)


def test_tasks_that_loop_at_short_lengths_fail_fast():
    with pytest.raises(ValueError, match="ruler_vt does not finish.*max_seq_lengths >= 4096"):
        build_tasks(["ruler_vt"], [512, 8192], limit=1)


def test_essay_haystack_is_local_and_patches_are_undone():
    import lm_eval.tasks.ruler.prepare_niah as prep

    real = prep.get_haystack
    with ruler_patches(num_samples=1):
        words = prep.get_haystack("essay")
        assert words == local_haystack(None) and len(words) > 10_000
        assert prep.get_haystack("repeat").startswith("The grass is green")
    assert prep.get_haystack is real


def test_our_tasks_build_with_limit_per_length():
    built = build_tasks(["passkey_generate", "passkey_loglikelihood", "ppl_by_length"], [256, 512], limit=3)
    tok = load_byte_tokenizer()
    for name, task in built.task_dict["tasks"].items():
        docs = list(task.eval_docs)
        assert built.lengths[name] == [256, 512]
        assert len(built.samples[name]) == 6  # limit is per length
        for d in docs:
            text = d.get("input") or d.get("text")
            assert len(tok(text).input_ids) <= d["max_length"]
    pk = [d for d in built.task_dict["tasks"]["passkey_generate"].eval_docs]
    assert all(d["passkey"] in d["input"] for d in pk)
    # documents are as long as the length allows (the generation budget is 8 tokens)
    assert all(len(tok(d["input"]).input_ids) > d["max_length"] - 8 - 100 for d in pk)


def test_essay_niah_fills_short_lengths_from_the_local_haystack():
    """RULER grows the essay 500 words at a time (one word of haystack at 512 bytes); ours fills
    the length: the prompt plus 128 generated tokens fits, and uses most of it."""
    built = build_tasks(["niah_single_2"], [512, 1024], limit=1)
    tok = load_byte_tokenizer()
    docs = list(built.task_dict["tasks"]["niah_single_2"].eval_docs)
    assert [d["max_length"] for d in docs] == [512, 1024]
    hay = set(local_haystack(None)[:5000])
    for d in docs:
        n = len(tok(d["input"]).input_ids)
        assert d["max_length"] - 128 - 40 < n <= d["max_length"] - 128
        assert d["outputs"][0] in d["input"]
        assert sum(w in hay for w in d["input"].split()) > 20  # the haystack is the local corpus
