"""`LayerSchedule`: resolving rules to layers, its errors, and `inject` of a schedule or preset."""

import inspect
import math

import pytest
import torch

from posenc_lightning import LayerSchedule, build_preset, inject, injected_spec, restore_from_checkpoint
from posenc_lightning.attention.pipeline import context
from posenc_lightning.encodings.registry import available_encodings, encoding_class
from posenc_lightning.encodings.rope import RotaryEncoding
from posenc_lightning.functional.rope import rope_inv_freq
from posenc_lightning.functional.temperature import log_temperature
from posenc_lightning.models import TinyGPT
from tests.helpers import Attn


def _names(specs):
    return [s.encoding for s in specs]


def test_selectors_name_the_layers_they_say():
    s = LayerSchedule([{"layers": 0, "encoding": "alibi"}, {"layers": "3:5", "encoding": "fire"},
                       {"layers": "every 3", "encoding": "nope"}, {"layers": "last 2", "encoding": "rope"},
                       {"layers": [-7], "encoding": "xpos"}])
    assert _names(s.resolve(8)) == ["alibi", "xpos", "nope", "fire", "fire", "nope", "rope", "rope"]
    # in 7 layers "every 3" (2, 5) and "last 2" (5, 6) both name layer 5
    with pytest.raises(ValueError, match="layer 5 is named by rule 2 .'every 3'. and rule 3 .'last 2'."):
        s.resolve(7)
    s = LayerSchedule([{"layers": ":2", "encoding": "alibi"}, {"layers": "rest", "encoding": "nope"}])
    assert _names(s.resolve(4)) == ["alibi", "alibi", "nope", "nope"]


def test_every_k_counts_as_llama4_and_gemma3():
    """transformers' Llama 4: ``no_rope_layers[i] = int((i + 1) % 4 != 0)``; Gemma 3: layer i is global
    iff ``(i + 1) % sliding_window_pattern == 0``."""
    specs = build_preset("irope", chunk=16).resolve(12)
    assert [s.encoding == "log_temperature" for s in specs] == [(i + 1) % 4 == 0 for i in range(12)]
    assert all((s.chunk is None) == ((i + 1) % 4 == 0) for i, s in enumerate(specs))
    specs = build_preset("gemma3_local_global", window=32).resolve(12)
    assert [s.config["theta"] for s in specs] == [1e6 if (i + 1) % 6 == 0 else 1e4 for i in range(12)]
    assert [s.window for s in specs] == [None if (i + 1) % 6 == 0 else 32 for i in range(12)]


def test_layer_types_rule():
    s = LayerSchedule([{"layers": "type:full_attention", "encoding": "nope"},
                       {"layers": "type:sliding_attention", "encoding": "rope", "window": 8}])
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    specs = s.resolve(3, types)
    assert _names(specs) == ["rope", "nope", "rope"] and [x.window for x in specs] == [8, None, 8]
    with pytest.raises(ValueError, match="needs the model's layer_types"):
        s.resolve(3)
    with pytest.raises(ValueError, match="no layer has type 'full_attention'"):
        s.resolve(2, ["sliding_attention"] * 2)


@pytest.mark.parametrize(("rules", "match"), [
    ([{"layers": 5, "encoding": "rope"}, {"layers": "rest", "encoding": "nope"}], "layer 5 is out of range"),
    ([{"layers": "0:2", "encoding": "rope"}], r"layers \[2, 3\] of 4 are named by no rule"),
    ([{"layers": "last 5", "encoding": "rope"}], "more layers than the model's 4"),
    ([{"layers": "every 2", "encoding": "rope"}, {"layers": [1], "encoding": "nope"},
      {"layers": "rest", "encoding": "nope"}], "layer 1 is named by rule 0"),
    ([{"layers": "odd", "encoding": "rope"}], "cannot read layers='odd'"),
])
def test_errors_name_the_layers_and_the_fix(rules, match):
    with pytest.raises(ValueError, match=match):
        LayerSchedule(rules).resolve(4)


