"""The documentation cannot drift from the code: the generated pages equal what the registry and
the recorded results give, every registered encoding has its catalogue entry, every public name is
documented with Google-style sections, and ``mkdocs build --strict`` passes (no broken link, page or
API reference)."""

from __future__ import annotations

import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import posenc_lightning
from posenc_lightning.encodings.registry import available_encodings, encoding_class

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = r"(?:Args|Returns|Raises|Example|Examples|Yields|Note|Attributes):"


def _generate():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_pages_are_current():
    gen = _generate()
    for path, make in gen.PAGES.items():
        assert path.read_text() == make().rstrip() + "\n", f"{path.name} is stale: run python docs/generate.py"
    for dst, src in gen.ASSETS.items():
        assert dst.read_bytes() == src.read_bytes(), f"{dst.name} is stale: run python docs/generate.py"


def test_catalogue_covers_every_registered_encoding():
    text = (ROOT / "docs" / "reference" / "encodings.md").read_text()
    headings = re.findall(r"^## (\S+)$", text, re.MULTILINE)
    assert headings == available_encodings()
    for name in headings:
        section = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        assert encoding_class(name).description.replace("``", "`") in section
        for field in ("Stages", "Backends", "KV cache", "torch.compile", "Hugging Face models", "Export",
                      "Learnable parameters"):
            assert f"**{field}:**" in section, (name, field)
        for p in inspect.signature(encoding_class(name).__init__).parameters.values():
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                assert f"| `{p.name}` |" in section, (name, p.name)
    fire = text.split("\n## fire\n", 1)[1].split("\n## ", 1)[0]
    assert "FIRE-S" in fire and "share_across_layers=False" in fire  # the default departs from the paper


@pytest.mark.parametrize("name,values", [("fox", ("N(0, 0.02)", "bias 0")), ("fire", ("0.1", "512")),
                                         ("cope", ("zeros",))])
def test_catalogue_cites_the_papers_initialization(name, values):
    """The encodings whose initialization the task comparisons depend on state it, with its source,
    in their catalogue entry."""
    text = (ROOT / "docs" / "reference" / "encodings.md").read_text()
    entry = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
    (line,) = [ln for ln in entry.splitlines() if ln.startswith("- **Initialization:**")]
    assert all(v in line for v in values) and ("listing" in line or "reference code" in line), line


def test_catalogue_entries_have_no_restructuredtext():
    """The catalogue is Markdown: no reST markup left from the docstrings it quotes (``double
    backticks``, roles such as :math:`x`, ``.. `` directives, ``::`` literal-block markers), outside
    its fenced code blocks."""
    text = (ROOT / "docs" / "reference" / "encodings.md").read_text()
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.MULTILINE | re.DOTALL)
    for name in re.findall(r"^## (\S+)$", text, re.MULTILINE):
        section = prose.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        bad = [line for line in section.splitlines()
               if "``" in line or re.search(r":(?:math|class|func|meth|attr|mod):`", line)
               or line.lstrip().startswith(".. ") or line.rstrip().endswith("::")]
        assert bad == [], (name, bad)
    clex = text.split("\n## clex\n", 1)[1].split("\n## ", 1)[0]
    assert "```text\ndz/dt = W_down" in clex  # the reST literal block, now a fenced block


def test_docstring_examples_use_the_examples_section():
    """mkdocstrings (griffe, Google style) renders an ``Examples:`` section as code; an ``Example:``
    section is an admonition of Markdown, where ``>>>`` lines become nested quotes."""
    bad = [f"{p.relative_to(ROOT)}:{i + 1}" for p in sorted((ROOT / "posenc_lightning").rglob("*.py"))
           for i, line in enumerate(p.read_text().splitlines()) if line.strip() == "Example:"]
    assert bad == []


# ----------------------------------------------------------------------------------- docstrings
def _args_section(doc: str) -> str | None:
    m = re.search(rf"^Args:\s*$(.*?)(?=^{SECTIONS}\s*$|\Z)", doc, re.MULTILINE | re.DOTALL)
    return m.group(1) if m else None


def _params(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _check(qualname: str, fn, doc: str, function: bool) -> list[str]:
    if not doc.strip():
        return [f"{qualname}: no docstring"]
    out = []
    params = _params(fn) if fn is not None else []
    if params:
        section = _args_section(doc)
        if section is None:
            return [f"{qualname}: no Args: section (for {', '.join(params)})"]
        missing = [p for p in params if not re.search(rf"^\s+{p}\b", section, re.MULTILINE)]
        if missing:
            out.append(f"{qualname}: Args: does not describe {missing}")
    if function and fn is not None:
        ret = inspect.signature(fn).return_annotation
        if ret not in (None, "None", inspect.Signature.empty) and not re.search(r"^Returns:", doc, re.MULTILINE):
            out.append(f"{qualname}: returns {ret} but has no Returns: section")
    return out


def _own_methods(cls: type):
    """Public methods first defined in this package (an override is documented where it is declared)."""
    for name, member in vars(cls).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        if any(name in vars(base) for base in cls.__mro__[1:]):
            continue
        yield name, member


def undocumented() -> list[str]:
    """Every gap in the docstrings of ``posenc_lightning.__all__``: the names, their constructor
    arguments and the public methods their classes declare."""
    out = []
    for name in posenc_lightning.__all__:
        obj = getattr(posenc_lightning, name)
        if inspect.isclass(obj):
            init = vars(obj).get("__init__")
            doc = (inspect.getdoc(obj) or "") + "\n" + inspect.cleandoc(getattr(init, "__doc__", None) or "")
            out += _check(name, init, doc, function=False)
            for mname, member in _own_methods(obj):
                out += _check(f"{name}.{mname}", member, inspect.getdoc(member) or "", function=True)
        else:
            out += _check(name, obj, inspect.getdoc(obj) or "", function=True)
    return out


def test_every_public_name_is_documented_with_google_sections():
    gaps = undocumented()
    assert not gaps, "\n".join(gaps)


def test_the_docstring_check_catches_a_gap():
    def documented(x: int) -> int:
        """Double.

        Args:
            x: the number.

        Returns:
            ``2 * x``.
        """
        return 2 * x

    def undocumented_arg(x: int, y: int) -> int:
        """Sum.

        Args:
            x: the first.
        """
        return x + y

    assert _check("documented", documented, inspect.getdoc(documented), True) == []
    assert _check("f", undocumented_arg, inspect.getdoc(undocumented_arg), True) == [
        "f: Args: does not describe ['y']", "f: returns int but has no Returns: section"]


# ------------------------------------------------------------------------------------ the site
def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed (pip install -e '.[docs]')")
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "encodings" / "index.html").exists()
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "PosEncCallback" in api and "share_across_layers" in api  # mkdocstrings rendered the docstrings
    # every Examples section is a code block (<pre><code>), never run-together text in nested quotes
    sections = api.split('<span class="doc-section-title">Examples:</span>')[1:]
    assert len(sections) >= 3
    for after in sections:
        assert re.match(r"\s*</p>\s*<div class=\"highlight\"><pre><span></span><code>", after), after[:300]
    assert "<blockquote>" not in api
    code = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<pre>(.*?)</pre>", api, re.DOTALL)]
    assert any('enc = inject(TinyGPT(d_model=32, n_layers=1, n_heads=2), "alibi")' in c.replace("&quot;", '"')
               for c in code)
    catalogue = (tmp_path / "site" / "reference" / "encodings" / "index.html").read_text()
    assert "``" not in catalogue and "::\n" not in catalogue
    assert any("dz/dt = W_down" in re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<pre>(.*?)</pre>", catalogue, re.DOTALL))
