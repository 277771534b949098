"""A bounded load test of the HTTP server on loopback: C concurrent clients send R requests in
all (OpenAI completions, streaming off), then it stops. Reports requests/s, output tokens/s and
latency percentiles.

    python benchmarks/bench_serve.py --model demo --concurrency 1 4 16 64 --requests 48 --max-tokens 32
    python benchmarks/bench_serve.py --preset qwen3-30b-a3b --strategy offload --expert-gb 16 --dtype bfloat16 \
        --concurrency 1 4 16 --resize 800 2400 1695

`--preset` builds a named shape with seeded random weights (no checkpoint). `--resize N ...`
first times `rebuild_cache(expert_slots=N)` on the idle server for each N (validation, compile of
the new geometry, reallocation), and checks that a greedy request gives the same text before
and after each resize.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
import urllib.request

import numpy as np

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.bench.compare import table
from freetoken_jax.scheduler.scheduler import Scheduler
from freetoken_jax.server.http import serve_http
from freetoken_jax.server.service import Service


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def run(url: str, concurrency: int, total: int, max_tokens: int) -> dict:
    lat, toks, lock = [], [], threading.Lock()
    counter = iter(range(total))

    def client():
        for i in counter:
            t = time.perf_counter()
            r = post(
                url + "/v1/completions",
                # token ids: presets have random weights and no tokenizer
                {"prompt": [3 + (i * 7 + j * 13) % 250 for j in range(12)], "max_tokens": max_tokens, "temperature": 0.8, "seed": i},
            )
            with lock:
                lat.append(time.perf_counter() - t)
                toks.append(r["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return dict(concurrency=concurrency, requests=total, seconds=wall, requests_per_s=total / wall, output_tokens_per_s=sum(toks) / wall,
                p50_ms=float(np.percentile(lat, 50) * 1e3), p99_ms=float(np.percentile(lat, 99) * 1e3))  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", default="demo")
    src.add_argument("--preset", default=None, help="a named shape with seeded random weights (freetoken_jax.bench.presets)")
    ap.add_argument("--layers", type=int, default=None, help="keep only a preset's first layers")
    ap.add_argument("--expert-gb", type=float, default=None, help="expert slot budget for offload / hybrid (GB)")
    ap.add_argument("--resize", type=int, nargs="*", default=[], help="expert slot counts to resize to, in turn, before the load test")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-running", type=int, default=None, help="EngineConfig.max_running (default: the scheduler's own limit)")
    ap.add_argument("--strategy", default="fused")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    ecfg = EngineConfig(dtype=args.dtype, max_context=256, max_batch=args.max_batch, moe_strategy=args.strategy,
                        max_running=args.max_running)  # fmt: skip
    if args.preset:
        from freetoken_jax.bench.presets import preset_config

        cfg = preset_config(args.preset)
        if args.layers is not None:
            cfg = dataclasses.replace(cfg, num_layers=args.layers, moe_layers=cfg.moe_layers[: args.layers])
        if args.expert_gb is not None:
            ecfg = ecfg.replace(expert_slots=max(args.max_batch * cfg.top_k, int(args.expert_gb * 1e9 // (cfg.expert_params * 2))))
        engine = FreeTokenEngine(cfg, ecfg)
    else:
        engine = FreeTokenEngine.from_pretrained(args.model, ecfg)
    sched = Scheduler(engine, max_queue=4 * args.requests)
    httpd = serve_http(Service(sched, "m", engine.model_path), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    rows, resizes = [], []

    def save() -> None:  # after every figure, so a run cut short keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(argv=sys.argv, load=rows, resize=resizes), f, indent=1, default=str)

    probe = dict(model="m", prompt=[5, 9, 14, 77, 31], max_tokens=16, temperature=0)
    before = post(url + "/v1/completions", probe)["choices"][0]["text"]
    for n in args.resize:
        t = time.perf_counter()
        status = sched.rebuild_cache(expert_slots=n, drain=True)
        dt = time.perf_counter() - t
        after = post(url + "/v1/completions", probe)["choices"][0]["text"]
        resizes.append(dict(expert_slots=n, seconds=dt, same_output=after == before, status=status))
        print(json.dumps(resizes[-1], default=str), flush=True)
        save()
    for c in args.concurrency:
        run(url, c, 2 * c, args.max_tokens)  # compiles the batch sizes this concurrency reaches, unmeasured
        rows.append(run(url, c, args.requests, args.max_tokens))
        print(json.dumps(rows[-1]), flush=True)
        save()
    httpd.shutdown()
    sched.shutdown()
    cols = [("concurrency", "clients", "d"), ("requests_per_s", "req/s", ".2f"), ("output_tokens_per_s", "tok/s", ".1f"),
            ("p50_ms", "p50 ms", ".0f"), ("p99_ms", "p99 ms", ".0f")]  # fmt: skip
    print("\n" + table(rows, cols))
    for r in resizes:
        print(f"resize to {r['expert_slots']} slots: {r['seconds']:.2f} s, same output: {r['same_output']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
