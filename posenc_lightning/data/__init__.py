from posenc_lightning.data.corpus import load_corpus, stdlib_files
from posenc_lightning.data.datamodule import CorpusDataModule

__all__ = ["CorpusDataModule", "load_corpus", "stdlib_files"]
