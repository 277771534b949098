"""Where the calling thread's native time goes: samples its stack (benchmarks/native/
stack_sampler.c, built here with cc) while `work()` runs and prints the symbols found on the most
samples (inclusive: a symbol counts once per sample it is on), symbolized with nm."""

from __future__ import annotations

import bisect
import collections
import ctypes
import os
import subprocess
import tempfile
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))


def _sampler() -> ctypes.CDLL:
    so = os.path.join(tempfile.gettempdir(), "freetoken_stack_sampler.so")
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", so, os.path.join(_HERE, "native", "stack_sampler.c")], check=True)
    lib = ctypes.CDLL(so)
    lib.stack_sampler_start.argtypes = [ctypes.c_int, ctypes.c_long]
    lib.stack_sampler_stop.argtypes = [ctypes.c_char_p]
    return lib


class _Symbols:
    def __init__(self):
        self.tables: dict[str, tuple[list[int], list[str]]] = {}

    def name(self, lib: str, offset: int) -> str:
        if lib not in self.tables:
            rows = {}
            for flags in (["-C"], ["-D", "-C"]):
                out = subprocess.run(["nm", *flags, "--defined-only", lib], capture_output=True, text=True).stdout
                for line in out.splitlines():
                    parts = line.split(" ", 2)
                    if len(parts) == 3 and parts[1] in "TtWw":
                        rows[int(parts[0], 16)] = parts[2]
            addrs = sorted(rows)
            self.tables[lib] = (addrs, [rows[a] for a in addrs])
        addrs, names = self.tables[lib]
        i = bisect.bisect_right(addrs, offset - 1) - 1  # a return address: the call is just before it
        base = os.path.basename(lib)
        return f"{base}:{names[i][:110]}" if i >= 0 else f"{base}+{offset:x}"


def sample(work, path: str, period_us: int = 500, top: int = 40) -> None:
    """Runs `work()` on this thread with its stack sampled every `period_us`; writes the raw
    samples to `path` and prints the `top` symbols by the share of samples they are on."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    lib = _sampler()
    if lib.stack_sampler_start(threading.get_native_id(), period_us):
        raise OSError("the stack sampler could not start")
    try:
        work()
    finally:
        n = lib.stack_sampler_stop(path.encode())
    if n < 0:
        raise OSError(f"the stack samples could not be written to {path}")
    syms, inclusive, leaf = _Symbols(), collections.Counter(), collections.Counter()
    with open(path) as f:
        for line in f:
            frames = []
            for fr in line.strip().split(";"):
                if fr:
                    lib_path, off = fr.rsplit(" ", 1)
                    frames.append(syms.name(lib_path, int(off, 16)) if lib_path != "?" else f"?{off}")
            if frames:
                leaf[frames[0]] += 1
                inclusive.update(set(frames))
    print(f"   native stack of the calling thread: {n} samples every {period_us} us")
    shown = [(k, c) for k, c in inclusive.most_common() if not k.startswith(("libpython", "python:", "libc.so.6:__libc"))]
    for name, c in shown[:top]:
        print(f"   {100 * c / max(n, 1):5.1f}%  {name}")
    print("   innermost frames:")
    for name, c in leaf.most_common(10):
        print(f"   {100 * c / max(n, 1):5.1f}%  {name}")
