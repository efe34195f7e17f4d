"""Context-length curricula: `ContextCurriculum` (`curriculum.context`), the CLEX and LongRoPE presets,
and LongRoPE's factor search."""

from posenc_lightning.curriculum.clex import CLEXCurriculum
from posenc_lightning.curriculum.context import ContextCurriculum, Stage
from posenc_lightning.curriculum.longrope import N_HAT_CANDIDATES, LongRoPECurriculum
from posenc_lightning.curriculum.search import EvolutionarySearch, SearchResult, law_factors, windows_nll

__all__ = ["N_HAT_CANDIDATES", "CLEXCurriculum", "ContextCurriculum", "EvolutionarySearch", "LongRoPECurriculum",
           "SearchResult", "Stage", "law_factors", "windows_nll"]
