"""Checks ``posenc train`` runs on its arguments before it imports Lightning (seconds) or builds a
Trainer (which creates the run directory): a misspelt encoding name or encoding argument fails at
once, in one line, with nothing written.

Only the encoding registry is imported (torch, no Lightning). The options read are the ones that
name the encoding: ``--posenc.encoding`` (and its short form ``--encoding``), ``--posenc.config``
(a YAML/JSON mapping), ``--posenc.config.KEY``, and ``posenc: {encoding, config}`` in a
``--config`` / ``-c`` file, in command-line order (the last one wins, as in LightningCLI)."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def check_encoding_args(name: str, config: dict[str, Any] | None = None) -> None:
    """Raise if ``name`` is not a registered encoding or preset or ``config`` holds an argument it does not take.

    Args:
        name: a registered encoding name (``posenc list``) or a preset's.
        config: the encoding's arguments (keys are checked, values are not).

    Raises:
        ValueError: an unknown name (the message suggests close ones) or an unknown argument (the
            message names it, suggests close ones and lists the arguments the encoding takes).
    """
    from posenc_lightning.encodings.presets import PRESETS
    from posenc_lightning.encodings.registry import encoding_class

    # a preset (a layer schedule by name) takes its own keywords; else ValueError: "Unknown encoding
    # 'firee'. Did you mean 'fire', ...?"
    params = inspect.signature(PRESETS[name] if name in PRESETS else encoding_class(name).__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    valid = [p for p in params if p != "self"]
    for key in sorted(set(config or {}) - set(valid)):
        close = difflib.get_close_matches(key, valid, n=2)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"{name} takes no argument {key!r}.{hint} It takes: {', '.join(valid)}.")


def _load_yaml(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def _value(args: Sequence[str], i: int) -> tuple[str | None, int]:
    """The value of the option at ``args[i]`` (``--k=v`` or ``--k v``) and the index after it."""
    _, eq, val = args[i].partition("=")
    if eq:
        return val, i + 1
    return (args[i + 1], i + 2) if i + 1 < len(args) else (None, i + 1)


def encoding_from_args(args: Sequence[str]) -> tuple[Any, dict[str, Any] | None]:
    """The encoding (a name, or whatever else was given) and its config that ``posenc train ARGS`` would use.

    Args:
        args: the arguments after ``posenc train``.

    Returns:
        ``(encoding, config)``; ``encoding`` is ``"rope"`` (the default) when no option names one.
    """
    encoding: Any = "rope"
    config: dict[str, Any] | None = None
    i = 0
    while i < len(args):
        key = args[i].partition("=")[0]
        if key in ("--posenc.encoding", "--encoding"):
            encoding, i = _value(args, i)
        elif key == "--posenc.config":
            text, i = _value(args, i)
            loaded = _load_yaml(text) if text is not None else None
            config = loaded if isinstance(loaded, dict) or loaded is None else config
        elif key.startswith("--posenc.config."):
            _, i = _value(args, i)
            config = {**(config or {}), key[len("--posenc.config."):]: None}
        elif key in ("--config", "-c"):
            path, i = _value(args, i)
            data = _load_yaml(Path(path).read_text()) if path and Path(path).is_file() else None
            posenc = data.get("posenc") if isinstance(data, dict) else None
            if isinstance(posenc, dict):
                posenc = posenc.get("init_args", posenc)
                encoding = posenc.get("encoding", encoding)
                config = posenc.get("config", config)
        else:
            i += 1
    return encoding, config


def precheck_train(args: Sequence[str]) -> str | None:
    """The one-line error ``posenc train ARGS`` would end in because of its encoding options, or None.

    Args:
        args: the arguments after ``posenc train``.

    Returns:
        ``"--posenc.encoding: Unknown encoding 'firee'. Did you mean 'fire', ...?"`` and the like; None
        when the encoding and its arguments exist, or the encoding is not given by name (a class path,
        a mapping: LightningCLI checks those).
    """
    import yaml

    try:
        encoding, config = encoding_from_args(args)
    except (OSError, ValueError, AttributeError, yaml.YAMLError):  # unreadable: LightningCLI's parser says why
        return None
    if not isinstance(encoding, str) or "." in encoding or encoding.startswith("{") or "${" in encoding:
        return None  # a class path, a mapping or an OmegaConf interpolation: LightningCLI resolves it
    try:
        check_encoding_args(encoding, config if isinstance(config, dict) else None)
    except ValueError as err:
        option = "--posenc.encoding" if str(err).startswith("Unknown encoding") else "--posenc.config"
        return f"{option}: {err}"
    return None
