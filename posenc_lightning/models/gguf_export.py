"""``posenc export --format gguf``: the Hugging Face export converted by llama.cpp's own converter.

`export_gguf` writes the model with `posenc_lightning.models.hf_export.export_pretrained`, checks that
every rope field it sets reaches a key llama.cpp's LLaMA loader reads
(`posenc_lightning.models.gguf_check.gguf_precheck`; anything else is refused with the reason, never
exported approximately), runs ``convert_hf_to_gguf.py`` from the pinned llama.cpp source (the one
llama-cpp-python 0.3.36 vendors, `converter_source`) in a subprocess, adds the keys and tensors that
converter leaves out for a LLaMA model (`posenc_lightning.models.gguf_check.gguf_additions`) with the
same source's gguf-py, and reads the file back to confirm every key is there. The output directory
holds the Hugging Face export (``posenc check-serving`` reads it), the GGUF file and
``posenc_gguf.json`` (`posenc_lightning.models.serving.GGUF_MANIFEST`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from posenc_lightning.models.gguf_check import FieldCheck, gguf_additions, gguf_precheck
from posenc_lightning.models.serving import GGUF_MANIFEST, export_facts
from posenc_lightning.models.serving_rules import PINNED

#: the llama.cpp (llama-cpp-python) version whose converter and loader the key check was read from
LLAMA_CPP_VERSION = PINNED["llama.cpp"]
#: environment variable naming the converter source (a llama-cpp-python sdist or its unpacked tree)
SOURCE_ENV = "POSENC_LLAMA_CPP_SRC"
#: the converter's ``--outtype`` values posenc passes on (f32 is exact; the others round the weights)
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
_CONVERTER = "convert_hf_to_gguf.py"
_MEMBERS = (_CONVERTER, "conversion/", "gguf-py/")
_TOOL = Path(__file__).with_name("gguf_tool.py")
_HOW = (f"install the serve extra (pip install 'posenc-lightning[serve]') and fetch the converter source: pip "
        f"download llama-cpp-python=={LLAMA_CPP_VERSION} --no-deps --no-binary :all: -d DIR, then pass "
        f"--converter DIR/llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz (or set {SOURCE_ENV})")


class GGUFRefused(ValueError):
    """A model llama.cpp cannot run as trained; ``checks`` holds the fields it cannot express."""

    def __init__(self, checks: list[FieldCheck]) -> None:
        self.checks = checks
        super().__init__("posenc export --format gguf: refused, llama.cpp cannot express " + "; ".join(
            f"{c.field}={c.value!r} ({c.reason})" for c in checks))


class ConverterMissing(RuntimeError):
    """No llama.cpp converter source at the pinned version was found."""


def cache_dir() -> Path:
    """Where an sdist's converter files are unpacked (``$XDG_CACHE_HOME`` or ``~/.cache``)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "posenc_lightning" / f"llama.cpp-{LLAMA_CPP_VERSION}"


