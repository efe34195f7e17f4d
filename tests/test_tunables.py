"""The backends' tunables live in one typed record (`functional.tunables.Tunables`), carried by the
call's `Mode`: no module of posenc_lightning/attention/ keeps a numeric or boolean tunable as a
module global, and a test passes a `Tunables` in instead of patching a module."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables
from tests.helpers import Attn

ATTENTION = Path(__file__).resolve().parents[1] / "posenc_lightning" / "attention"

#: module-level UPPER_CASE numbers and booleans that are not tunables, and why
ALLOWED = {
    "FUSES_ROTARY",  # a backend's declaration (the mixin reads it), not a size
    "MAX_HEAD_DIM",  # the Triton kernels' compiled limit
    "MIN_COMPILED_HEAD_DIM",  # inductor's tl.dot needs head_dim >= 16: a hardware limit of compiled flex
    "LOG2E",  # a mathematical constant
}


def _module_numbers(path: Path) -> list[str]:
    """Module-level UPPER_CASE names assigned a number or a boolean (a literal or a tuple of them)."""
    found = []
    for node in ast.parse(path.read_text()).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
        value = getattr(node, "value", None)
        names = [n.id for t in targets for n in (t.elts if isinstance(t, ast.Tuple) else [t])
                 if isinstance(n, ast.Name)]
        try:
            literal = ast.literal_eval(value) if value is not None else None
        except ValueError:
            continue
        flat = literal if isinstance(literal, tuple) else (literal,)
        if not all(isinstance(x, (int, float, bool)) for x in flat):
            continue
        found += [n for n in names if n.lstrip("_").isupper() and not n.startswith("_")]
    return found


def test_no_module_global_tunable_in_attention():
    left = {f"{p.relative_to(ATTENTION)}:{n}" for p in ATTENTION.rglob("*.py") for n in _module_numbers(p)
            if n not in ALLOWED}
    assert not left, f"move these into functional.tunables.Tunables: {sorted(left)}"


def test_no_test_patches_a_tunable():
    tests = Path(__file__).resolve().parent
    names = {f.name.upper() for f in Tunables.__dataclass_fields__.values()}
    hits = [f"{p.name}: {line.strip()}" for p in tests.glob("*.py") if p.name != Path(__file__).name
            for line in p.read_text().splitlines()
            if "monkeypatch.setattr" in line and any(f'"{n}"' in line for n in names)]
    assert not hits


def test_floats_round_trip_and_mode_carries_the_record():
    t = Tunables(bias_block_bytes=2**40 + 3, stop_spent=False, run_share=0.25)
    assert Tunables.from_floats(t.as_floats()) == t
    assert Mode.of(torch.zeros(1)).tunables is DEFAULT_TUNABLES
    assert Mode.of(torch.zeros(1), t).tunables is t


def test_the_module_declares_them_and_the_context_carries_them():
    m = Attn(n_heads=2, head_dim=8)
    pos = torch.arange(4)[None]
    assert AttentionContext(pos, pos, module=m).mode.tunables is DEFAULT_TUNABLES
    m.posenc_tunables = Tunables(bias_block_bytes=1)
    assert AttentionContext(pos, pos, module=m).mode.tunables is m.posenc_tunables


def test_a_budget_passed_in_reaches_sdpa_blocks():
    """The same biased attention in one block and in 16-row blocks, by a `Tunables` passed in."""
    from posenc_lightning.attention.backends import sdpa
    from posenc_lightning.encodings.bias import DenseBias

    n, rows = 40, []

    def at(s, e, ke):
        rows.append(e - s)
        return torch.linspace(-1, 1, n * n).view(1, 1, n, n)[..., s:e, :ke].expand(1, 2, -1, -1)

    q, k, v = (torch.randn(1, 2, n, 8) for _ in range(3))
    mask = AttentionMask(True, 0, n, n)
    outs = []
    for t in (None, Tunables(bias_block_bytes=1)):
        rows.clear()
        outs.append(sdpa.attend(q, k, v, bias=DenseBias.lazy(at, n, n), mask=mask, scale=0.3, tunables=t))
        assert rows == ([n] if t is None else [16, 16, 8])
    torch.testing.assert_close(outs[0], outs[1])
