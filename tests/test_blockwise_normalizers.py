"""The blockwise backend (attention/backends/blockwise/__init__.py): sba, rse and exposb by query blocks x
key tiles, against the eager float64 reference, forward and backward (q, k, v, hidden and every
encoding parameter: rse's penalty slopes, exposb's band_weights / decay_rates), with tiles small
enough that N=29 spans several of them in both directions; compile-clean; O(N x block) memory.

Tolerances are the conformance suite's (tests/test_conformance.py): these encodings compute in
float32 by design, so fp32 and fp64 are held to 2e-5 of the case's scale, bf16 to 4e-2.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from posenc_lightning.attention.backends import BACKENDS, blockwise, resolve_backend
from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext, LinearBias
from posenc_lightning.encodings.registry import build_encoding
from posenc_lightning.functional.tunables import Tunables
from tests import test_conformance as conf
from tests.conformance import ConfLayer

NORMALIZERS = ("sba", "rse", "exposb")
#: grouped kv heads where the encoding takes them (exposb's per-head rotation needs n_kv == n_heads)
HEADS = {"sba": (4, 2, 8), "rse": (4, 2, 8), "exposb": (2, 2, 8)}
CPU = torch.device("cpu")


#: 4 query rows x 3 keys per tile: N=29 is 8 blocks of rows and up to 10 key tiles, with partial
#: tiles at both ends (29 is a multiple of neither)
SMALL_TILES = Tunables(block_rows=4, block_keys=3, min_bias_rows=4)


def _tiles(monkeypatch, tunables: Tunables) -> Tunables:
    """The test layers' attention modules (`tests.conformance.ConfLayer`) declare ``tunables``."""
    monkeypatch.setattr(ConfLayer, "posenc_tunables", tunables)
    return tunables


@pytest.fixture
def small_tiles(monkeypatch):
    """`SMALL_TILES` on the test layers."""
    return _tiles(monkeypatch, SMALL_TILES)


@pytest.mark.parametrize("scenario", conf.SCENARIOS)
@pytest.mark.parametrize("dtype", list(conf.DTYPES))
@pytest.mark.parametrize("name", NORMALIZERS)
def test_equals_eager_reference_across_tiles(name, dtype, scenario, small_tiles):
    """arange, offset positions, packed documents, decoding through a KV cache, key padding."""
    conf._check(name, "blockwise", dtype, scenario, b=2, n=29, heads=HEADS[name])


@pytest.mark.parametrize("name", ["sba", "rse"])
def test_offsets_and_decode_from_far_positions(name, small_tiles):
    conf._check(name, "blockwise", "fp32", "decode", b=2, n=17, heads=(3, 1, 8), offset=1500)
    conf._check(name, "blockwise", "fp32", "offset", b=1, n=31, heads=(2, 2, 16), offset=3000)


@pytest.mark.parametrize("scenario", ["arange", "decode", "packed"])
@pytest.mark.parametrize("name", ["sba", "rse"])
def test_attend_current(name, scenario, small_tiles):
    """With ``attend_current`` the diagonal is broken off first (prefill and cached decoding)."""
    from posenc_lightning.inject import inject
    from tests.conformance import ConfLayer, make_inputs, run_case, scenario_args

    x = make_inputs(2, 19, (2, 2, 8), torch.float64)
    args = scenario_args(scenario, 2, 19, 1)
    outs = []
    for backend in ("eager", "blockwise"):
        torch.manual_seed(0)
        m = ConfLayer(2, 8)
        inject(m, name, backend=backend, attend_current=True)
        m.to(torch.float64)
        outs.append(run_case(m, x, {k: v for k, v in args.items() if k != "prefill" or backend != "eager"}, True))
    for a, b in zip(*outs):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, atol=2e-5 * max(a.abs().max().item(), 1e-9), rtol=0)


def test_the_first_query_sees_nothing():
    """Without ``attend_current`` query 0 has no key to break off: its output is 0."""
    from posenc_lightning.inject import inject
    from tests.conformance import ConfLayer, make_inputs, run_case

    x = make_inputs(1, 11, (2, 2, 8), torch.float64)
    torch.manual_seed(0)
    m = ConfLayer(2, 8)
    inject(m, "sba", backend="blockwise")
    assert run_case(m, x.to(torch.float32), {}, False)[0][:, :, 0].abs().max() == 0


