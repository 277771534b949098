"""A small safetensors reader and writer on numpy (bfloat16 through ml_dtypes).

The reader memory-maps each file and checks every header entry against the file size, so a
truncated or corrupt file is reported by name before any tensor is used.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable, Mapping

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as it stands; the message names the file and the fault."""


class SafetensorsFile:
    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{path}: truncated (no safetensors header)")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8 or n > 100 << 20:
                    raise CheckpointError(f"{path}: header length {n} exceeds the file ({size} bytes); truncated or not safetensors")
                header = json.loads(f.read(n))
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: cannot read safetensors header: {e}") from e
        header.pop("__metadata__", None)
        self._base = 8 + n
        self.entries = {}
        for name, e in header.items():
            start, end = e["data_offsets"]
            if e["dtype"] not in _DTYPES:
                raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {e['dtype']}")
            want = int(np.prod(e["shape"], dtype=np.int64)) * np.dtype(_DTYPES[e["dtype"]]).itemsize
            if end - start != want or self._base + end > size:
                raise CheckpointError(
                    f"{path}: tensor {name} needs bytes {start}..{end} of the data section but the file "
                    f"holds {size - self._base}; the file is truncated or corrupt"
                )
            self.entries[name] = (e["dtype"], tuple(e["shape"]), start, end)

    def keys(self) -> Iterable[str]:
        return self.entries.keys()

    def get(self, name: str) -> np.ndarray:
        dtype, shape, start, end = self.entries[name]
        buf = np.frombuffer(self._mm, dtype=_DTYPES[dtype], count=int(np.prod(shape, dtype=np.int64)), offset=self._base + start)
        return buf.reshape(shape)


class SafetensorsDir:
    """All `*.safetensors` files of a checkpoint directory (one file, or shards with an index)."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index: {e}") from e
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files")
        self.where: dict[str, SafetensorsFile] = {}
        for fname in files:
            fp = os.path.join(path, fname)
            if not os.path.isfile(fp):
                raise CheckpointError(f"{path}: the index names {fname}, which is missing")
            sf = SafetensorsFile(fp)
            for k in sf.keys():
                self.where[k] = sf

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        return self.where[name].get(name)


def save_file(tensors: Mapping[str, np.ndarray], path: str) -> None:
    header, offset = {}, 0
    for name, a in tensors.items():
        nbytes = a.size * a.itemsize
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())
    os.replace(tmp, path)
