"""Checkpoint load throughput: FTW against safetensors and against the disk's raw sequential read
bandwidth, all on the same files in one run, each read with the page cache dropped first.

    python benchmarks/bench_load.py --gib 4 --dir /path/on/the/disk

- raw: `dd iflag=direct bs=16M` over the FTW shards, one after another and all at once; the
  larger of the two is the bound;
- ftw: `FTWReader` (threads × O_DIRECT preadv into an aligned buffer) over every tensor;
- safetensors: `safetensors.numpy.load_file` of the same tensors in one safetensors file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np

from freetoken_jax.checkpoint.ftw import FTWReader, FTWWriter, aligned_empty
from freetoken_jax.checkpoint.safetensors_io import save_file


def drop_cache(paths: list[str]) -> str:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return "fadvise"


def files_in(d: str) -> list[str]:
    return sorted(os.path.join(d, f) for f in os.listdir(d))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--dir", default="/tmp/freetoken-bench-load")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    tensor_bytes = 128 << 20
    n = max(1, int(args.gib * (1 << 30)) // tensor_bytes)
    rng = np.random.default_rng(0)
    block = rng.standard_normal(tensor_bytes // 2, dtype=np.float32).astype(np.float16)
    tensors = {f"layers/{i}/mlp/experts/gate": block for i in range(n)}
    t = time.perf_counter()
    with FTWWriter(os.path.join(args.dir, "ftw"), shard_bytes=1 << 30) as w:
        for k, v in tensors.items():
            w.add(k, v, "experts_bank")
    save_file(tensors, os.path.join(args.dir, "model.safetensors"))
    total = n * tensor_bytes
    print(f"wrote {total / 1e9:.2f} GB twice in {time.perf_counter() - t:.0f} s", flush=True)
    ftw_files = [f for f in files_in(os.path.join(args.dir, "ftw")) if f.endswith(".ftw")]
    st_file = os.path.join(args.dir, "model.safetensors")
    res = dict(bytes=total, threads=args.threads)
    # raw sequential read of the same bytes
    how = drop_cache(ftw_files + [st_file])
    t = time.perf_counter()
    for f in ftw_files:
        out = subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"], capture_output=True, text=True)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return 1
    res["raw_gb_s"] = sum(os.path.getsize(f) for f in ftw_files) / (time.perf_counter() - t) / 1e9
    # the same, one dd per shard at once (what the disk gives several readers)
    drop_cache(ftw_files)
    t = time.perf_counter()
    procs = [subprocess.Popen(["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"], stderr=subprocess.DEVNULL) for f in ftw_files]
    if any(p.wait() for p in procs):
        return 1
    res["raw_parallel_gb_s"] = sum(os.path.getsize(f) for f in ftw_files) / (time.perf_counter() - t) / 1e9
    # FTW
    drop_cache(ftw_files)
    t = time.perf_counter()
    with FTWReader(os.path.join(args.dir, "ftw"), threads=args.threads) as r:
        buf = aligned_empty(tensor_bytes)
        for k in tensors:
            r.get(k, out=buf)
        res["ftw_direct_io"] = r.direct_io
    res["ftw_gb_s"] = total / (time.perf_counter() - t) / 1e9
    # safetensors
    drop_cache([st_file])
    from safetensors.numpy import load_file

    t = time.perf_counter()
    loaded = load_file(st_file)
    res["safetensors_gb_s"] = total / (time.perf_counter() - t) / 1e9
    del loaded
    res["cache_drop"] = how
    res["ftw_over_raw"] = res["ftw_gb_s"] / max(res["raw_gb_s"], res["raw_parallel_gb_s"])
    res["ftw_over_safetensors"] = res["ftw_gb_s"] / res["safetensors_gb_s"]
    dd = subprocess.run(["df", "-h", args.dir], capture_output=True, text=True).stdout.splitlines()[-1]
    res["filesystem"] = re.sub(r"\s+", " ", dd)
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