@pytest.mark.parametrize("q_start,k_start", [(0, 0), (7, 2), (2, 7)])
def test_a_tile_modulation_read_off_one_diagonal_is_the_modulation(q_start, k_start):
    """At arange positions (shifted apart either way) each tile's distance modulation, read off the
    ``r + c - 1`` differences (`TilesSpec.mod_shift`), equals the normalizer's `modulation` at the tile's
    positions, for tiles above, on and below the diagonal, of shapes that divide nothing."""
    from posenc_lightning.attention.backends.blockwise.normalizers import TilesSpec, _modulation
    from posenc_lightning.attention.backends.blockwise.tiles import Tiling

    enc = build_encoding("exposb", distance_decay=0.05).bind(n_heads=2, head_dim=8)
    n_q, n_k = 23, 31
    q_pos, k_pos = q_start + torch.arange(n_q)[None], k_start + torch.arange(n_k)[None]
    ctx = AttentionContext(q_pos, k_pos, True)
    normalizer = enc.normalize(ctx)
    shift = blockwise._modulation_shift(normalizer, ctx)
    assert shift == q_start - k_start
    tl = Tiling(AttentionMask(False, 0, n_q, n_k), n_q, n_k, None, 5, 7, descending=False)
    plain = TilesSpec(tl, None, (), 1.0, normalizer.modulation, q_pos, k_pos)
    diagonal = TilesSpec(tl, None, (), 1.0, normalizer.modulation, q_pos, k_pos, mod_shift=shift)
    for s, e in ((0, 5), (10, 15), (20, 23)):
        for k0, k1 in ((0, 7), (14, 21), (28, 31)):
            want = _modulation(plain, s, e, k0, k1, torch.float32)
            got = _modulation(diagonal, s, e, k0, k1, torch.float32)
            assert got.shape == (1, 1, 1, e - s, k1 - k0)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    # a modulation that is not declared a function of the difference, or positions that are not
    # arange: the tile's own positions
    assert blockwise._modulation_shift(normalizer, AttentionContext(q_pos.flip(-1), k_pos, True)) is None
    assert blockwise._modulation_shift(build_encoding("sba").bind(n_heads=2, head_dim=8).normalize(ctx), ctx) is None


def test_auto_picks_it_for_the_normalizers_and_refuses_the_rest():
    for name in NORMALIZERS:
        enc = build_encoding(name).bind(n_heads=2, head_dim=8)
        assert resolve_backend("auto", enc, CPU, True).NAME == "blockwise"
        assert resolve_backend("auto", enc, CPU, False).NAME == "blockwise"
    for name in ("rope", "alibi", "nope"):
        why = blockwise.supports(build_encoding(name).bind(n_heads=2, head_dim=8), CPU, True)
        assert why and "keeps softmax" in why
    assert "blockwise" in BACKENDS


# ------------------------------------------------------------------------------ compile-clean
def _case(name: str, n: int = 24, heads: tuple[int, int, int] = (4, 2, 8), known: bool = False,
          tunables: Tunables | None = None):
    """The backend's own call for ``name`` with fixed shapes: (function of q, k, v, inputs);
    ``known``: the positions' starts given (as the mixin does), so none is read from the values."""
    h, hkv, d = heads if name != "exposb" else (heads[0], heads[0], heads[2])
    enc = build_encoding(name).bind(n_heads=h, head_dim=d)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, hh, n, d, generator=g, requires_grad=True) for hh in (h, hkv, hkv))
    pos = torch.arange(n)[None]
    mask = AttentionMask(True, 0, n, n)

    def fn(q, k, v):
        ctx = AttentionContext(pos, pos, True, q_start=0 if known else None, k_start=0 if known else None)
        bias = LinearBias(enc.penalty, pos, pos) if name == "rse" else None
        return blockwise.attend(q, k, v, bias=bias, mask=mask, scale=d ** -0.5, normalizer=enc.normalize(ctx), ctx=ctx,
                                tunables=tunables)

    return fn, (q, k, v), [p for p in enc.parameters()]


