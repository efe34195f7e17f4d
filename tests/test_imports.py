"""``import posenc_lightning`` stays light: heavy optional packages load only where used."""

import subprocess
import sys


def test_import_does_not_pull_heavy_optional_packages():
    code = ("import sys, posenc_lightning, posenc_lightning.encodings; "
            "print(sorted(m for m in ('lightning', 'triton', 'lm_eval', 'matplotlib', 'tensorboard', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_callbacks_are_still_importable_from_the_top_level():
    from posenc_lightning import ContextCurriculum, LengthEvalCallback, LMEvalCallback, PosEncCallback, PosEncVisualizer

    assert all(callable(c) for c in (ContextCurriculum, LMEvalCallback, LengthEvalCallback, PosEncCallback,
                                     PosEncVisualizer))
