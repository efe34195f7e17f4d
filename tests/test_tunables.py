"""The backends' tunables live in one typed record (`functional.tunables.Tunables`), carried by the
call's `Mode`: no module of posenc_lightning/attention/ nor of the encodings with fast paths of their
own (encodings/fire/, encodings/cope/) keeps a numeric or boolean tunable as a module global or a
class attribute, and a test passes a `Tunables` in instead of patching a module or a class."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from posenc_lightning.attention.mask import AttentionMask
from posenc_lightning.encodings.base import AttentionContext
from posenc_lightning.functional.mode import Mode
from posenc_lightning.functional.tunables import DEFAULT_TUNABLES, Tunables
from tests.helpers import Attn

PACKAGE = Path(__file__).resolve().parents[1] / "posenc_lightning"
ATTENTION = PACKAGE / "attention"
#: the parts whose modules may keep no tunable of their own
CHECKED = [ATTENTION, PACKAGE / "encodings" / "fire", PACKAGE / "encodings" / "cope"]
#: the module globals and class attributes that were tunables, now `Tunables` fields (issue 46): no
#: module defines them again and no test patches them
RETIRED = {"FIRE_COLUMN_GROUP": "fire_column_group", "FIRE_SPAN_SLACK": "fire_span_slack",
           "FIRE_MLP_CHUNK": "fire_mlp_chunk", "CHUNK_BYTES": "cope_chunk_bytes",
           "GRAD_CHUNK_BYTES": "cope_grad_chunk_bytes"}

#: module-level UPPER_CASE numbers and booleans that are not tunables, and why
ALLOWED = {
    "FUSES_ROTARY",  # a backend's declaration (the mixin reads it), not a size
    "MAX_HEAD_DIM",  # the Triton kernels' compiled limit
    "MIN_COMPILED_HEAD_DIM",  # inductor's tl.dot needs head_dim >= 16: a hardware limit of compiled flex
    "LOG2E",  # a mathematical constant
    "EXAMPLE_WIDTH",  # FIRE's tile: the MLP width of the compiler report's example tile, not a run's
    "BACKWARD_SHARE",  # CoPE: the bias's declared share of a backward block (`Bias.backward_share`)
}


def _module_numbers(path: Path) -> list[str]:
    """Module-level and class-level UPPER_CASE names assigned a number or a boolean (a literal, an
    arithmetic of literals such as ``4 * 2**20``, or a tuple of them)."""
    found = []
    body = ast.parse(path.read_text()).body
    for node in body + [n for c in body if isinstance(c, ast.ClassDef) for n in c.body]:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else [])
        value = getattr(node, "value", None)
        names = [n.id for t in targets for n in (t.elts if isinstance(t, ast.Tuple) else [t])
                 if isinstance(n, ast.Name)]
        try:
            literal = _constant(value) if value is not None else None
        except ValueError:
            continue
        flat = literal if isinstance(literal, tuple) else (literal,)
        if not all(isinstance(x, (int, float, bool)) for x in flat):
            continue
        found += [n for n in names if n.lstrip("_").isupper() and not n.startswith("_")]
    return found


def _constant(node: ast.expr) -> object:
    """The value of a literal, or of ``+ - * / // **`` over literals; ValueError otherwise."""
    if isinstance(node, ast.BinOp):
        a, b = _constant(node.left), _constant(node.right)
        ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b, ast.Div: lambda: a / b,
               ast.FloorDiv: lambda: a // b, ast.Pow: lambda: a ** b}
        if type(node.op) not in ops or not all(isinstance(x, (int, float)) for x in (a, b)):
            raise ValueError("not arithmetic")
        return ops[type(node.op)]()
    return ast.literal_eval(node)


def test_the_scan_sees_a_tunable(tmp_path):
    """The check below fails on what it looks for: a module global and a class attribute."""
    f = tmp_path / "m.py"
    f.write_text("A_B = 4 * 2**20\nNAME = 'x'\nclass C:\n    CHUNK = 16\n    BACKWARD_SHARE = 0.75\n")
    assert _module_numbers(f) == ["A_B", "CHUNK", "BACKWARD_SHARE"]


def test_no_module_global_tunable_in_attention_or_fast_encodings():
    left = {f"{p.relative_to(PACKAGE)}:{n}" for part in CHECKED for p in part.rglob("*.py") for n in _module_numbers(p)
            if n not in ALLOWED}
    assert not left, f"move these into functional.tunables.Tunables: {sorted(left)}"
    fields = Tunables.__dataclass_fields__
    assert all(f in fields for f in RETIRED.values())
    again = {f"{p.relative_to(PACKAGE)}:{n}" for p in PACKAGE.rglob("*.py") for n in _module_numbers(p) if n in RETIRED}
    assert not again, f"read these from the call's Mode.tunables: {sorted(again)}"


def test_no_test_patches_a_tunable():
    tests = Path(__file__).resolve().parent
    names = {f.name.upper() for f in Tunables.__dataclass_fields__.values()} | set(RETIRED)
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
