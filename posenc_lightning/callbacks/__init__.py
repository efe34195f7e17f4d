from posenc_lightning.callbacks.posenc import PosEncCallback

__all__ = ["PosEncCallback"]
