"""Small modules shared by tests."""

import torch
from torch import nn

from posenc_lightning import PosEncAttentionMixin


class Attn(nn.Module, PosEncAttentionMixin):
    """A bare attention layer (q, k, v given) to test the mixin and backends."""

    def __init__(self, n_heads=4, head_dim=16, d_model=None):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.d_model = d_model or n_heads * head_dim

    def forward(self, q, k, v, **kw):
        return self.attend(q, k, v, **kw)


#: every preset (`posenc_lightning.encodings.presets`) at a test model's size: windows and chunks
#: shorter than the test sequences, the global layer every 2nd so that a 2-layer model has both kinds,
#: Llama 4's temperature stepping every 4 positions (it is 1 below ``floor_scale - 1``)
PRESET_CASES: dict[str, dict] = {
    "rnope_swa": {"window": 8, "interval": 2},
    "irope": {"chunk": 8, "interval": 2, "floor_scale": 4.0},
    "smollm3_nope": {"interval": 2},
    "gemma3_local_global": {"window": 8, "interval": 2},
    "p_rope": {},
}


def qkv(b=2, h=4, n=11, d=16, hkv=None, dtype=torch.float32, grad=False):
    t = [torch.randn(b, hh, n, d, dtype=dtype, requires_grad=grad) for hh in (h, hkv or h, hkv or h)]
    return t


def compiled_greedy(model, prompt: torch.Tensor, steps: int, backend: str = "aot_eager") -> torch.Tensor:
    """Greedy decoding with the model's cache through ``torch.compile(model, fullgraph=True)``, one
    token per call (compare with the eager ``model.generate(prompt, steps)``)."""
    cm = torch.compile(model, fullgraph=True, backend=backend)
    cache = model.new_cache()
    out, step = prompt, prompt
    with torch.no_grad():
        for _ in range(steps):
            nxt = cm(step, None, cache)[:, -1].argmax(-1, keepdim=True)
            out, step = torch.cat((out, nxt), 1), nxt
    return out


def fast_triton_interpreter(monkeypatch) -> None:
    """Make TRITON_INTERPRET=1 fast for tests: no overflow sanitizer, 16 x 16 tiles (a no-op
    without triton)."""
    try:
        import triton.runtime.interpreter as ti
    except ImportError:
        return
    from posenc_lightning.kernels import fused

    monkeypatch.setattr(ti.interpreter_builder, "options", ti.InterpreterOptions(sanitize_overflow=False))
    monkeypatch.setattr(fused, "INTERPRET_BLOCKS", (16, 16))


def run_posenc(*args: str) -> tuple[int, str]:
    """``posenc ARGS`` in this process: (exit code, what it printed)."""
    import contextlib
    import io

    from posenc_lightning.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code or 0
    return code, buf.getvalue()


def recipe_module(name: str):
    """The recipe script ``recipes/<name>.py`` imported as a module (the scripts are not a package)."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
