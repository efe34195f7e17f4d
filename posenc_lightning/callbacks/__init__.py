from posenc_lightning.callbacks.context_parallel import ContextParallel
from posenc_lightning.callbacks.length_eval import LengthEvalCallback
from posenc_lightning.callbacks.lm_eval import LMEvalCallback
from posenc_lightning.callbacks.posenc import PosEncCallback
from posenc_lightning.callbacks.task_eval import TaskEvalCallback
from posenc_lightning.callbacks.visualize import PosEncVisualizer
from posenc_lightning.curriculum.context import ContextCurriculum, Stage

__all__ = ["ContextCurriculum", "ContextParallel", "LMEvalCallback", "LengthEvalCallback", "PosEncCallback",
           "PosEncVisualizer", "Stage", "TaskEvalCallback"]
