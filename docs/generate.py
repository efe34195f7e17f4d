"""Generate the documentation pages that are derived from code or recorded results.

    python docs/generate.py            # rewrite docs/reference/encodings.md, docs/performance.md, docs/assets/
    python docs/generate.py --check    # exit 1 if either differs from what the code and results give

The encodings catalogue comes from the registry (names, papers, stages, ``__init__`` signatures,
class capabilities, what each backend accepts); the performance page from the newest recorded file of
each benchmark under ``benchmarks/results/``. ``tests/test_docs.py`` regenerates both and compares.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CATALOGUE = ROOT / "docs" / "reference" / "encodings.md"
PERFORMANCE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "benchmarks" / "results"

#: sizes the catalogue binds each encoding to, to count parameters and ask the backends
HEADS, HEAD_DIM = 4, 16

#: where the default departs from the paper's main setting, or what the default is when the paper
#: gives none. Keyed by registered name; encodings with learnable parameters also get the sharing note.
DEPARTURES: dict[str, str] = {
    "fire": "The paper's main FIRE has one MLP per layer; the default here is one shared by all layers, "
            "the paper's FIRE-S variant. Per layer: `PosEncCallback(\"fire\", share_across_layers=False)`.",
    "fox": "The paper learns forget gates in every layer; the default shares one gate projection across "
           "layers. Per layer: `share_across_layers=False`.",
    "cope": "The paper has a CoPE module in each attention layer; the default shares one across layers. "
            "Per layer: `share_across_layers=False`.",
    "relative_bias": "T5 computes the bias in the first layer and shares it across layers, as the default does.",
    "exposb": "No single paper: the defaults are this project's constants.",
    "mixture": "No single paper: a learned mixture of member encodings' biases (dynamic positional encoding).",
    "rse": "No single paper: RoPE plus stick-breaking with a learned distance penalty.",
    "dynamic_ntk": "Follows transformers' `dynamic` rope type; no paper.",
    "llama3": "Llama 3.1 uses `factor=8`; the default here is 4 (bands 1 and 4 as in Llama 3.1).",
    "yarn": "The default `factor` is 4; the paper extends Llama 2 by 16 and 32.",
}
SCALED_ROTARY_NOTE = ("`original_max_position_embeddings` defaults to 512; pass your model's training length "
                      "(on a Hugging Face model it is read from `max_position_embeddings`).")


def _md(text: str) -> str:
    """reST inline markup of the docstrings -> Markdown: ``x`` and :math:`x` become `x`."""
    return re.sub(r":(?:math|class|func|meth|attr|mod):`([^`]*)`", r"`\1`", text).replace("``", "`")


def _rst_block(doc: str) -> str:
    """A reST docstring (a module's formulas) -> Markdown: inline markup as `_md`, a paragraph ending
    in ``::`` introduces a literal block (the indented lines after it), fenced as code; ``.. ``
    directives (comments, notes) are dropped with their indented body."""
    out: list[str] = []
    lines = inspect.cleandoc(doc).splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(".. "):  # a directive and its indented body
            i += 1
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                i += 1
            continue
        if line.rstrip().endswith("::"):
            head = line.rstrip()[:-2].rstrip()
            out.append(_md(head + ":") if head else "")
            i += 1
            block: list[str] = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            body = inspect.cleandoc("\n".join(block))
            out += ["", "```text", body, "```", ""]
            continue
        out.append(_md(line))
        i += 1
    return "\n".join(out).strip()


def _prose(doc: str | None) -> str:
    """A class docstring's text before its ``Args:`` (the formula), paragraphs kept."""
    if not doc:
        return ""
    text = re.split(r"^(?:Args|Returns|Raises|Examples?):\s*$", inspect.cleandoc(doc), flags=re.MULTILINE)[0]
    paras = [" ".join(line.strip() for line in p.splitlines()) for p in text.strip().split("\n\n")]
    return _md("\n\n".join(p for p in paras if p))


def _initialization(doc: str | None) -> str:
    """A class docstring's ``Initialization:`` paragraph (how its parameters start, and the source
    that says so), without the label; empty when it has none."""
    for para in inspect.cleandoc(doc or "").split("\n\n"):
        if para.startswith("Initialization:"):
            return _md(" ".join(line.strip() for line in para.splitlines())[len("Initialization:"):].strip())
    return ""


def _default(p: inspect.Parameter) -> str:
    if p.default is inspect.Parameter.empty:
        return "required"
    return f"`{p.default!r}`"


def _annotation(p: inspect.Parameter) -> str:
    a = p.annotation
    if a is inspect.Parameter.empty:
        return ""
    return f"`{a if isinstance(a, str) else getattr(a, '__name__', repr(a))}`".replace("|", "\\|")


def _backends(enc) -> list[str]:
    """Backends that run ``enc`` without an N x N tensor on a GPU (eager, the reference, runs every one)."""
    import torch

    from posenc_lightning.attention.backends import blockwise, flex, sdpa, triton

    cuda = torch.device("cuda")
    out = []
    for name, mod in (("sdpa", sdpa), ("flex", flex), ("triton", triton), ("blockwise", blockwise)):
        if mod.supports(enc, cuda, True) is None:
            out.append(f"`{name}`")
    return out


def _hf(enc) -> str:
    if enc.position_dims == 2:
        return "no: needs `[B, N, 2]` positions, which transformers models do not pass"
    if "embed" in enc.stages:
        return "models with a position table (`wpe`, GPT-2) only"
    if enc.keeps_cache_state:
        return "yes; dynamic KV cache only (per-token state beside the keys)"
    return "yes"


def _export(enc) -> str:
    from posenc_lightning.models.hf_export import to_rope_parameters

    rope = to_rope_parameters(enc) if enc.stages == frozenset({"rotate"}) else None
    if rope is not None:
        return f"transformers `rope_parameters` (`rope_type: {rope[0]['rope_type']}`): loads in plain transformers"
    return "`posenc_lightning.json` + weights beside the model; reload with `load_pretrained`"


def _kv_cache(enc) -> str:
    if enc.keeps_cache_state:
        return "yes, with per-token state kept beside the cached keys"
    if enc.dynamic:
        return "yes; keys cached un-rotated and rotated at attend time (the scale may change)"
    return "yes"


def _compile(enc) -> str:
    if enc.dynamic:
        return ("0 graph breaks on its default backend; explicit positions not known statically cost one read "
                "of the largest position per call")
    return "0 graph breaks on its default backend (forward, backward, cached decode)"


def _runtime(enc) -> list[str]:
    out = []
    if enc.scalable:
        out.append("`set_scale` (curricula change its factor)")
    if enc.searchable:
        out.append("`set_factors` (LongRoPE search)")
    if enc.requires_hidden:
        out.append("needs `hidden=` in `attend`")
    if enc.accepts_nd_positions:
        out.append("takes `[B, N, k]` positions")
    if enc.position_dims == 2:
        out.append("takes `[B, N, 2]` positions")
    if enc.needs_even_head_dim:
        out.append("even `head_dim`")
    return out


def catalogue() -> str:
    """The encodings catalogue page, one section per registered encoding."""
    from posenc_lightning.encodings.registry import available_encodings, build_encoding, encoding_class

    names = available_encodings()
    lines = [
        "# Encodings catalogue",
        "",
        "<!-- generated by `python docs/generate.py` from the registry; tests/test_docs.py checks it -->",
        "",
        (f"{len(names)} registered encodings. Each takes the keyword arguments below "
        "(`PosEncCallback(name, **kwargs)`, `inject(model, name, **kwargs)`, or `config:` in YAML). "
        f"Parameter counts are for {HEADS} heads of size {HEAD_DIM}. Backends are those that run the "
        "encoding on a GPU without an N x N tensor; `eager` (the reference) runs every encoding, and "
        "`backend=\"auto\"` picks among them per device ([adding an encoding](../guides/adding-an-encoding.md))."),
        "",
        "| encoding | family | paper |",
        "|---|---|---|",
    ]
    for n in names:
        cls = encoding_class(n)
        desc = _md(cls.description).replace("|", "\\|")
        lines.append(f"| [`{n}`](#{n}) | {cls.family} | {desc} |")
    lines.append("")
    for n in names:
        cls = encoding_class(n)
        enc = build_encoding(n)
        enc.bind(n_heads=HEADS, head_dim=HEAD_DIM, d_model=HEADS * HEAD_DIM)
        n_params = sum(p.numel() for p in enc.parameters())
        lines += [f"## {n}", "", f"{_md(cls.description)}", ""]
        eq = _prose(cls.__doc__)
        if eq:
            lines += [f"{eq}", ""]
        module_doc = inspect.getmodule(cls).__doc__
        if "module docstring" in (cls.__doc__ or "") and module_doc:  # the formulas live there
            lines += [_rst_block(module_doc), ""]
        lines += [f"Class: `{cls.__module__}.{cls.__qualname__}`", ""]
        params = [p for p in inspect.signature(cls.__init__).parameters.values()
                  if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        if params:
            lines += ["| parameter | default | type |", "|---|---|---|"]
            lines += [f"| `{p.name}` | {_default(p)} | {_annotation(p)} |" for p in params]
            lines.append("")
        stages = ", ".join(sorted(enc.stages)) or "none (the baseline)"
        lines += [
            f"- **Stages:** {stages}",
            f"- **Backends:** {', '.join(_backends(enc)) or 'eager only'}",
            f"- **KV cache:** {_kv_cache(enc)}",
            f"- **torch.compile:** {_compile(enc)}",
            f"- **Hugging Face models:** {_hf(enc)}",
            f"- **Export:** {_export(enc)}",
        ]
        runtime = _runtime(enc)
        if runtime:
            lines.append(f"- **Interface:** {'; '.join(runtime)}")
        shared = n_params and "embed" not in enc.stages
        lines.append(f"- **Learnable parameters:** {n_params}" + (
            " (one set shared by every layer by default; `share_across_layers=False` gives one per layer)"
            if shared else ""))
        init = _initialization(cls.__doc__)
        if init:
            lines.append(f"- **Initialization:** {init}")
        notes = [DEPARTURES[n]] if n in DEPARTURES else []
        if "original_max_position_embeddings" in inspect.signature(cls.__init__).parameters:
            notes.append(SCALED_ROTARY_NOTE)
        if notes:
            lines.append(f"- **Default vs paper:** {' '.join(notes)}")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ performance
#: (title, file pattern under benchmarks/results, what it measures); the newest match is shown
BENCHMARKS = [
    ("Cost of each encoding vs nope", r"cpu-\d{8}-\d{4}\.md",
     "One attention layer per encoding, time and peak memory as ratios to `nope` in the same process."),
    ("One and two threads", r"threads-\d{8}[-\w]*/README\.md",
     ("One layer's forward and backward as a ratio to `nope`, over three inputs, at one and two torch threads. "
     "The encodings whose bias or weights are computed block by block (cope, mixture, fire, rse, exposb) gain "
     "less from the second thread than `nope`'s fused SDPA kernel does: their ratio grows with the threads.")),
    ("Against other libraries", r"compare-cpu-\d{8}-\d{4}\.md",
     "The same operation in this library and in Hugging Face, rotary-embedding-torch and x-transformers."),
    ("Compiled training step", r"compile-cpu-\d{8}-\d{4}\.md",
     "`TinyGPT(compile=True)` against eager: one forward + backward + AdamW step."),
    ("Length generalization (compare_encodings)", r"compare_encodings/results\.md",
     "Perplexity of every encoding at multiples of the training length."),
    ("YaRN extension (yarn_extend)", r"yarn_extend/results\.md",
     "RoPE pre-trained at L, extended 8x with YaRN, fine-tuned for 5% of the steps."),
    ("LongRoPE search (longrope_extend)", r"longrope_extend/results\.md",
     "PI, YaRN and searched LongRoPE factors at 8x the pre-training length."),
    ("CLEX (clex_train)", r"clex_train/results\.md", "CLEX trained with its curriculum, perplexity by length."),
    ("DroPE against RoPE scaling (drope_extend)", r"drope_extend/results\.md",
     ("RoPE pre-trained at L; RoPE dropped and recalibrated (DroPE) against PI, YaRN and NTK zero-shot and "
      "fine-tuned with the same steps, perplexity at 1-16 L.")),
    ("A Hugging Face Llama extended with YaRN (hf_yarn_extend)", r"hf_yarn_extend/results\.md",
     "The offline Hugging Face flow: pre-train, extend 8x, fine-tune, export."),
]


def _newest(pattern: str) -> Path | None:
    found = sorted(p for p in RESULTS.rglob("*") if re.fullmatch(pattern, p.relative_to(RESULTS).as_posix()))
    return found[-1] if found else None


def _first_table(text: str) -> list[str]:
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-| :]+\|$", lines[i + 1]):
            for row in lines[i:]:
                if not row.startswith("|"):
                    break
                out.append(row)
            break
    return out


def _command(text: str) -> str | None:
    """The first command line quoted in a results file."""
    m = re.search(r"`((?:[A-Z_]+=\S+ )*python [^`]+)`", text)
    return m.group(1) if m else None


def _machine(path: Path, text: str) -> str:
    """The ``- machine:`` line of a results file, else the torch version and device its results.json names."""
    m = re.search(r"^- machine: (.+)$", text, re.MULTILINE)
    if m:
        return m.group(1).strip()
    m = re.search(r"^Command \(([^)]*)\)", text, re.MULTILINE)  # "Command (CPU, 2 shared cores, ...): ..."
    if m:
        return m.group(1).strip()
    js = path.with_suffix(".json")
    if js.exists():
        import json

        data = json.loads(js.read_text())
        torch_v = data.get("torch") if isinstance(data, dict) else None
        if torch_v:
            return f"CPU, torch {torch_v} (see the file)"
    return "CPU (see the file)"


def performance() -> str:
    """The performance page: the newest recorded table of each benchmark."""
    lines = [
        "# Performance",
        "",
        "<!-- generated by `python docs/generate.py` from benchmarks/results; tests/test_docs.py checks it -->",
        "",
        ("One current table per benchmark: the newest recorded result, with the command that made it and the "
        "machine it ran on. Each file under `benchmarks/results/` holds the full record; earlier runs and "
        "what changed between them are in the [changelog](changelog.md). How each benchmark measures: "
        "`benchmarks/README.md`."),
        "",
    ]
    for title, pattern, what in BENCHMARKS:
        path = _newest(pattern)
        if path is None:
            continue
        text = path.read_text()
        rel = path.relative_to(ROOT).as_posix()
        command = _command(text)
        machine = _machine(path, text)
        lines += [f"## {title}", "", what, "",
                  f"- recorded in: `{rel}`"]
        if command:
            lines.append(f"- command: `{command}`")
        lines.append(f"- machine: {machine}")
        lines += ["", *_first_table(text), ""]
    return "\n".join(lines).rstrip() + "\n"


PAGES = {CATALOGUE: catalogue, PERFORMANCE: performance}
#: pictures the docs show, copied from the recorded results (the site cannot reach outside docs/)
ASSETS = {ROOT / "docs" / "assets" / "ppl_vs_length.png": RESULTS / "compare_encodings" / "ppl_vs_length.png"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = parser.parse_args(argv)
    stale = []
    for path, make in PAGES.items():
        text = make().rstrip() + "\n"
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.relative_to(ROOT).as_posix())
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for dst, src in ASSETS.items():
        if args.check:
            if not dst.exists() or dst.read_bytes() != src.read_bytes():
                stale.append(dst.relative_to(ROOT).as_posix())
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    if stale:
        print(f"out of date: {', '.join(stale)} (run: python docs/generate.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