@pytest.mark.parametrize("name,known", [*((n, False) for n in NORMALIZERS), ("exposb", True)])
def test_traces_without_graph_breaks_and_compiles_to_the_same_numbers(name, known):
    """N=24 in 8 x 10 tiles (3 blocks of rows, up to 3 key tiles each: the loops unroll in the trace);
    exposb with known starts takes each tile's modulation off one diagonal (`TilesSpec.mod_shift`)."""
    fn, ins, params = _case(name, known=known, tunables=Tunables(block_rows=8, block_keys=10))
    assert torch._dynamo.explain(fn)(*ins).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    cot = torch.randn(ins[0].shape, generator=torch.Generator().manual_seed(1))
    res = []
    for f in (fn, compiled):
        out = f(*ins)
        grads = torch.autograd.grad(out, [*ins, *[p for p in params if p.requires_grad]], cot, allow_unused=True)
        res.append([out, *grads])
    if name == "rse":
        assert res[0][-1] is not None and res[0][-1].abs().sum() > 0  # the penalty slopes get a gradient
    n_inputs = 1 + len(ins)  # the output, then the inputs' gradients, then the parameters'
    for i, (a, b) in enumerate(zip(*res)):
        assert (a is None) == (b is None)
        if a is not None:
            # a parameter's gradient sums over every (row, key): the compiled graph may order that
            # float32 sum differently (2.8e-5 relative seen on one CPU)
            rtol = 1e-5 if i < n_inputs else 1e-4
            torch.testing.assert_close(b, a, atol=1e-6, rtol=rtol)


# ------------------------------------------------------------------------------------- memory
def _peak_fwd_bwd(name: str, n: int, h: int = 4, d: int = 32, known: bool = False) -> int:
    from benchmarks.memory import peak_allocated_bytes

    enc = build_encoding(name).bind(n_heads=h, head_dim=d)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, generator=g, requires_grad=True) for _ in range(3))
    pos = torch.arange(n)[None]
    cot = torch.randn(q.shape, generator=g)

    def step():
        ctx = AttentionContext(pos, pos, True, q_start=0 if known else None, k_start=0 if known else None)
        bias = LinearBias(enc.penalty, pos, pos) if name == "rse" else None
        out = blockwise.attend(q, k, v, bias=bias, mask=AttentionMask(True, 0, n, n), scale=d ** -0.5,
                               normalizer=enc.normalize(ctx), ctx=ctx)
        torch.autograd.grad(out, [q, k, v, *enc.parameters()], cot, allow_unused=True)

    step()
    return peak_allocated_bytes(step)


@pytest.mark.parametrize("name,known", [*((n, False) for n in NORMALIZERS), ("exposb", True)])
def test_no_n_by_n_tensor_is_allocated(name, known):
    """Allocator peak of forward+backward (default tiles, 4 heads of 32): doubling N from 1024 to
    2048 about doubles it (an N x N term would quadruple it), and at 2048 it stays under half
    of one ``H x N x N`` float32 tensor (64 MiB), which the eager path allocates several of.
    ``known``: the positions' starts given, as the mixin gives them (exposb's diagonal modulation)."""
    small, large = _peak_fwd_bwd(name, 1024, known=known), _peak_fwd_bwd(name, 2048, known=known)
    nn_bytes = 4 * 2048 * 2048 * 4
    assert large / small < 2.5, f"{name}: peak grows {large / small:.2f}x from N=1024 to 2048"
    assert large < nn_bytes / 2, f"{name}: peak {large / 2**20:.1f} MiB at N=2048"


# ------------------------------------------------------------- a bias that is not f(i - j)
def _content_sb():
    from posenc_lightning.encodings.base import DenseBias, span
    from posenc_lightning.encodings.stick_breaking import StickBreaking

    class ContentSB(StickBreaking):
        name = "content_sb_test"

        def build(self) -> None:
            self.w = torch.nn.Parameter(torch.linspace(-0.5, 0.5, self.n_heads))

        def _ready(self) -> bool:
            return self.n_heads is not None

        def bias(self, q, k, ctx):
            n_q, n_k = q.shape[-2], k.shape[-2]
            pos = ctx.k_pos.to(torch.float32)

            def rows(s, e, ke, w, qq):
                ramp = torch.cos(0.3 * pos[:, None, None, :ke])  # [B, 1, 1, K]: not a function of i - j
                return (w[None, :, None, None] * qq.float().sum(-1, keepdim=True)) * ramp

            return DenseBias.lazy(rows, n_q, n_k, inputs=(self.w, q),
                                  window=lambda s, e, ke: (None, span(s, e, -2)))

    return ContentSB


