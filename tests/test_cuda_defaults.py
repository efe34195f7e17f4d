"""``backend="auto"`` on CUDA takes only proven paths (issue 28): a custom kernel (triton, flex)
only for an encoding that a recorded GPU run validated (`proven_on_gpu.PROVEN`); otherwise PyTorch's
SDPA for rotary and bias encodings (a bias added by blocks of rows) and the pure-PyTorch blockwise
normalizers: the same choice as on CPU, where the suite proves it. Checked on CPU for a CUDA
device (``supports`` reads ``device.type`` only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posenc_lightning.attention.backends import get_backend, proven, resolve_backend
from posenc_lightning.encodings import proven_on_gpu
from posenc_lightning.encodings.registry import available_encodings, build_encoding

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]


def _bound(name: str):
    return build_encoding(name).bind(n_heads=2, head_dim=16, d_model=32)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_with_nothing_proven_auto_on_cuda_is_sdpa_or_blockwise_as_on_cpu(requires_grad, monkeypatch):
    monkeypatch.setattr(proven_on_gpu, "PROVEN", {})
    for name in available_encodings():
        enc = _bound(name)
        got = resolve_backend("auto", enc, CUDA, requires_grad).NAME
        want = "blockwise" if "normalize" in enc.stages else "sdpa"
        assert got == want, (name, got)
        assert resolve_backend("auto", enc, CPU, requires_grad).NAME == got, name


def test_a_proven_pair_is_taken_for_its_encoding_only(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(proven_on_gpu, "PROVEN", {("triton", "fire"): "r.md", ("flex", "alibi"): "r.md",
                                           ("triton", "rope"): "r.md"})
    picks = {n: resolve_backend("auto", _bound(n), CUDA, True).NAME for n in ("fire", "alibi", "rope", "fox", "yarn")}
    # rope: nothing to fuse, SDPA's flash kernels are faster on a GPU
    assert picks == {"fire": "triton", "alibi": "flex", "rope": "sdpa", "fox": "sdpa", "yarn": "sdpa"}
    assert resolve_backend("auto", _bound("fire"), CPU, True).NAME == "sdpa"  # CPU never reads the table


def test_a_windowed_layer_takes_a_custom_kernel_only_once_the_local_mask_is_proven(monkeypatch):
    """A pair proven without local masks (the recorded run's) does not carry over to a windowed or
    chunked layer: on CUDA ``auto`` leaves that layer to SDPA's rows until `proven.PROVEN_LOCAL` says a
    recorded run validated the kernel with that mask; an explicit ``backend="triton"`` still runs it."""
    pytest.importorskip("triton")
    monkeypatch.setattr(proven_on_gpu, "PROVEN", {("triton", "fire"): "r.md", ("triton", "alibi"): "r.md"})
    window, chunk = frozenset({"window"}), frozenset({"chunk"})
    assert resolve_backend("auto", _bound("fire"), CUDA, True).NAME == "triton"
    assert resolve_backend("auto", _bound("fire"), CUDA, True, window).NAME == "sdpa"
    assert resolve_backend("auto", _bound("alibi"), CUDA, True, chunk).NAME == "sdpa"
    monkeypatch.setattr(proven, "PROVEN_LOCAL", {"triton": window})
    assert resolve_backend("auto", _bound("fire"), CUDA, True, window).NAME == "triton"
    assert resolve_backend("auto", _bound("alibi"), CUDA, True, window | chunk).NAME == "sdpa"
    monkeypatch.setattr(proven, "PROVEN_LOCAL", {})
    assert resolve_backend("triton", _bound("fire"), CUDA, True, window).NAME == "triton"


def test_the_triton_kernels_stay_available_by_name_on_cuda(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(proven_on_gpu, "PROVEN", {})
    for name in ("rope", "alibi", "fire", "fox", "sba"):
        assert resolve_backend("triton", _bound(name), CUDA, True).NAME == "triton"
    assert resolve_backend("flex", _bound("alibi"), CUDA, True).NAME == "flex"


def test_every_proven_entry_names_a_recorded_run_and_a_real_pair():
    for (backend, name), entry in proven_on_gpu.PROVEN.items():
        # a path that needs no proof has an entry only to carry its time
        assert backend in proven.CUSTOM_KERNELS or proven_on_gpu.ms_of(entry) is not None, backend
        assert name in available_encodings(), name
        assert get_backend(backend).supports(_bound(name), CUDA, True) is None, (backend, name)
        ms = proven_on_gpu.ms_of(entry)
        assert ms is None or ms > 0, (backend, name, ms)
        page = proven_on_gpu.record_of(entry).split()[0]
        assert (ROOT / page).is_file(), f"{backend}/{name}: its record {page} is not in the repository"


def test_compiled_flex_refuses_a_head_dim_its_gpu_kernels_cannot_take():
    small = build_encoding("alibi").bind(n_heads=2, head_dim=8, d_model=16)
    why = get_backend("flex").supports(small, CUDA, True)
    assert why is not None and "head_dim >= 16" in why and "sdpa" in why
    assert get_backend("flex").supports(small, CPU, False) is None  # CPU flex runs eagerly
    assert get_backend("flex").supports(_bound("alibi"), CUDA, True) is None


def test_compiled_flex_refuses_a_small_head_dim_it_was_not_told_of_before_compiling():
    """An embedding-only encoding binds no head_dim, so `supports` cannot refuse; the call itself
    does, before inductor would fail on it (a device other than the CPU: meta tensors here)."""
    from posenc_lightning.attention.mask import AttentionMask

    q = torch.empty(1, 2, 13, 8, device="meta")
    with pytest.raises(ValueError, match=r"head_dim >= 16.*got head_dim 8; use backend=.sdpa."):
        get_backend("flex").attend(q, q, q, bias=None, mask=AttentionMask(True, 0, 13, 13), scale=8 ** -0.5)


def _picks(table, names=("fire", "alibi", "rope", "fox", "sba")):
    return {n: resolve_backend("auto", _bound(n), CUDA, True, table=table).NAME for n in names}


def test_entries_without_times_keep_the_fixed_order_in_either_form():
    pytest.importorskip("triton")
    pairs = [("triton", "fire"), ("flex", "alibi"), ("triton", "rope"), ("sdpa", "fox")]
    bare = {p: "r.md" for p in pairs}
    untimed = {p: proven_on_gpu.Proven("r.md") for p in pairs}
    want = {"fire": "triton", "alibi": "flex", "rope": "sdpa", "fox": "sdpa", "sba": "blockwise"}
    assert _picks(bare) == _picks(untimed) == want


def test_auto_takes_the_fastest_recorded_path():
    pytest.importorskip("triton")
    timed = proven_on_gpu.Proven
    table = {("triton", "alibi"): timed("r.md", 3.0), ("flex", "alibi"): timed("r.md", 2.5),
             ("sdpa", "alibi"): timed("r.md", 2.0),
             ("triton", "fire"): timed("r.md", 1.0), ("sdpa", "fire"): timed("r.md", 9.0),
             # rope has nothing to fuse, but a run measured the kernel faster: the time wins
             ("triton", "rope"): timed("r.md", 1.5), ("sdpa", "rope"): timed("r.md", 1.6),
             # flex cannot run a normalizer: the next fastest with a time
             ("flex", "sba"): timed("r.md", 0.1), ("triton", "sba"): timed("r.md", 5.0),
             ("blockwise", "sba"): timed("r.md", 7.0)}
    assert _picks(table) == {"fire": "triton", "alibi": "sdpa", "rope": "triton", "fox": "sdpa", "sba": "triton"}
    # one time compares with nothing: the fixed order (the proven kernel first)
    one = {("triton", "fire"): timed("r.md", 50.0), ("flex", "alibi"): "r.md", ("sdpa", "alibi"): timed("r.md", 1.0)}
    assert _picks(one, ("fire", "alibi")) == {"fire": "triton", "alibi": "flex"}
    assert resolve_backend("auto", _bound("alibi"), CPU, True, table=table).NAME == "sdpa"  # CPU reads no times


def test_fastest_first_sorts_by_time_and_keeps_the_order_on_ties():
    timed = proven_on_gpu.Proven
    enc = _bound("alibi")
    order = ("triton", "flex", "sdpa")
    table = {("sdpa", "alibi"): timed("r", 1.0), ("flex", "alibi"): timed("r", 1.0), ("triton", "alibi"): timed("r", 4.0),
             ("sdpa", "rope"): timed("r", 0.5)}
    assert proven.fastest_first(order, enc, table) == ["flex", "sdpa", "triton"]
    assert proven.fastest_first(order, enc, {("sdpa", "alibi"): timed("r", 1.0)}) == []
    assert enc.gpu_record("sdpa", table) == "r" and enc.gpu_ms("triton", table) == 4.0
    assert enc.gpu_ms("triton", {("triton", "alibi"): "r"}) is None
