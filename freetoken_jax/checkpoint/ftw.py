"""FTW: the engine's checkpoint format (specified in docs/FTW.md).

A directory holds `freetoken_weight.json` (the index) and shards `freetoken-NNNNN.ftw`. Every
shard starts with a 4096-byte header (magic, version, shard number); every tensor starts at a
4096-byte offset and is padded to 4096 bytes; a tensor may continue in the next shard. Dense
weights are kind `weight`, a MoE layer's stacked experts of one projection are kind
`experts_bank` ([E, ...], one contiguous run), so each consumer reads only what it needs.

Writing streams tensor by tensor into `<dst>.partial/` and renames it into place only once the
index is written and synced: an interrupted or failed write never leaves a directory that looks
valid. Reading uses several threads of chunked `preadv` on an `O_DIRECT` descriptor into
4096-aligned buffers (short reads looped), and falls back to `mmap` with sequential advice
where the filesystem refuses `O_DIRECT`.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from freetoken_jax.checkpoint.safetensors_io import _DTYPES, _NAMES, CheckpointError

MAGIC = b"FREETOKN"
VERSION = 1
ALIGN = 4096
INDEX = "freetoken_weight.json"
HEADER = struct.Struct("<8sIIQ")  # magic, version, shard number, payload bytes (after the header)
KINDS = ("weight", "experts_bank")


def shard_name(i: int) -> str:
    return f"freetoken-{i:05d}.ftw"


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned_empty(nbytes: int) -> np.ndarray:
    """A uint8 buffer of at least `nbytes` (rounded up to 4096) starting at a 4096-byte address."""
    size = _pad(max(nbytes, 1))
    raw = np.empty(size + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start : start + size]


class FTWWriter:
    """Streams tensors into a new FTW directory. Use as a context manager; `add` each tensor."""

    def __init__(self, path: str, *, shard_bytes: int = 8 << 30, metadata: dict | None = None):
        if shard_bytes < 2 * ALIGN or shard_bytes % ALIGN:
            raise ValueError(f"shard_bytes must be a multiple of {ALIGN} and at least {2 * ALIGN}")
        self.path, self.shard_bytes = os.path.abspath(path), shard_bytes
        self.tmp = self.path + ".partial"
        if os.path.exists(self.path):
            raise CheckpointError(f"{self.path} exists; remove it or choose another destination")
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)
        self.metadata = dict(metadata or {})
        self.tensors: dict[str, dict] = {}
        self.shards: list[int] = []
        self._f = None
        self._open_shard()

    def _open_shard(self) -> None:
        if self._f is not None:
            self._close_shard()
        self._f = open(os.path.join(self.tmp, shard_name(len(self.shards))), "wb")
        self._f.write(HEADER.pack(MAGIC, VERSION, len(self.shards), 0).ljust(ALIGN, b"\0"))
        self.shards.append(ALIGN)

    def _close_shard(self) -> None:
        f, i = self._f, len(self.shards) - 1
        f.seek(0)
        f.write(HEADER.pack(MAGIC, VERSION, i, self.shards[i] - ALIGN))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._f = None

    def add(self, name: str, array: np.ndarray, kind: str = "weight", **extra) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}")
        if name in self.tensors:
            raise ValueError(f"tensor {name} written twice")
        a = np.require(array, requirements="C")  # (ascontiguousarray would make a 0-d array 1-d)
        if a.dtype not in _NAMES:
            raise CheckpointError(f"{name}: dtype {a.dtype} cannot be stored")
        data = memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
        segments, done = [], 0
        while True:
            room = self.shard_bytes - self.shards[-1]
            if room < ALIGN:
                self._open_shard()
                continue
            n = min(len(data) - done, room)
            offset = self.shards[-1]
            self._f.write(data[done : done + n])
            self._f.write(b"\0" * (_pad(n) - n))
            self.shards[-1] += _pad(n)
            segments.append({"shard": len(self.shards) - 1, "offset": offset, "bytes": n})
            done += n
            if done >= len(data):
                break
        self.tensors[name] = dict(
            kind=kind, dtype=_NAMES[a.dtype], shape=list(a.shape), nbytes=len(data), crc32=zlib.crc32(data), segments=segments, **extra
        )

    def close(self) -> str:
        self._close_shard()
        index = dict(format="freetoken-ftw", version=VERSION, complete=True, shards=[{"file": shard_name(i), "bytes": b} for i, b in enumerate(self.shards)],
                     tensors=self.tensors, **self.metadata)  # fmt: skip
        ip = os.path.join(self.tmp, INDEX)
        with open(ip, "w") as f:
            json.dump(index, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.rename(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> FTWWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def is_ftw(path: str) -> bool:
    return os.path.isfile(os.path.join(path, INDEX))


class FTWReader:
    """Reads an FTW directory: validates the index and every shard's header and size up front."""

    def __init__(self, path: str, *, direct: bool = True, threads: int = 8, chunk_bytes: int = 16 << 20, verify: bool = False):
        self.path, self.threads, self.chunk, self.verify = path, max(1, threads), max(ALIGN, chunk_bytes // ALIGN * ALIGN), verify
        ip = os.path.join(path, INDEX)
        try:
            with open(ip) as f:
                self.index = json.load(f)
        except FileNotFoundError as e:
            raise CheckpointError(f"{path}: no {INDEX}; not an FTW checkpoint (or an incomplete conversion)") from e
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{ip}: corrupt index: {e}") from e
        if self.index.get("format") != "freetoken-ftw":
            raise CheckpointError(f"{ip}: not an FTW index")
        if self.index.get("version") != VERSION:
            raise CheckpointError(f"{ip}: FTW version {self.index.get('version')} is not supported (this engine reads version {VERSION})")
        if not self.index.get("complete"):
            raise CheckpointError(f"{ip}: the checkpoint is marked incomplete (an interrupted conversion); convert again")
        self.tensors: dict[str, dict] = self.index["tensors"]
        self._fds: list[int] = []
        self._maps: list[mmap.mmap | None] = []
        self.direct_io = direct and hasattr(os, "O_DIRECT")
        for i, sh in enumerate(self.index["shards"]):
            fp = os.path.join(path, sh["file"])
            if not os.path.isfile(fp):
                raise CheckpointError(f"{path}: shard {sh['file']} is missing")
            size = os.path.getsize(fp)
            if size < sh["bytes"]:
                raise CheckpointError(f"{fp}: truncated: {size} bytes, the index expects {sh['bytes']}")
            with open(fp, "rb") as f:
                head = f.read(HEADER.size)
            magic, version, number, _ = HEADER.unpack(head) if len(head) == HEADER.size else (b"", 0, -1, 0)
            if magic != MAGIC:
                raise CheckpointError(f"{fp}: wrong magic {magic!r}; not an FTW shard")
            if version != VERSION or number != i:
                raise CheckpointError(f"{fp}: header says version {version}, shard {number}; expected version {VERSION}, shard {i}")
            self._fds.append(self._open(fp))
            self._maps.append(None)

    def _open(self, fp: str) -> int:
        if self.direct_io:
            try:
                return os.open(fp, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                self.direct_io = False  # the filesystem refuses O_DIRECT (tmpfs, some overlays)
        return os.open(fp, os.O_RDONLY)

    def close(self) -> None:
        for m in self._maps:
            if m is not None:
                m.close()
        for fd in self._fds:
            os.close(fd)
        self._fds, self._maps = [], []

    def __enter__(self) -> FTWReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def names(self, kinds: Iterable[str] | None = None) -> list[str]:
        kinds = set(kinds or KINDS)
        return [n for n, t in self.tensors.items() if t["kind"] in kinds]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def nbytes(self, kinds: Iterable[str] | None = None) -> int:
        return sum(self.tensors[n]["nbytes"] for n in self.names(kinds))

    def get(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor `name`, read into `out` (a uint8 buffer from `aligned_empty`) when given."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        t = self.tensors[name]
        dtype = np.dtype(_DTYPES[t["dtype"]])
        buf = out if out is not None and out.nbytes >= _pad(t["nbytes"]) else aligned_empty(t["nbytes"])
        pos = 0
        jobs = []
        for seg in t["segments"]:
            for off in range(0, seg["bytes"], self.chunk):
                n = min(self.chunk, seg["bytes"] - off)
                jobs.append((seg["shard"], seg["offset"] + off, pos + off, n))
            pos += seg["bytes"]
        if len(jobs) > 1 and self.threads > 1:
            with ThreadPoolExecutor(self.threads) as pool:
                list(pool.map(lambda j: self._read(buf, *j), jobs))
        else:
            for j in jobs:
                self._read(buf, *j)
        data = buf[: t["nbytes"]]
        if self.verify and zlib.crc32(data) != t["crc32"]:
            raise CheckpointError(f"{self.path}: checksum mismatch in tensor {name}; the checkpoint is corrupt")
        return data.view(dtype).reshape(t["shape"])

    def _read(self, buf: np.ndarray, shard: int, offset: int, dst: int, n: int) -> None:
        if self.direct_io:
            # O_DIRECT needs aligned offsets, lengths and addresses: every chunk starts on a 4096
            # boundary of the file and of `buf`, and reading the padding past `n` is harmless.
            want = _pad(n)
            view = memoryview(buf)[dst : dst + want]
            got = 0
            while got < want:
                r = os.preadv(self._fds[shard], [view[got:]], offset + got)
                if r <= 0:
                    if got >= n:
                        return
                    raise CheckpointError(f"{self.path}: shard {shard} ends at byte {offset + got}; truncated")
                got += r
            return
        if self._maps[shard] is None:
            m = mmap.mmap(self._fds[shard], 0, access=mmap.ACCESS_READ)
            if hasattr(m, "madvise"):
                m.madvise(mmap.MADV_SEQUENTIAL)
            self._maps[shard] = m
        m = self._maps[shard]
        if offset + n > len(m):
            raise CheckpointError(f"{self.path}: shard {shard} ends before byte {offset + n}; truncated")
        buf[dst : dst + n] = np.frombuffer(m, np.uint8, n, offset)

    def verify_all(self) -> None:
        """Reads every tensor and checks its checksum."""
        saved, self.verify = self.verify, True
        try:
            for n in self.tensors:
                self.get(n)
        finally:
            self.verify = saved