@pytest.mark.parametrize("scenario", ["arange", "packed", "decode", "padding"])
def test_a_bias_by_blocks_of_rows_and_its_gradients(scenario, small_tiles):
    from posenc_lightning.inject import inject
    from tests.conformance import ConfLayer, make_inputs, run_case, scenario_args

    cls = _content_sb()
    x = make_inputs(2, 23, (2, 2, 8), torch.float64)
    args = scenario_args(scenario, 2, 23, 1)
    res = []
    for backend in ("eager", "blockwise"):
        torch.manual_seed(0)
        m = ConfLayer(2, 8)
        inject(m, cls(), backend=backend)
        m.to(torch.float64)
        full = {k: v for k, v in args.items() if k != "prefill"} if backend == "eager" else args
        res.append(run_case(m, x, full, True))
    assert res[1][-1] is not None and res[1][-1].abs().sum() > 0  # w gets a gradient
    for a, b in zip(*res):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, atol=2e-5 * max(a.abs().max().item(), 1e-9), rtol=0)


@pytest.mark.parametrize("grad", [True, False])
def test_a_bias_without_stand_in_inputs(grad, small_tiles):
    """A lazy bias that names no inputs cannot be differentiated by blocks: with gradients the
    backend runs the eager reference for it; without, its rows by blocks. Both equal eager."""
    from posenc_lightning.encodings.base import DenseBias
    from posenc_lightning.inject import inject
    from tests.conformance import ConfLayer, make_inputs, run_case

    base = _content_sb()

    class Opaque(base):
        name = "opaque_sb_test"

        def bias(self, q, k, ctx):
            full = super().bias(q, k, ctx)
            return DenseBias.lazy(lambda s, e, ke: full.rows(s, e, ke), q.shape[-2], k.shape[-2])

    x = make_inputs(1, 21, (2, 2, 8), torch.float64)
    res = []
    for backend in ("eager", "blockwise"):
        torch.manual_seed(0)
        m = ConfLayer(2, 8)
        inject(m, Opaque(), backend=backend)
        m.to(torch.float64)
        res.append(run_case(m, x, {}, grad))
    for a, b in zip(*res):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, atol=2e-5 * max(a.abs().max().item(), 1e-9), rtol=0)


def test_bidirectional_modulated_softmax(small_tiles):
    """exposb without the causal mask (every key tile of every block), with key padding."""
    from posenc_lightning.inject import inject
    from tests.conformance import ConfLayer, make_inputs, run_case

    x = make_inputs(2, 17, (2, 2, 8), torch.float64)
    kpm = torch.ones(2, 17, dtype=torch.bool)
    kpm[1, :3] = False
    res = []
    for backend in ("eager", "blockwise"):
        torch.manual_seed(0)
        m = ConfLayer(2, 8)
        inject(m, "exposb", backend=backend)
        m.to(torch.float64)
        res.append(run_case(m, x, {"causal": False, "key_padding_mask": kpm}, True))
    for a, b in zip(*res):
        if a is not None:
            torch.testing.assert_close(b, a, atol=2e-5 * max(a.abs().max().item(), 1e-9), rtol=0)


# ------------------------------------------------------------------------------ Bias.head_scaled
def test_linear_bias_is_its_slopes_times_a_shared_pattern():
    """ALiBi's `head_scaled` factors are exactly its dense form: ``slopes[h] * -|i - j|``."""
    pos_q = torch.tensor([[3, 7, 8, 20], [0, 1, 5, 6]])
    pos_k = torch.tensor([[0, 2, 7, 9, 30], [1, 1, 2, 4, 6]])
    slopes = torch.tensor([0.5, 0.125, 2.0])
    bias = LinearBias(slopes, pos_q, pos_k)
    f = bias.head_scaled()
    assert f.w is slopes
    pattern = f.pattern(pos_q, pos_k)
    assert pattern.shape == (2, 4, 5) and pattern[0, 0, 4] == -27 and pattern[1, 3, 0] == -5
    assert torch.equal(f.w[None, :, None, None] * pattern[:, None], bias.materialize())


def test_linear_bias_pattern_equals_the_integer_distance_at_large_positions():
    """The pattern subtracts integer positions in float64 into float32: the same values as the
    int64 difference converted, also where float32 rounds them (past 2^24) and with a batch of 1
    broadcast against B."""
    from posenc_lightning.encodings.bias.windows import pair_distance

    g = torch.Generator().manual_seed(0)
    for hi in (100, 2**25, 2**40):
        q = torch.randint(-hi, hi, (3, 37), generator=g)
        k = torch.randint(-hi, hi, (3, 41), generator=g)
        for qq in (q, q[:1]):
            got = LinearBias(torch.ones(2), qq, k).head_scaled().pattern(qq, k)
            assert got.dtype == torch.float32
            assert torch.equal(got, pair_distance(qq, k).abs().to(torch.float32).neg_())