def test_bad_specs_are_refused_early():
    with pytest.raises(ValueError, match="window must be a positive int"):
        LayerSchedule([{"layers": "rest", "encoding": "rope", "window": 0}])
    with pytest.raises(ValueError, match="unknown keys"):
        LayerSchedule([{"layers": "rest", "encoding": "rope", "windw": 8}])
    with pytest.raises(ValueError, match="Unknown preset 'irop'.*'irope'"):
        build_preset("irop")
    with pytest.raises(TypeError, match="unknown argument"):
        build_preset("irope", window=8)


def test_inject_gives_each_layer_its_encoding_and_window():
    model = TinyGPT(d_model=32, n_layers=8, n_heads=2, max_seq_len=64, encoding=None)
    enc = inject(model, "gemma3_local_global", window=8)
    attn = [b.attn for b in model.blocks]
    assert enc is attn[0].posenc
    # one instance per distinct spec (shared across the layers of that spec), two specs here
    assert len({id(a.posenc) for a in attn}) == 2 and attn[0].posenc is not attn[5].posenc
    assert attn[5].posenc.theta == 1e6 and attn[5].posenc_window is None
    assert [a.posenc_window for a in attn] == [8, 8, 8, 8, 8, None, 8, 8]
    assert inject(model, "gemma3_local_global", window=8) is enc  # the same again: kept
    # not shared: one instance per layer
    inject(model, "gemma3_local_global", window=8, share_across_layers=False)
    assert len({id(a.posenc) for a in attn}) == 8
    # a plain encoding replaces the schedule entirely, windows included
    inject(model, "alibi")
    assert all(a.posenc_window is None and a.posenc_chunk is None for a in attn)
    assert all(a.posenc is attn[0].posenc for a in attn)


def test_schedule_round_trips_through_a_checkpoint():
    torch.manual_seed(0)
    model = TinyGPT(d_model=32, n_layers=4, n_heads=2, max_seq_len=64, encoding=None)
    inject(model, LayerSchedule([{"layers": "every 2", "encoding": "fire"},
                                 {"layers": "rest", "encoding": "alibi", "window": 8}]), share_across_layers=False)
    spec = injected_spec(model)
    assert spec["encoding"] == "schedule" and LayerSchedule.from_dict(spec["schedule"]).resolve(4)[0].window == 8
    x = torch.randint(0, 256, (1, 30))
    want = model(x)
    fresh = TinyGPT(d_model=32, n_layers=4, n_heads=2, max_seq_len=64, encoding=None)
    restore_from_checkpoint(fresh, {"posenc_lightning": spec})
    fresh.load_state_dict(model.state_dict())
    assert [b.attn.posenc_window for b in fresh.blocks] == [8, None, 8, None]
    torch.testing.assert_close(fresh(x), want)


def test_a_windowed_schedule_runs_on_triton():
    """The triton kernels honor a window (`LOCAL_MASKS`): rnope_swa on triton (interpreter) gives
    the logits of eager."""
    pytest.importorskip("triton")
    x = torch.randint(0, 256, (1, 40))
    logits = []
    for backend in ("triton", "eager"):
        torch.manual_seed(0)
        model = TinyGPT(d_model=32, n_layers=2, n_heads=2, max_seq_len=64, encoding=None)
        inject(model, "rnope_swa", window=8, interval=2, backend=backend)
        logits.append(model(x))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_embedding_encodings_are_not_scheduled():
    model = TinyGPT(d_model=32, n_layers=2, n_heads=2, max_seq_len=64, encoding=None)
    with pytest.raises(ValueError, match="stage 1"):
        inject(model, LayerSchedule.uniform("sinusoidal"))


