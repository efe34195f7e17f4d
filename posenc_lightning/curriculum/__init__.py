"""Curriculum presets and LongRoPE's factor search (the core is `posenc_lightning.callbacks.curriculum`)."""

from posenc_lightning.callbacks.curriculum import ContextCurriculum, Stage
from posenc_lightning.curriculum.clex import CLEXCurriculum
from posenc_lightning.curriculum.longrope import N_HAT_CANDIDATES, LongRoPECurriculum
from posenc_lightning.curriculum.search import EvolutionarySearch, SearchResult, law_factors, windows_nll

__all__ = ["N_HAT_CANDIDATES", "CLEXCurriculum", "ContextCurriculum", "EvolutionarySearch", "LongRoPECurriculum",
           "SearchResult", "Stage", "law_factors", "windows_nll"]
