"""Loads remote-code exports where posenc_lightning cannot be imported (run by
tests/test_hf_remote_code.py in a fresh process, a failing ``posenc_lightning`` first on the path).

argv: a JSON file ``{"dirs": [...], "out": path}``; each directory holds ``inputs.pt`` (``ids``,
``position_ids``, ``prompt``, ``new``). Writes ``{dir: {...}}`` of logits and generations (torch.save)."""

from __future__ import annotations

import json
import sys
import warnings

import torch

warnings.filterwarnings("ignore")


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    try:
        import posenc_lightning  # noqa: F401
        blocked = False
    except ImportError:
        blocked = True
    from transformers import AutoModelForCausalLM

    results = {"posenc_blocked": blocked}
    for d in job["dirs"]:
        inp = torch.load(f"{d}/inputs.pt")
        model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True, local_files_only=True).eval()
        ids, prompt, new = inp["ids"], inp["prompt"], inp["new"]
        with torch.no_grad():
            logits = model(ids).logits
            shifted = model(ids, position_ids=inp["position_ids"]).logits
        gen = model.generate(ids[:, :prompt], attention_mask=torch.ones_like(ids[:, :prompt]), max_new_tokens=new,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        with torch.no_grad():
            full = model(gen.sequences).logits
        results[d] = {"class": type(model).__module__, "logits": logits, "shifted": shifted,
                      "sequences": gen.sequences, "step_logits": torch.stack(gen.logits, 1), "full": full}
    torch.save(results, job["out"])


if __name__ == "__main__":
    main()
