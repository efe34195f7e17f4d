"""``posenc export RUN_OR_CHECKPOINT OUT --format hf|gguf|remote-code`` and ``posenc check-serving DIR``.

``export`` loads a trained Hugging Face model (`HFCausalLM`) with its encoding and writes it:

- ``hf``: `posenc_lightning.models.hf_export.export_pretrained` (rope-family laws as transformers
  ``rope_parameters``; any other encoding beside the weights, for `load_pretrained`);
- ``remote-code``: `posenc_lightning.models.hf_remote.export_remote_code` (a directory transformers
  loads with ``trust_remote_code=True`` where posenc_lightning is not installed);
- ``gguf``: `posenc_lightning.models.gguf_export.export_gguf` (the ``hf`` export converted by
  llama.cpp's own converter at the pinned version, after checking that llama.cpp reads every rope field).

What it reads: a Lightning checkpoint (``.ckpt``), a run directory (its ``last.ckpt``, else its newest
``.ckpt``), or a directory `export_pretrained` wrote.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

FORMATS = ("hf", "gguf", "remote-code")


def find_checkpoint(run: Path) -> Path | None:
    """The checkpoint a run directory holds: ``last.ckpt`` anywhere under it, else the newest ``.ckpt``."""
    found = sorted(run.rglob("*.ckpt"), key=lambda p: (p.name == "last.ckpt", p.stat().st_mtime))
    return found[-1] if found else None


def precheck_export(source: str, out: str, fmt: str) -> str | None:
    """The one-line error ``posenc export`` would end in because of its arguments, or None (nothing
    is loaded: the path exists and is a checkpoint, a run directory with one, or an export)."""
    path = Path(source)
    if fmt not in FORMATS:
        return f"--format: {fmt!r} is not one of {', '.join(FORMATS)}"
    if not path.exists():
        return f"RUN_OR_CHECKPOINT: {source} does not exist; give a .ckpt file or a run directory"
    if path.is_dir() and not (path / "config.json").is_file() and find_checkpoint(path) is None:
        return (f"RUN_OR_CHECKPOINT: {source} holds no .ckpt and no config.json; give a run directory with "
                f"checkpoints (Trainer(enable_checkpointing=True)) or a checkpoint file")
    if Path(out).exists() and any(Path(out).iterdir()):
        return f"OUT: {out} exists and is not empty; give a new directory"
    return None


def load_trained(source: str) -> Any:
    """The trained model at ``source`` with its encoding injected (`precheck_export`'s sources).

    Raises:
        ValueError: a checkpoint that is not an `HFCausalLM`'s (TinyGPT has no Hugging Face form).
    """
    import torch

    path = Path(source)
    if path.is_dir() and (path / "config.json").is_file():
        from posenc_lightning.models.hf_export import load_pretrained

        return load_pretrained(str(path)).eval()
    ckpt = find_checkpoint(path) if path.is_dir() else path
    hparams = torch.load(ckpt, map_location="cpu", weights_only=False).get("hyper_parameters", {})
    if not ({"pretrained_dir", "config"} <= set(hparams)):
        raise ValueError(f"posenc export: {ckpt} is not a Hugging Face model's checkpoint (HFCausalLM); a TinyGPT "
                         f"has no transformers form to export")
    from posenc_lightning.models.hf import HFCausalLM

    return HFCausalLM.load_from_checkpoint(str(ckpt), map_location="cpu").eval()


def export(source: str, out: str, fmt: str, converter: str | None = None, gguf_type: str = "f32",
           tokenizer: str | None = None) -> dict[str, Any]:
    """Load ``source`` (`load_trained`) and write it to ``out`` in format ``fmt`` (`FORMATS`).

    Args:
        source: a checkpoint, a run directory or an export directory (`precheck_export`).
        out: the directory to write.
        fmt: ``hf``, ``gguf`` or ``remote-code``.
        converter: gguf only: the llama.cpp source (`posenc_lightning.models.gguf_export.converter_source`).
        gguf_type: gguf only: the weight type (``f32`` keeps the trained weights exactly).
        tokenizer: the tokenizer's directory when the model does not name one.
    """
    module = load_trained(source)
    if tokenizer is None and (Path(source) / "config.json").is_file():
        tokenizer = source  # an export directory: its tokenizer files
    if fmt == "gguf":
        from posenc_lightning.models.gguf_export import export_gguf

        return export_gguf(module, out, converter=converter, outtype=gguf_type, tokenizer_dir=tokenizer)
    if fmt == "remote-code":
        from posenc_lightning.models.hf_remote import export_remote_code

        return export_remote_code(module, out, tokenizer_dir=tokenizer)
    from posenc_lightning.models.hf_export import export_pretrained

    return export_pretrained(module, out, tokenizer_dir=tokenizer)


def cmd_export(args: argparse.Namespace) -> int:
    error = precheck_export(args.source, args.out, args.format)
    if error is not None:
        print(f"posenc export: error: {error}")
        return 2
    from posenc_lightning.models.gguf_export import ConverterMissing, GGUFRefused

    try:
        result = export(args.source, args.out, args.format, args.converter, args.gguf_type, args.tokenizer)
    except (GGUFRefused, ConverterMissing) as e:
        print(f"posenc export: error: {e}")
        return 2
    print(f"wrote {args.out} ({result['format']}" + (f", {result['encoding']}" if result.get("encoding") else "")
          + (f", {result['gguf']}" if "gguf" in result else "") + ")")
    return 0


def add_parsers(sub: Any) -> None:
    """``export`` and ``check-serving`` on the ``posenc`` parser's subcommands."""
    e = sub.add_parser("export", help="write a trained Hugging Face model and its encoding for serving",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="hf: transformers rope_parameters for rope-family laws, else the encoding beside "
                                   "the weights (posenc_lightning.load_pretrained). gguf: the hf export converted by "
                                   "llama.cpp's convert_hf_to_gguf.py (llama-cpp-python 0.3.36's source), refused "
                                   "where llama.cpp cannot express a rope field. remote-code: a directory "
                                   "AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True) loads without "
                                   "posenc_lightning (alibi, relative_bias, fire, fox, sba, cope).")
    e.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a .ckpt, a run directory, or an export directory")
    e.add_argument("out", metavar="OUT", help="the directory to write (new or empty)")
    e.add_argument("--format", default="hf", choices=FORMATS)
    e.add_argument("--converter", default=None, metavar="PATH",
                   help="gguf: the llama-cpp-python 0.3.36 sdist (.tar.gz) or its unpacked source; default: "
                        "$POSENC_LLAMA_CPP_SRC, then a copy found earlier")
    e.add_argument("--gguf-type", default="f32", choices=("f32", "f16", "bf16", "q8_0"),
                   help="gguf: weight type (f32 keeps the trained weights exactly)")
    e.add_argument("--tokenizer", default=None, metavar="DIR", help="the tokenizer's directory when the checkpoint "
                                                                    "names none (gguf needs one)")
    e.set_defaults(fn=cmd_export)
    add_check_parser(sub)


ENGINES = ("transformers", "vllm", "sglang", "llama.cpp")


def check_serving(path: str, trained: str | None = None, engines: tuple[str, ...] = ENGINES,
                  versions: dict[str, str] | None = None, compare: bool = True) -> tuple[list[str], bool]:
    """The report of ``posenc check-serving`` (lines) and whether anything diverges.

    Args:
        path: the exported directory.
        trained: the trained model to compare with (`load_trained`'s sources); default: posenc's
            reading of the directory (`posenc_lightning.models.serving.reference_model`).
        engines: the engines to check.
        versions: engine -> version, over the pinned ones.
        compare: run transformers on the directory and compare numerically.
    """
    from posenc_lightning.models.serving import (
        TOLERANCE,
        check_rules,
        compare_transformers,
        export_facts,
        reference_model,
    )
    from posenc_lightning.models.serving_rules import PINNED, READS

    facts = export_facts(path)
    at = {**PINNED, **(versions or {})}
    head = (f"{path}: {facts['format']} export, model_type {facts['model_type']}, encoding "
            f"{facts['encoding'] or '-'}, rope_type {facts['rope_type']}, max_position_embeddings "
            f"{facts['max_position_embeddings']}")
    lines = [head]
    findings = [f for f in check_rules(facts, versions) if f.engine in engines]
    reasons: dict[str, list[str]] = {e: [] for e in engines}  # the summary: what diverges, per engine
    for f in findings:
        reasons[f.engine].append(("refuses: " if f.refuses else "") + f.what)
    held: list[Any] = []

    def reference() -> Any:  # loaded once, for the engines that are run
        if not held:
            held.append(load_trained(trained) if trained else reference_model(path))
        return held[0]

    for engine in engines:
        mine = [f for f in findings if f.engine == engine]
        lines.append(f"{engine} {at[engine]}: reads {READS[engine]}")
        for f in mine:
            tag = "REFUSES" if f.refuses else "DIVERGES"
            lines.append(f"  {tag} [{f.what}] {f.computes}\n    override: {f.override}\n    source: {f.source}")
        if engine == "transformers" and compare:
            err = compare_transformers(path, reference())
            bad = max(err.values()) > TOLERANCE
            if bad:
                reasons[engine].append("measured logits")
            lines.append(f"  {'DIVERGES' if bad else 'equal'} [measured] max |logits - trained|: full forward "
                         f"{err['full']:.2e}, KV-cached decoding {err['cached']:.2e} (tolerance {TOLERANCE:g})")
        elif not mine:
            lines.append("  no known divergence")
        if engine == "llama.cpp":  # a field GGUF cannot carry diverges too
            more, cannot = gguf_lines(path, facts)
            lines += more
            if cannot:
                reasons[engine].append("GGUF cannot carry " + ", ".join(cannot))
            if compare:
                from posenc_lightning.models.llama_cpp_check import llama_cpp_lines

                more, bad = llama_cpp_lines(path, facts, reference)
                lines += more
                if bad:
                    reasons[engine].append("measured logits")
    lines.append("summary (per engine):")
    for engine in engines:
        why = list(dict.fromkeys(reasons[engine]))
        lines.append(f"  {engine}: " + ("OK" if not why else "diverges: " + "; ".join(why)))
    return lines, any(reasons.values())


def gguf_lines(path: str, facts: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The GGUF pre-conversion check's lines (`posenc_lightning.models.gguf_check`) and the fields
    llama.cpp cannot be given (with the keys ``posenc export --format gguf`` adds when it wrote the
    directory, without them for a plain conversion)."""
    import json

    from posenc_lightning.models.gguf_check import gguf_precheck

    cfg = json.loads((Path(path) / "config.json").read_text())
    checks = gguf_precheck(facts, dict(cfg.get("rope_parameters") or {}), posenc_keys=facts["posenc_gguf"])
    lines = ["  gguf pre-conversion check (LLaMA loader" + (", with the keys posenc export --format gguf adds):"
                                                            if facts["posenc_gguf"] else ", plain converter):")]
    for c in checks:
        lines.append(f"    {c.field}={c.value!r}: " + (f"-> {c.key} ({c.reason})" if c.key else f"CANNOT ({c.reason})"))
    return lines, [c.field for c in checks if c.key is None]


def cmd_check_serving(args: argparse.Namespace) -> int:
    versions = {}
    for item in args.version or []:
        engine, eq, version = item.partition("=")
        if not eq or engine not in ENGINES:
            print(f"posenc check-serving: error: --version {item!r}: give ENGINE=VERSION, ENGINE one of {', '.join(ENGINES)}")
            return 2
        versions[engine] = version
    if not (Path(args.dir) / "config.json").is_file():
        print(f"posenc check-serving: error: DIR: {args.dir} has no config.json; give a directory posenc export wrote")
        return 2
    lines, diverges = check_serving(args.dir, args.trained, tuple(args.engines), versions, not args.no_compare)
    print("\n".join(lines))
    return 1 if diverges else 0


def add_check_parser(sub: Any) -> None:
    c = sub.add_parser("check-serving", help="what transformers, vLLM, SGLang and llama.cpp compute from an export",
                       description="Applies the table of known engine divergences (posenc_lightning.models."
                                   "serving_rules) at pinned versions and compares transformers numerically with "
                                   "the trained model. Exits 1 on a divergence.")
    c.add_argument("dir", metavar="DIR", help="a directory posenc export wrote")
    c.add_argument("--trained", default=None, help="the trained model (.ckpt or run directory); default: posenc's "
                                                   "reading of DIR")
    c.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    c.add_argument("--version", action="append", metavar="ENGINE=VERSION", help="check an engine at another version")
    c.add_argument("--no-compare", action="store_true", help="rules only: do not load DIR with transformers")
    c.set_defaults(fn=cmd_check_serving)
