"""Read a GGUF file's rope keys, or add keys and float32 tensors to it, with llama.cpp's own ``gguf-py``.

Run as a script by `posenc_lightning.models.gguf_export`, in a subprocess whose ``PYTHONPATH`` holds
the pinned llama.cpp source's ``gguf-py`` (so the reader and writer are the converter's own, whatever
``gguf`` package is installed); it imports nothing of posenc_lightning:

- ``python gguf_tool.py read FILE``: prints ``{"keys": {name: value}, "tensors": {name: {...}}}`` as
  JSON (arrays of more than 512 items as their length; the ``rope_*`` tensors with their values);
- ``python gguf_tool.py add FILE SPEC``: rewrites FILE with the keys and tensors of the JSON file SPEC
  added (``{"float32": {key: value}, "uint32": {key: value}, "tensors": {name: [values]}}``), every
  other key and tensor copied as gguf-py's ``gguf_new_metadata`` script copies them.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

_ARRAY_LIMIT = 512


def _value(field: Any) -> Any:
    contents = field.contents()
    if isinstance(contents, list) and len(contents) > _ARRAY_LIMIT:
        return {"array_length": len(contents)}
    return contents


def read(path: str) -> dict[str, Any]:
    """The keys (``GGUF.*`` header fields left out) and tensors of the GGUF file at ``path``."""
    import gguf

    reader = gguf.GGUFReader(path)
    keys = {name: _value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {}
    for t in reader.tensors:
        entry: dict[str, Any] = {"shape": [int(n) for n in t.shape], "type": t.tensor_type.name}
        if t.name.startswith("rope_"):
            entry["values"] = [float(v) for v in t.data.reshape(-1)]
        tensors[t.name] = entry
    return {"keys": keys, "tensors": tensors}


def add(path: str, spec: dict[str, Any]) -> None:
    """Rewrite ``path`` with ``spec``'s keys and float32 tensors added (see the module docstring)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    tmp = path + ".tmp"
    writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    new_keys = {**{k: (float(v), gguf.GGUFValueType.FLOAT32) for k, v in spec.get("float32", {}).items()},
                **{k: (int(v), gguf.GGUFValueType.UINT32) for k, v in spec.get("uint32", {}).items()}}
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.") or field.name in new_keys:
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    for key, (value, val_type) in new_keys.items():
        writer.add_key_value(key, value, val_type)
    extra = {name: np.asarray(values, dtype=np.float32) for name, values in spec.get("tensors", {}).items()}
    old = [t for t in reader.tensors if t.name not in extra]
    for t in old:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    for name, data in extra.items():
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in old:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    for data in extra.values():
        writer.write_tensor_data(data)
    writer.close()
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "read":
        print(json.dumps(read(argv[1]), default=str))
        return 0
    if len(argv) == 3 and argv[0] == "add":
        with open(argv[2], encoding="utf-8") as f:
            add(argv[1], json.load(f))
        return 0
    print("usage: gguf_tool.py read FILE | add FILE SPEC", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
