"""`PosEncVisualizer`: TensorBoard images of what the encoding does."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from posenc_lightning.encodings.base import Bias


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        return None


def attention_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    from posenc_lightning.attention.mixin import PosEncAttentionMixin

    return [m for m in module.modules() if isinstance(m, PosEncAttentionMixin)]


def injected_encodings(module: torch.nn.Module) -> list[Any]:
    """The distinct encodings held by the module's mixin modules (attention and embedding)."""
    from posenc_lightning.attention.mixin import PosEncAttentionMixin, PosEncEmbeddingMixin

    seen: dict[int, Any] = {}
    for m in module.modules():
        if isinstance(m, (PosEncAttentionMixin, PosEncEmbeddingMixin)) and m.encoding is not None:
            seen.setdefault(id(m.encoding), m.encoding)
    return list(seen.values())


@contextlib.contextmanager
def capture_attention(mods: Sequence[torch.nn.Module]) -> Iterator[dict[int, dict[str, Any]]]:
    """Records the first ``attend`` call's inputs of each module (by index) during the block."""
    got: dict[int, dict[str, Any]] = {}
    originals = []
    for i, m in enumerate(mods):
        orig = m.attend

        def attend(q, k, v, *args, _i=i, _orig=orig, **kw):
            names = ("positions", "causal", "hidden", "cache", "segment_ids", "key_padding_mask")
            kw = {**dict(zip(names, args)), **kw}
            if _i not in got and kw.get("cache") is None:
                got[_i] = {"q": q.detach(), "k": k.detach(), "positions": kw.get("positions"),
                           "causal": kw.get("causal", True), "hidden": kw.get("hidden")}
            return _orig(q, k, v, **kw)

        m.attend = attend
        originals.append(m)
    try:
        yield got
    finally:
        for m in originals:
            del m.attend  # back to the class method