def test_p_rope_keeps_the_highest_frequencies():
    """p-RoPE: RoPE's frequencies ``theta^(-2i/d)`` for ``i < int(p d / 2)``, 0 for the rest."""
    m = Attn(n_heads=2, head_dim=16)
    enc = inject(m, "rope", p=0.75)
    inv = enc.base_inv_freq()
    full = rope_inv_freq(16, 10000.0)
    keep = int(0.75 * 16 // 2)  # 6 of 8
    torch.testing.assert_close(inv[:keep], full[:keep])
    assert (inv[keep:] == 0).all() and (inv[:keep] > 0).all()
    # the channels of the dropped frequencies are not rotated: q . k there does not depend on position
    q, k = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    pos = torch.tensor([[0, 3, 4, 10, 11, 40, 41, 50, 99]])
    ctx = context(enc, None, pos, pos)
    qr, kr = enc.rotate(q, k, ctx)
    for half in (slice(keep, 8), slice(8 + keep, 16)):  # "half" layout: pair (i, i + 8)
        torch.testing.assert_close(qr[..., half], q[..., half])
        torch.testing.assert_close(kr[..., half], k[..., half])
    assert (qr[..., :keep] - q[..., :keep]).abs().max() > 1e-3


def test_p_rope_zero_is_nope_and_one_is_rope():
    q, k, v = (torch.randn(1, 2, 12, 16) for _ in range(3))
    outs = {}
    for name, cfg in [("nope", {}), ("rope", {}), ("rope0", {"p": 0.0}), ("rope1", {"p": 1.0})]:
        m = Attn(n_heads=2, head_dim=16)
        inject(m, name[:4], **cfg)
        outs[name] = m(q, k, v)
    torch.testing.assert_close(outs["rope0"], outs["nope"])
    torch.testing.assert_close(outs["rope1"], outs["rope"])


def test_log_temperature_is_llama4s_formula():
    pos = torch.tensor([[0, 6, 7, 8, 15, 16, 1000]])
    got = log_temperature(pos, 8.0, 0.1)
    want = torch.tensor([[math.log(math.floor((p + 1) / 8) + 1) * 0.1 + 1 for p in pos[0].tolist()]])
    torch.testing.assert_close(got, want)
    # in attention: plain attention of the scaled queries
    m = Attn(n_heads=2, head_dim=16)
    inject(m, "log_temperature", floor_scale=4.0, attn_scale=0.5)
    q, k, v = (torch.randn(1, 2, 7, 16, dtype=torch.float64) for _ in range(3))
    out = m(q, k, v, positions=pos)
    s = log_temperature(pos, 4.0, 0.5).double()
    ref = torch.nn.functional.scaled_dot_product_attention(q * s[:, None, :, None], k, v, is_causal=True)
    torch.testing.assert_close(out, ref)


def test_every_rotary_law_takes_partial_rotary_factor():
    """Every frequency law (`RotaryEncoding`) accepts ``partial_rotary_factor`` and rotates only that
    fraction of the channels (the learned-matrix rotations, liere and comrope, are not frequency laws)."""
    laws = [n for n in available_encodings() if issubclass(encoding_class(n), RotaryEncoding)]
    assert "rope" in laws and "exposb" in laws
    for n in laws:
        assert "partial_rotary_factor" in inspect.signature(encoding_class(n).__init__).parameters, n
        if n in ("rope_2d",):  # [B, N, 2] positions
            continue
        m = Attn(n_heads=2, head_dim=16)
        enc = inject(m, n, partial_rotary_factor=0.5)
        assert enc.rotary_dim == 8


def test_the_cli_check_knows_presets():
    """``posenc train --encoding irope --posenc.config='{chunk: 32}'`` passes the front door's check;
    an argument the preset does not take is named."""
    from posenc_lightning.cli_checks import check_encoding_args

    check_encoding_args("irope", {"chunk": 32})
    with pytest.raises(ValueError, match="irope takes no argument 'window'"):
        check_encoding_args("irope", {"window": 32})
