from posenc_lightning.callbacks.curriculum import ContextCurriculum, Stage
from posenc_lightning.callbacks.posenc import PosEncCallback

__all__ = ["ContextCurriculum", "Stage", "PosEncCallback"]