def encoded_attention(module: torch.nn.Module, rec: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    """``(weights [B, H, N, N], bias [B|1, H, N, N] or None)`` of one captured call, computed with
    the eager reference (`attention_weights`) and the module's encoding."""
    from posenc_lightning.attention.backends import eager
    from posenc_lightning.attention.mask import AttentionMask
    from posenc_lightning.attention.mixin import NO_ENCODING, default_positions
    from posenc_lightning.attention.pipeline import context, run_stages

    enc = module.encoding or NO_ENCODING
    q, k = rec["q"], rec["k"]
    b, _, n, _ = q.shape
    pos = rec["positions"] if rec["positions"] is not None else default_positions(b, n, 0, q.device)
    ctx = context(enc, eager, pos, pos, causal=rec["causal"], hidden=rec["hidden"], module=module)
    mask = AttentionMask(rec["causal"], 0, n, k.shape[-2], None, None, None)
    seen: dict[str, Bias | None] = {}

    def weights(q: Tensor, k: Tensor, v: Tensor, *, bias: Bias | None, **kw: Any) -> Tensor:
        seen["bias"] = bias
        return eager.attention_weights(q, k, bias=bias, **kw)

    w = run_stages(enc, eager, q, k, k, ctx, mask, enc.softmax_scale(q.shape[-1]), attend=weights)
    bias = seen["bias"]
    return w, (bias.materialize() if bias is not None else None)


class PosEncVisualizer(pl.Callback):
    """At validation end (rank 0, TensorBoard): attention maps of chosen layers/heads at the
    training length and beyond, bias vs distance (alibi, T5, fire, fox, cope), rotary frequency
    spectra and per-dimension scale factors (any `RotaryEncoding`: yarn, long_rope, ...), and
    histograms of the encoding's learnable parameters.

    Args:
        layers: attention layers to show (default: first and last).
        heads: heads to show.
        lengths: input lengths (default: 1x and 2x ``base_len``).
        base_len: the training length (default: the datamodule's ``val_seq_len``/``seq_len``).
        every_n_epochs: run at validation ends of every n-th epoch.
        max_image_len: attention maps are cropped to the last this-many queries/keys.
    """

    def __init__(self, layers: Sequence[int] | None = None, heads: Sequence[int] = (0,),
                 lengths: Sequence[int] | None = None, base_len: int | None = None, every_n_epochs: int = 1,
                 max_image_len: int = 256) -> None:
        self.layers = list(layers) if layers is not None else None
        self.heads = list(heads)
        self.lengths = list(lengths) if lengths else None
        self.base_len = base_len
        self.every_n_epochs = every_n_epochs
        self.max_image_len = max_image_len
        self.logged: list[str] = []  # tags written at the last call (for tests and reports)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.current_epoch % self.every_n_epochs or not trainer.is_global_zero:
            return
        exp = next((lg.experiment for lg in trainer.loggers if hasattr(getattr(lg, "experiment", None), "add_image")),
                   None)
        if exp is None:
            return
        self.visualize(pl_module, exp, trainer.global_step, trainer)

    def _lengths(self, trainer: pl.Trainer | None, pl_module: pl.LightningModule) -> list[int]:
        if self.lengths:
            return self.lengths
        from posenc_lightning.callbacks.length_eval import base_length

        base = base_length(self.base_len, trainer)
        base = base or getattr(getattr(pl_module, "hparams", {}), "get", lambda *_: None)("max_seq_len") or 128
        return [int(base), 2 * int(base)]

    def _tokens(self, trainer: pl.Trainer | None, n: int, device: torch.device) -> Tensor:
        dm = getattr(trainer, "datamodule", None) if trainer is not None else None
        val = getattr(dm, "val_tokens", None)
        if val is not None and len(val) > n:
            return val[:n].long()[None].to(device)
        g = torch.Generator().manual_seed(0)  # no datamodule text: a fixed pseudo-random input
        return torch.randint(0, 256, (1, n), generator=g).to(device)

    @torch.no_grad()
    def visualize(self, pl_module: pl.LightningModule, exp: Any, step: int, trainer: pl.Trainer | None = None) -> list[str]:
        """Write every view now (the callback calls this at validation ends).

        Args:
            pl_module: the model.
            exp: a TensorBoard ``SummaryWriter``.
            step: the global step the images are logged at.
            trainer: the trainer; None outside one.

        Returns:
            The tags written.
        """
        self.logged = []
        mods = attention_modules(pl_module)
        if not mods:
            return self.logged
        layers = self.layers if self.layers is not None else sorted({0, len(mods) - 1})
        enc = mods[0].encoding
        was_training = pl_module.training
        pl_module.eval()
        try:
            for n in self._lengths(trainer, pl_module):
                x = self._tokens(trainer, n, pl_module.device)
                with capture_attention([mods[i] for i in layers]) as got:
                    try:
                        pl_module(x)
                    except ValueError as e:  # e.g. a learned table shorter than n
                        self._text(exp, f"posenc/attention/N{n}", f"cannot run at length {n}: {e}", step)
                        continue
                for j, li in enumerate(layers):
                    if j not in got:
                        continue
                    w, bias = encoded_attention(mods[li], got[j])
                    for h in self.heads:
                        if h < w.shape[1]:
                            self._image(exp, f"posenc/attention/layer{li}_head{h}_N{n}", w[0, h], step)
                    if bias is not None and j == 0:
                        self._bias_plot(exp, f"posenc/bias_vs_distance/N{n}", bias, step)
        finally:
            pl_module.train(was_training)
        if enc is not None:
            self._rotary(exp, enc, self._lengths(trainer, pl_module), step)
        for k, e in enumerate(injected_encodings(pl_module)):
            for name, p in e.named_parameters():
                tag = f"posenc/params/{name}" if k == 0 else f"posenc/params/{k}/{name}"
                exp.add_histogram(tag, p.detach().float().cpu(), step)
                self.logged.append(tag)
        return self.logged

    # ------------------------------------------------------------ writers
    def _text(self, exp: Any, tag: str, text: str, step: int) -> None:
        exp.add_text(tag, text, global_step=step)
        self.logged.append(tag)

    def _image(self, exp: Any, tag: str, w: Tensor, step: int) -> None:
        m = self.max_image_len
        img = w[-m:, -m:].float().cpu()
        img = img.clamp_min(0).sqrt()  # sqrt: small weights stay visible
        img = img / img.amax(dim=-1, keepdim=True).clamp_min(1e-12)  # each query row scaled to its max
        exp.add_image(tag, img[None], step, dataformats="CHW")
        self.logged.append(tag)

    def _bias_plot(self, exp: Any, tag: str, bias: Tensor, step: int) -> None:
        """The last query's bias against the distance to each earlier key, per head."""
        plt = _plt()
        row = bias[0, :, -1, :].float().cpu()  # [H, Nk]
        dist = torch.arange(row.shape[-1] - 1, -1, -1)
        if plt is None:
            return
        fig, ax = plt.subplots(figsize=(5.6, 3.6))
        for h in range(row.shape[0]):
            ax.plot(dist.numpy(), row[h].numpy(), lw=1, label=f"head {h}")
        ax.set_xlabel("distance i - j")
        ax.set_ylabel("bias added to the logit")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        exp.add_figure(tag, fig, step)
        self.logged.append(tag)

    def _rotary(self, exp: Any, enc: Any, lengths: Sequence[int], step: int) -> None:
        from posenc_lightning.encodings.rope import RotaryEncoding

        plt = _plt()
        if not isinstance(enc, RotaryEncoding) or plt is None:
            return
        base = enc.base_inv_freq().float().cpu()
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
        a1.plot((2 * math.pi / base).numpy(), "k--", label="base")
        for n in sorted(set(lengths) | {4 * max(lengths)}):
            inv, _ = enc.frequencies(n, None)
            inv = inv.detach().float().cpu()
            inv = inv.mean(0) if inv.dim() == 2 else inv  # per-head frequencies: their mean
            a1.plot((2 * math.pi / inv).numpy(), label=f"N={n}")
            a2.plot((base / inv).numpy(), label=f"N={n}")
        a1.set_yscale("log")
        a1.set_xlabel("rotary pair i")
        a1.set_ylabel("wavelength 2*pi/theta_i")
        a2.set_xlabel("rotary pair i")
        a2.set_ylabel("scale factor base/theta_i")
        a1.legend(fontsize=6)
        a2.legend(fontsize=6)
        fig.tight_layout()
        exp.add_figure("posenc/rotary_spectrum", fig, step)
        self.logged.append("posenc/rotary_spectrum")