@pytest.mark.parametrize("scenario", ["arange", "offset", "packed"])
def test_head_scaled_tiles_equal_the_tiles_recomputed_by_rows(scenario, small_tiles, monkeypatch):
    """rse through the factored tiles (one product per tile, the slopes' gradient a reduction) and
    through the generic per-tile rows with their vjp: the same output and gradients (q, k, v, and
    the penalty slopes), on positions that are not arange and tiles that do not divide N."""
    from posenc_lightning.encodings.bias.structured import LinearBias as Linear
    from posenc_lightning.inject import inject
    from tests.conformance import ConfLayer, make_inputs, run_case, scenario_args

    x = make_inputs(2, 23, (4, 2, 8), torch.float32)
    args = scenario_args(scenario, 2, 23, 1)
    res = []
    for factored in (True, False):
        if not factored:
            monkeypatch.setattr(Linear, "head_scaled", lambda self: None)
        torch.manual_seed(0)
        m = ConfLayer(4, 8)
        inject(m, "rse", backend="blockwise", penalty_init=0.05)
        res.append(run_case(m, x, args, True))
    assert len(res[0]) == 6 and res[0][-1].abs().sum() > 0  # out, q, k, v, hidden, the slopes
    for a, b in zip(*res):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-6 * max(b.abs().max().item(), 1e-9), rtol=1e-5)


# ------------------------------------------------------------------------------ the tiles' formulas
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("n_q,n_k,diag,rows,cols", [(29, 29, -1, 4, 3), (29, 29, 0, 8, 3), (17, 40, 22, 6, 5),
                                                    (64, 64, -1, 16, 16), (9, 9, -1, 8, 256)])
def test_tiles_cover_every_visible_key_once_and_skip_only_blind_rows(n_q, n_k, diag, rows, cols, split):
    """Stick-breaking's tiling (keys nearest first, the nearest tile half a block wide when split):
    each block's tiles partition its keys, nearest first, and the rows a tile skips (`Tile.r0`)
    see none of its keys, so every visible (query, key) pair is computed exactly once."""
    from posenc_lightning.attention.backends.blockwise.tiles import Tiling

    tl = Tiling(AttentionMask(True, diag, n_q, n_k), n_q, n_k, diag, rows, cols, descending=True,
                split_diagonal=split)
    widths = set()
    for s, e, k_stop in tl.blocks():
        tiles = tl.tiles(s, k_stop, e)
        assert [(t.k1) for t in tiles] == [k_stop] + [t.k0 for t in tiles[:-1]] and tiles[-1].k0 == 0
        widths.add(tiles[0].k1 - tiles[0].k0)
        for t in tiles:
            for i in range(s, s + t.r0):
                assert t.k0 > i + diag  # a skipped row sees no key of the tile
            assert t.r0 == 0 or t.k0 <= s + t.r0 + diag  # the first row kept sees one
        assert len(tiles) <= tl.max_tiles()
    if split and rows // 2 < cols:
        assert rows // 2 in widths



