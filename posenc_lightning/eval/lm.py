"""`LightningLM`: any LightningModule (input_ids -> logits) as an lm-eval `TemplateLM`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    from lm_eval.api.model import TemplateLM
except ImportError as e:  # pragma: no cover - the eval extra installs it
    raise ImportError("posenc_lightning.eval needs lm-eval: pip install 'posenc-lightning[eval]'") from e


class StrategyDistributed:
    """lm-eval's distributed hooks through a Lightning ``strategy`` (``self.strategy``; None = one
    process): each rank evaluates its shard of the requests, rank 0 gathers."""

    strategy: Any = None

    @property
    def rank(self) -> int:
        return self.strategy.global_rank if self.strategy is not None else 0

    @property
    def world_size(self) -> int:
        return self.strategy.world_size if self.strategy is not None else 1

    def all_gather(self, tensor: Tensor) -> Tensor:
        if self.world_size == 1:
            return tensor
        out = self.strategy.all_gather(tensor)  # [W, *shape]
        return out if tensor.dim() == 0 else out.reshape(-1, *tensor.shape[1:])

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out if self.rank == dst else None

    def barrier(self) -> None:
        if self.world_size > 1:
            self.strategy.barrier("posenc_lm_eval")


class LightningLM(StrategyDistributed, TemplateLM):
    """Wraps a module whose ``forward(input_ids [1, N])`` returns logits ``[1, N, V]``.

    Greedy ``generate_until`` reuses the module's KV cache when it has ``new_cache()`` and its
    forward takes ``cache=`` (TinyGPT does). Rank, world size, gathers and barriers go through
    the Lightning ``strategy`` so that each rank evaluates its shard of the requests.

    Args:
        module: the model (put in eval mode by the caller or by `LMEvalCallback`).
        tokenizer: a Hugging Face tokenizer or a directory; default the offline byte tokenizer.
        strategy: the trainer's strategy (None = one process).
        max_length: left-truncate contexts to this many tokens (None = never truncate).
        max_gen_toks: default generation budget when a task gives none.
        use_cache: decode with the KV cache when the module has one.
    """

    def __init__(self, module: torch.nn.Module, tokenizer: Any = None, strategy: Any = None,
                 max_length: int | None = None, max_gen_toks: int = 256, use_cache: bool = True) -> None:
        super().__init__()
        from posenc_lightning.eval.tokenizer import load_byte_tokenizer

        if tokenizer is None or isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = (load_byte_tokenizer() if tokenizer is None
                         else AutoTokenizer.from_pretrained(tokenizer, local_files_only=True))
        self.module = module
        self.tokenizer = tokenizer
        self.strategy = strategy
        self.max_length = max_length
        self.max_gen_toks = max_gen_toks
        self.use_cache = use_cache and hasattr(module, "new_cache")

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    # ------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "byte")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    # ------------------------------------------------------------ model
    def _logits(self, ids: list[int] | Tensor, cache: Any = None) -> Tensor:
        x = ids if isinstance(ids, Tensor) else torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.module(x) if cache is None else self.module(x, cache=cache)
        return getattr(out, "logits", out)

    def _truncate(self, ids: list[int], keep: int = 0) -> list[int]:
        if self.max_length is None:
            return ids
        return ids[-(self.max_length - keep):]

    @torch.no_grad()
    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Sum of ``log p(continuation | context)`` and whether greedy decoding gives it."""
        whole = self._truncate(context + continuation, keep=-1)
        logits = self._logits(whole[:-1])[0, -len(continuation):].float()
        logp = F.log_softmax(logits, dim=-1)
        target = torch.tensor(continuation, device=logp.device)
        ll = logp.gather(-1, target[:, None]).sum().item()
        return ll, bool((logp.argmax(-1) == target).all())

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        out = []
        for key, ctx, cont in requests:
            res = self._score(ctx, cont)
            if getattr(self, "cache_hook", None) is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
            out.append(res)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """``log p(text)`` with the end-of-text token as the only context (one window, or disjoint
        windows of ``max_length`` when set)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for (string,) in [r.args for r in requests]:
            tokens = self.tok_encode(string)
            if self.max_length is None:
                windows = [([self.eot_token_id], tokens)]
            else:
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.eot_token_id, max_seq_len=self.max_length, context_len=1)]
            ll = 0.0
            for ctx, cont in windows:
                ll += self._score(ctx, cont)[0]
            out.append(ll)
        return out

    @torch.no_grad()
    def greedy(self, ids: list[int], max_new_tokens: int, until: list[str] | None = None,
               use_cache: bool | None = None) -> list[int]:
        """Greedy continuation token ids; stops at end-of-text or when a stop string appears."""
        use_cache = self.use_cache if use_cache is None else use_cache
        until = until or []
        ids = self._truncate(ids, keep=max_new_tokens)
        new: list[int] = []
        cache = self.module.new_cache() if use_cache else None
        step = ids
        for _ in range(max_new_tokens):
            logits = self._logits(step, cache) if use_cache else self._logits(ids + new)
            nxt = int(logits[0, -1].argmax())
            if nxt == self.eot_token_id:
                break
            new.append(nxt)
            step = [nxt]
            if until and any(s in self.tok_decode(new) for s in until):
                break
        return new

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, kw = req.args
            kw = dict(kw or {})
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            if kw.get("do_sample"):
                raise ValueError("LightningLM decodes greedily; set do_sample: false in the task's generation_kwargs")
            budget = int(kw.get("max_gen_toks", self.max_gen_toks))
            text = self.tok_decode(self.greedy(self.tok_encode(context), budget, until))
            for s in until:
                text = text.split(s)[0]
            if getattr(self, "cache_hook", None) is not None:
                self.cache_hook.add_partial("generate_until", (context, kw), text)
            out.append(text)
        return out