def _version_of(tree: Path) -> str | None:
    """The llama-cpp-python version of a source tree: PKG-INFO or llama_cpp/__init__.py above it,
    or the ``VERSION`` file `_unpack` writes."""
    for d in (tree, *tree.parents):
        if (d / "VERSION").is_file() and d == tree:
            return (d / "VERSION").read_text().strip()
        if (d / "PKG-INFO").is_file():
            for line in (d / "PKG-INFO").read_text(errors="replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
        init = d / "llama_cpp" / "__init__.py"
        if init.is_file():
            for line in init.read_text().splitlines():
                if line.startswith("__version__"):
                    return line.split("=", 1)[1].strip().strip("\"'")
    return None


def _unpack(sdist: Path, dest: Path) -> Path:
    """Unpack the converter, its ``conversion`` package and ``gguf-py`` from a llama-cpp-python sdist."""
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        info = next((n for n in names if n.count("/") == 1 and n.endswith("/PKG-INFO")), None)
        version = None
        if info is not None:
            text = tar.extractfile(info).read().decode(errors="replace")  # type: ignore[union-attr]
            version = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Version:")),
                           None)
        if version != LLAMA_CPP_VERSION:
            raise ConverterMissing(f"{sdist} is llama-cpp-python {version}, not the pinned {LLAMA_CPP_VERSION} "
                                   f"(whose converter and loader the GGUF key check was read from)")
        prefix = f"{names[0].split('/')[0]}/vendor/llama.cpp/"
        wanted = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())
                  and m.name[len(prefix):].startswith(_MEMBERS)]
        if dest.exists() and (_tree(dest) is None or _version_of(dest) != LLAMA_CPP_VERSION):
            shutil.rmtree(dest, ignore_errors=True)  # a broken or stale cache
        tmp = Path(tempfile.mkdtemp(dir=dest.parent))
        for m in wanted:
            m.name = m.name[len(prefix):]
            if ".." in Path(m.name).parts:
                continue
            tar.extract(m, tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (tmp / "VERSION").write_text(LLAMA_CPP_VERSION)
    try:
        tmp.rename(dest)
    except OSError:  # another process (a parallel test worker) unpacked it first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _tree(candidate: Path) -> Path | None:
    """The llama.cpp tree holding the converter at ``candidate``: the tree itself, an sdist's
    unpacked root (``vendor/llama.cpp``), or None."""
    for d in (candidate, candidate / "vendor" / "llama.cpp"):
        if (d / _CONVERTER).is_file() and (d / "gguf-py").is_dir() and (d / "conversion").is_dir():
            return d
    return None


def converter_source(explicit: str | None = None) -> Path:
    """The llama.cpp source tree whose ``convert_hf_to_gguf.py`` and ``gguf-py`` posenc runs.

    Looked up in order: ``explicit``, then ``$POSENC_LLAMA_CPP_SRC`` (each a llama-cpp-python sdist
    ``.tar.gz``, its unpacked directory, or its ``vendor/llama.cpp``), a copy vendored inside the
    installed ``llama_cpp`` package, the cache an sdist was unpacked to (`cache_dir`). Only version
    `LLAMA_CPP_VERSION` is accepted.

    Raises:
        ConverterMissing: none found, or one at another version (the message says how to get it).
    """
    given = [(p, f"--converter {p}" if p == explicit else f"${SOURCE_ENV}={p}")
             for p in (explicit, os.environ.get(SOURCE_ENV)) if p]
    for path, where in given:
        p = Path(path).expanduser()
        if p.is_file() and p.name.endswith((".tar.gz", ".tgz")):
            cached = cache_dir()
            if _tree(cached) is not None and _version_of(cached) == LLAMA_CPP_VERSION:
                return cached
            cached.parent.mkdir(parents=True, exist_ok=True)
            return _unpack(p, cached)
        tree = _tree(p)
        if tree is None:
            raise ConverterMissing(f"{where}: no {_CONVERTER} with conversion/ and gguf-py/ there; {_HOW}")
        return _checked(tree, where)
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")  # located, not imported (that loads the library)
    found = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    found.append(cache_dir())
    for p in found:
        tree = _tree(p)
        if tree is not None:
            return _checked(tree, str(p))
    raise ConverterMissing(f"posenc export --format gguf: llama.cpp's {_CONVERTER} {LLAMA_CPP_VERSION} was not found; "
                           f"{_HOW}")


def _checked(tree: Path, where: str) -> Path:
    version = _version_of(tree)
    if version != LLAMA_CPP_VERSION:
        raise ConverterMissing(f"{where}: llama.cpp source of llama-cpp-python {version or 'unknown version'}, not "
                               f"the pinned {LLAMA_CPP_VERSION} (whose converter and loader the GGUF key check was "
                               f"read from); {_HOW}")
    return tree


def _run(cmd: list[str], src: Path, what: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env["PYTHONPATH"] = os.pathsep.join([str(src / "gguf-py"), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(cmd, check=False, cwd=str(src), env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"posenc export --format gguf: {what} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


def read_gguf(path: str, converter: str | Path | None = None) -> dict[str, Any]:
    """The keys and tensors of a GGUF file, read by the pinned source's gguf-py (``gguf_tool.py read``)."""
    src = Path(converter) if isinstance(converter, Path) else converter_source(converter)
    return json.loads(_run([sys.executable, str(_TOOL), "read", str(Path(path).resolve())], src, "reading the GGUF"))


def expected_keys(checks: list[FieldCheck]) -> dict[str, Any]:
    """GGUF key or tensor name -> the value the file must hold (None: present, value not checked),
    from `gguf_precheck`'s answers."""
    out: dict[str, Any] = {}
    for c in checks:
        if c.key is None or c.key == "(none)":
            continue
        key, _, value = c.key.partition(" = ")
        if key.startswith("rope_"):
            out[f"{key}.weight"] = None
        elif value:
            if not value.startswith("("):  # "(not written: ...)": the loader's default applies
                out[key] = value
        elif c.field in ("rope_theta", "factor", "original_max_position_embeddings") and c.writer == "converter":
            out[key] = float(c.value)
        else:
            out[key] = None
    return out


def missing_keys(read: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """The `expected_keys` a read-back file lacks or holds with another value."""
    bad = []
    for key, want in expected.items():
        have = read["tensors"].get(key) if key.endswith(".weight") else read["keys"].get(key)
        if have is None:
            bad.append(f"{key} missing")
        elif isinstance(want, float) and abs(float(have) - want) > 1e-6 * max(1.0, abs(want)):
            bad.append(f"{key} = {have}, expected {want}")
        elif isinstance(want, str) and have != want:
            bad.append(f"{key} = {have!r}, expected {want!r}")
    return bad


def export_gguf(module: nn.Module, out: str, converter: str | None = None, outtype: str = "f32",
                tokenizer_dir: str | None = None) -> dict[str, Any]:
    """Write ``module``'s Hugging Face model as a GGUF file llama.cpp runs as trained.

    Args:
        module: the trained model (an `HFCausalLM` or a Hugging Face model) with its injected encoding.
        out: the directory to write (created; its files are replaced).
        converter: the llama.cpp source (`converter_source`).
        outtype: the GGUF weight type, one of `OUTTYPES` (f32: the trained weights exactly).
        tokenizer_dir: the tokenizer's files, when ``module`` does not name them (the converter needs them).

    Returns:
        ``{"format": "gguf", "gguf": path, "rope_type", "encoding": the injected encoding's name (None
        for a model exported as it was), "added": the keys posenc wrote, "keys": the rope keys read back}``.

    Raises:
        GGUFRefused: a field or encoding llama.cpp cannot express (before anything is converted).
        ConverterMissing: no converter at the pinned version.
        ValueError: no tokenizer, or an unknown ``outtype``.
    """
    import warnings

    from posenc_lightning.models.hf_export import export_pretrained

    if outtype not in OUTTYPES:
        raise ValueError(f"posenc export --format gguf: outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    work = Path(tempfile.mkdtemp(prefix="posenc_gguf_"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a side-file export is refused below, with its reason
            export_pretrained(module, str(work), tokenizer_dir=tokenizer_dir)
        facts = export_facts(str(work))
        rope = dict(json.loads((work / "config.json").read_text()).get("rope_parameters") or {})
        checks = gguf_precheck(facts, rope, posenc_keys=True)
        refused = [c for c in checks if c.key is None]
        if refused:
            raise GGUFRefused(refused)
        if not any((work / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            raise ValueError("posenc export --format gguf: the converter needs the model's tokenizer (tokenizer.json "
                             "or tokenizer.model): pass tokenizer_dir= (--tokenizer DIR)")
        src = converter_source(converter)
        gguf = work / f"model-{outtype}.gguf"
        _run([sys.executable, str(src / _CONVERTER), str(work), "--outfile", str(gguf), "--outtype", outtype],
             src, f"llama.cpp {LLAMA_CPP_VERSION}'s {_CONVERTER}")
        added = gguf_additions(facts, rope)
        if any(added.values()):
            spec = work / "gguf_additions.json"
            spec.write_text(json.dumps(added))
            _run([sys.executable, str(_TOOL), "add", str(gguf), str(spec)], src, "adding the rope keys")
            spec.unlink()
        read = read_gguf(str(gguf), src)
        bad = missing_keys(read, expected_keys(checks))
        if bad:
            raise RuntimeError(f"posenc export --format gguf: the converted file does not hold what the key check "
                               f"expects: {'; '.join(bad)}")
        keys = {k: v for k, v in read["keys"].items() if ".rope." in k or k.endswith("context_length")}
        manifest = {"gguf": gguf.name, "llama_cpp": LLAMA_CPP_VERSION, "outtype": outtype,
                    "added": added, "keys": keys, "tensors": sorted(t for t in read["tensors"] if t.startswith("rope_")),
                    "fields": [{"field": c.field, "key": c.key, "writer": c.writer, "source": c.source} for c in checks]}
        (work / GGUF_MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
        dest = Path(out)
        dest.mkdir(parents=True, exist_ok=True)
        for f in work.iterdir():
            shutil.move(str(f), str(dest / f.name))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from posenc_lightning.inject import injected_spec
    from posenc_lightning.models.hf_export import _single_hf

    spec = injected_spec(_single_hf(module)) or injected_spec(module) or {}
    return {"format": "gguf", "gguf": str(dest / gguf.name), "rope_type": facts["rope_type"],
            "encoding": spec.get("encoding"), "added": added, "keys": keys}