def test_tile_backward_is_autograd_of_the_formula():
    """`stick_breaking_tile_backward` over a row split in two tiles (walked nearest first, the carried
    sum from `stick_breaking_tile`, hidden keys in both) against autograd of eq. 3 on the whole row
    (`stick_breaking_weights`, keys in index order); logits from -30 to 30, so softplus' threshold and
    its vanishing end are both crossed."""
    from posenc_lightning.functional.stick_breaking import (
        stick_breaking_tile,
        stick_breaking_tile_backward,
        stick_breaking_weights,
    )

    g = torch.Generator().manual_seed(0)
    z = torch.rand(3, 5, 14, generator=g) * 60 - 30  # walking order: key 0 is the nearest
    keep = (torch.rand(3, 5, 14, generator=g) > 0.3).float()
    dp = torch.randn(3, 5, 14, generator=g)
    zi = z.flip(-1).requires_grad_(True)  # index order
    a_ref = stick_breaking_weights(zi, keep.flip(-1).bool())
    (dz_ref,) = torch.autograd.grad((a_ref * dp.flip(-1)).sum(), zi)
    a_ref, dz_ref = a_ref.detach().flip(-1), dz_ref.flip(-1)

    zero = torch.zeros(3, 5)
    _, tail = stick_breaking_tile(z[..., :6], keep[..., :6], zero)
    a_far, dz_far, g_far = stick_breaking_tile_backward(z[..., 6:], keep[..., 6:], tail, dp[..., 6:].clone(), zero)
    a_near, dz_near, _ = stick_breaking_tile_backward(z[..., :6], keep[..., :6], zero, dp[..., :6].clone(), g_far)
    torch.testing.assert_close(g_far, (a_far * dp[..., 6:]).sum(-1), rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(torch.cat((a_near, a_far), -1), a_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.cat((dz_near, dz_far), -1), dz_ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("scenario", ["arange", "offset"])
@pytest.mark.parametrize("n,rows,keys", [(29, 4, 3), (203, 48, 40), (600, 256, 256), (600, 128, 512)])
def test_penalty_as_two_channels_equals_the_reference(scenario, n, rows, keys, monkeypatch):
    """rse's penalty as two extra q/k channels (`normalizers.FoldedBias`: plain causal, ascending
    positions, here far from 0 and per batch row) against the eager float64 reference and against
    the per-tile penalty, forward and backward; the slopes' gradient (taken per tile, not from the
    channels) head by head on its own scale, large and zero slopes. Tiles that do not divide N and
    the engine's tile sizes."""
    from posenc_lightning.attention.backends.blockwise import normalizers as _normalizers
    from posenc_lightning.inject import inject
    from tests.conformance import ConfLayer, make_inputs, run_case, scenario_args

    _tiles(monkeypatch, Tunables(block_rows=rows, block_keys=keys, min_bias_rows=min(rows, 16)))
    folds = []
    init = _normalizers.FoldedBias.__init__
    monkeypatch.setattr(_normalizers.FoldedBias, "__init__", lambda self, *a: folds.append(1) or init(self, *a))
    heads = (4, 2, 16)
    x = make_inputs(2, n, heads, torch.float32)
    args = scenario_args(scenario, 2, n, 1, offset=3000)

    def run(dtype, backend):
        torch.manual_seed(0)
        m = ConfLayer(4, 16)
        inject(m, "rse", backend=backend, penalty_init=0.3)
        with torch.no_grad():
            m.encoding.penalty.copy_(torch.tensor([0.02, 0.3, 1.5, 0.0]))
        return run_case(m.to(dtype), x.to(dtype), args, True)

    ref = run(torch.float64, "eager")
    got = run(torch.float32, "blockwise")
    assert len(folds) == 2  # forward and backward took the channels
    monkeypatch.setattr(blockwise, "_channels", lambda *a: None)
    tiled = run(torch.float32, "blockwise")
    assert len(folds) == 2
    for res in (got, tiled):
        conf._compare(res, ref, conf.TOL["fp32"], f"rse/{scenario}/{n}")
        # each head's slope on its own scale (its channels' sums would cancel to 1e-3 of a small one)
        torch.testing.assert_close(res[-1].double(), ref[-1], atol=1e-6 * ref[-1].abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize("head_dim", [8, 32])  # 10 key tiles a row: tails recomputed (> 8) and kept
@pytest.mark.parametrize("name", ["sba", "rse"])
def test_a_spent_stick_stops_the_walk(name, head_dim, small_tiles, monkeypatch):
    """Large logits spend the sticks within a few keys: the blocks stop walking there (forward and
    backward at the same tile), equal to the eager float64 reference and, within the skipped
    weights' size (< exp(-80) each), to walking every tile."""
    from posenc_lightning.attention.backends.blockwise import normalizers as _normalizers
    from posenc_lightning.inject import inject
    from tests.conformance import ConfLayer, make_inputs, run_case, scenario_args

    spent = []
    check = _normalizers.stick_spent
    monkeypatch.setattr(_normalizers, "stick_spent", lambda t: spent.append(bool(check(t))) or check(t))
    heads = (2, 2, head_dim)
    x = make_inputs(2, 29, heads, torch.float32)
    x.q, x.k = x.q * 3 + 2, x.k * 3 + 2  # logits of ~4 * head_dim / sqrt(head_dim) and more
    args = scenario_args("arange", 2, 29, 1)

    def run(dtype, backend):
        torch.manual_seed(0)
        m = ConfLayer(2, head_dim)
        inject(m, name, backend=backend)
        return run_case(m.to(dtype), x.to(dtype), args, True)

    ref = run(torch.float64, "eager")
    got = run(torch.float32, "blockwise")
    assert any(spent)
    _tiles(monkeypatch, replace(small_tiles, stop_spent=False))
    n = len(spent)
    every = run(torch.float32, "blockwise")
    assert len(spent) == n
    conf._compare(got, ref, conf.TOL["fp32"], f"{name}/spent")
    for a, b in zip(got, every):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-25 * max(b.abs().max().item(), 1.0), rtol=0)
