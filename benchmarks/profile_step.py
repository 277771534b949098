"""Kernel-level profile of the jitted decode step on the GPU (CUPTI through torch.profiler):
for each expert implementation and batch size, the
wall time per step, kernels launched per step, summed kernel time and the heaviest kernels.

    python benchmarks/profile_step.py --preset qwen3-30b-a3b --batch 1 8 --variants gather slices ragged

With `--strategies`, the same for host-bank strategies (experts in host RAM, as `bench decode`
builds them): offload, hybrid, naive, cpu at `--slots-gb` of slots and `--routing-skew`; the
steps run after `--warm` steps so the slot cache is in its steady state. Where wall time per
step exceeds summed kernel time, the stream sat idle (launch gaps, host functions, copies).

    python benchmarks/profile_step.py --preset qwen3-30b-a3b --strategies offload hybrid --slots-gb 16 --routing-skew 0

With `--prefill-tokens N`, one offload prefill chunk of N tokens through two borrowed layer
buffers, loading layers by `--prefill-load`, for each expert implementation in `--variants`:

    python benchmarks/profile_step.py --preset qwen3-30b-a3b --prefill-tokens 512 --slots-gb 16 --variants auto dense

`--pgle` compiles each prefill chunk again with a profile of its own runs, as jax's automatic PGLE
would for a jitted call (the engine compiles ahead of time), and times that too: XLA's scheduler
then knows how long each copy takes. `--no-profile` runs everything but the CUPTI profile (for a
machine without CUDA).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from freetoken_jax import EngineConfig, FreeTokenEngine  # noqa: E402
from freetoken_jax.bench.expert_impls import named  # noqa: E402
from freetoken_jax.bench.measure import thread_times  # noqa: E402
from freetoken_jax.bench.presets import preset_config  # noqa: E402
from freetoken_jax.memory.kv_cache import init_cache  # noqa: E402
from freetoken_jax.runtime.experts import Fused  # noqa: E402
from freetoken_jax.runtime.runner import _traced  # noqa: E402
from freetoken_jax.runtime.steps import DecodeBatch, DecodeState, Sampling, decode_step_plain  # noqa: E402

TIMELINE = 0  # --timeline: how many events of the middle of the last profiled step to list in order


def kernel_profile(run, n=5, top=8):
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(n)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    agg: dict[str, list[float]] = {}
    for e in events:
        agg.setdefault(e.name[:80], []).append(e.device_time)
    rows = sorted(agg.items(), key=lambda kv: -sum(kv[1]))[:top]
    idle(events, n, top)
    copies = copy_spans(events)
    overlap(events, n, copies)
    exposed(events, n, top, copies)
    timeline(events, n)
    return len(events) / n, sum(e.device_time for e in events) / n / 1e3, [(sum(t) / n / 1e3, len(t) / n, k) for k, t in rows]


def idle(events, n: int, top: int, floor_us: float = 3.0) -> None:
    """Where the GPU sat idle: gaps of more than `floor_us` between the end of everything before
    and the next event's start (all streams merged), summed per step by the event that ends the
    gap and the one before it."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in events)
    if not spans:
        return
    gaps: dict[tuple, list[float]] = {}
    end, before = spans[0][1], spans[0][2]
    for s, e, name in spans[1:]:
        if s - end > floor_us:
            gaps.setdefault((before, name), []).append(s - end)
        if e > end:
            end, before = e, name
    total = sum(sum(g) for g in gaps.values()) / n / 1e3
    span = (max(e for _, e, _ in spans) - spans[0][0]) / n / 1e3
    print(f"   idle: {total:.3f} ms per step of {span:.3f} ms spanned (gaps over {floor_us:g} us), heaviest after -> before:")
    for (a, b), g in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"   {sum(g) / n / 1e3:7.3f} ms {len(g) / n:5.0f}x ({sum(g) / len(g):6.1f} us)  {a} -> {b}")


def _union(spans):
    """Sorted, merged [start, end) intervals of `spans`."""
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def _intersect(a, b) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def copy_spans(events):
    """The merged intervals during which some host->device copy was in flight."""
    return _union((e.time_range.start, e.time_range.end) for e in events if e.name.startswith("Memcpy HtoD"))


def overlap(events, n: int, copies) -> None:
    """How far host->device copies (`copy_spans`) and the other kernels run under each other, per
    step: the time each keeps the GPU busy (their intervals merged), both at once, and only one of
    them — a prefill that hides its compute under the copies has little "compute only"."""
    compute = _union((e.time_range.start, e.time_range.end) for e in events if not e.name.startswith("Memcpy"))
    if not copies or not compute:
        return
    c, k, both = _length(copies), _length(compute), _intersect(copies, compute)
    ms = lambda us: us / n / 1e3  # noqa: E731
    print(f"   host->device copies {ms(c):.3f} ms, compute {ms(k):.3f} ms a step; both at once {ms(both):.3f} ms, "
          f"copies only {ms(c - both):.3f} ms, compute only {ms(k - both):.3f} ms")  # fmt: skip


def exposed_time(events, copies=None) -> dict[str, float]:
    """Per kernel name, the time its kernels ran while no host->device copy was in flight (µs,
    summed): the compute a prefill's layer loads do not hide. `copies`: `copy_spans(events)`."""
    copies = copy_spans(events) if copies is None else copies
    out: dict[str, float] = {}
    for e in events:
        if e.name.startswith("Memcpy"):
            continue
        span = [[e.time_range.start, e.time_range.end]]
        out[e.name[:80]] = out.get(e.name[:80], 0.0) + _length(span) - _intersect(span, copies)
    return out


def exposed(events, n: int, top: int, copies) -> None:
    """The kernels that ran with no host->device copy (`copy_spans`) in flight, heaviest first,
    per step (only where the step copies anything)."""
    if not copies:
        return
    rows = sorted(((t, k) for k, t in exposed_time(events, copies).items() if t > 0), reverse=True)
    print(f"   kernel time outside the copies: {sum(t for t, _ in rows) / n / 1e3:.3f} ms a step, heaviest:")
    for t, k in rows[:top]:
        print(f"   {t / n / 1e3:7.3f} ms  {k}")


def timeline(events, n: int) -> None:
    """The last step's events from its middle on (`TIMELINE` of them), in time order: start
    relative to the first listed, duration and the gap before each, in µs (names match the HLO)."""
    if not TIMELINE:
        return
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:90]) for e in events)
    per = len(spans) // n
    step = spans[(n - 1) * per : n * per]
    part = step[per // 2 : per // 2 + TIMELINE]
    if not part:
        return
    t0, end = part[0][0], part[0][0]
    print(f"   timeline: {len(part)} events from the middle of the last step (start us, duration us, gap before us, name)")
    for s, e, name in part:
        print(f"   {s - t0:8.1f} {e - s:7.1f} {max(0.0, s - end):6.1f}  {name}")
        end = max(end, e)


def report(summary: list, B: int, name: str, wall: float, profile, compile_s: float) -> None:
    nk, ksum, top = profile if profile else (float("nan"), float("nan"), [])
    print(f"\n== B={B} {name}: {wall:.3f} ms/step wall, {nk:.0f} kernels/step, {ksum:.3f} ms summed kernel time, compile {compile_s:.0f} s")
    for ms, cnt, kname in top:
        print(f"   {ms:7.3f} ms {cnt:5.0f}x  {kname}")
    summary.append((B, name, wall, nk, ksum))


def host_bank_strategies(args) -> list:
    """Profiles the decode step of host-bank strategies as `bench decode` runs them (a runner of
    each variant's backend and geometry over one set of host banks)."""
    from freetoken_jax.bench import compare
    from freetoken_jax.bench.compare import Bench

    if args.handoff != "auto":
        compare.resolve_mode = lambda _: args.handoff
    bench = Bench(args.preset, dtype=args.dtype, max_batch=max(args.batch), max_context=256, layers=args.layers,
                  expert_format=args.expert_format)  # fmt: skip
    q = bench.bp / (bench.bp + bench.bh_hybrid)
    summary = []
    for B, s, sampling, order in [(B, s, m, o) for B in args.batch for s in args.strategies for m in args.sampling for o in args.token]:
        use_sampling(bench, sampling)
        if order == "first":  # the token as the step's first output, with the donated buffers it takes (`runner._token_last`)
            bench.steps.decode = jax.jit(_traced(decode_step_plain, args.dtype, {}), donate_argnums=(1,))
        runner = bench._runner(*bench.variant(s, q, args.routing_skew), B, bench._decode_slots(s, B, args.slots_gb))
        t = time.perf_counter()
        step, shapes = runner.decode_job()
        compiled = step.lower(*shapes).compile()
        compile_s = time.perf_counter() - t
        table = np.zeros((B, runner.engine_config.pages_per_sequence), np.int32)
        for b in range(B):
            pages = runner.pages.allocate(200)
            table[b, : len(pages)] = pages
        runner.set_rows(np.arange(B), jnp.arange(B, dtype=jnp.int32), np.full(B, 16))
        batch = DecodeBatch(jnp.asarray(table), jnp.ones((B,), bool), Sampling.greedy(B))
        calls = []

        def run(n, runner=runner, batch=batch, calls=calls):
            for _ in range(n):
                t = time.perf_counter()
                runner.decode(batch)
                calls.append(time.perf_counter() - t)
            runner.state.tokens_B.block_until_ready()

        run(args.warm)
        if args.addresses:
            moved_buffers(runner, batch)
        calls.clear()
        handoffs = handoff_stats()
        sched = thread_times()
        t = time.perf_counter()
        run(10)
        wall = (time.perf_counter() - t) / 10 * 1e3
        on_cpu, queued = (b - a for a, b in zip(sched, thread_times()))
        print(f"B={B} {s}: the calling thread per step: {on_cpu / 10 / 1e6:.3f} ms on a core, {queued / 10 / 1e6:.3f} ms runnable "
              f"but waiting for one, the rest of {wall:.3f} ms asleep")  # fmt: skip
        hs = handoffs()
        if hs["count"]:
            c = hs["count"]
            print(f"B={B} {s}: {c / 10:.0f} handoffs per step; per handoff window {hs['window_s'] / c * 1e6:.0f} us, GPU side "
                  f"{hs['gpu_s'] / c * 1e6:.0f} us, CPU side {hs['cpu_s'] / c * 1e6:.0f} us; outside the windows "
                  f"{wall - hs['window_s'] / 10 * 1e3:.3f} ms per step")  # fmt: skip
        print(f"B={B} {s} sampling={sampling}: the call returns after {sorted(calls)[len(calls) // 2] * 1e3:.3f} ms (median)")
        if args.stacks:
            from native_stacks import sample

            sample(lambda: run(args.stacks), os.path.join(args.out, f"stacks_b{B}_{s}.txt"))
        profile = None if args.no_profile else kernel_profile(run, top=args.top)
        with open(os.path.join(args.out, f"decode_b{B}_{s}.hlo.txt"), "w") as f:
            f.write(compiled.as_text())
        runner.close()
        name = f"{s} {args.slots_gb:g}GB" if s in ("offload", "hybrid") else s
        name += " token first" if order == "first" else ""
        report(summary, B, name if sampling == "where" else f"{name} {sampling}", wall, profile, compile_s)
    use_sampling(bench, "where")
    return summary


def moved_buffers(runner, batch, steps: int = 4) -> None:
    """Which of the step's outputs land at another device address from one step to the next (a
    CUDA graph that captured the old address must be updated before it runs again)."""

    def addresses(tok):
        leaves = jax.tree_util.tree_flatten_with_path(runner.state)[0]
        out = {jax.tree_util.keystr(k): v.unsafe_buffer_pointer() for k, v in leaves if isinstance(v, jax.Array)}
        return out | {"tok": tok.unsafe_buffer_pointer()}

    seen = [addresses(runner.decode(batch)) for _ in range(steps)]
    runner.state.tokens_B.block_until_ready()
    moved = sorted({k for a, b in zip(seen, seen[1:]) for k in a if a[k] != b.get(k)})
    print(f"   outputs at a new address from step to step: {len(moved)} of {len(seen[0])}: {', '.join(moved[:12])}")


def handoff_stats():
    """Resets the C++ handoff counters and returns a function that reads them since."""
    from freetoken_jax import _cpu_ext

    _cpu_ext.handoff_stats(True)
    return lambda: _cpu_ext.handoff_stats(True)


def use_sampling(bench, how: str) -> None:
    """Retraces `bench`'s steps with the engine's decode sampler (`plain`: greedy or temperature,
    no sort of the vocabulary), with the sampler of top-k and top-p (`sort`: its sort computed at
    every step and each row selecting, as the decode step sampled before `plain`), with that
    sampler behind a `lax.cond` that takes argmax when no row samples (`cond`: the engine's
    sampler before it lost the conditional), or greedy only."""
    from freetoken_jax.runtime import sampling, steps
    from freetoken_jax.runtime.runner import StepSet

    def sample_plain(logits_BV, seeds_B, positions_B, temperature_B):
        B = logits_BV.shape[0]
        greedy = lambda: jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)  # noqa: E731
        sort = lambda: sampling.sample(logits_BV, seeds_B, positions_B, temperature_B, jnp.zeros(B, jnp.int32), jnp.ones(B))  # noqa: E731
        if how == "greedy":
            return greedy()
        if how == "cond":
            return jax.lax.cond(jnp.any(temperature_B > 0), sort, greedy)
        if how == "sort":
            return sort()
        return sampling.sample_plain(logits_BV, seeds_B, positions_B, temperature_B)

    steps.sample_plain = sample_plain
    bench.steps = StepSet(bench.ecfg.dtype)  # fresh jitted functions: traced with this sampler


def prefill_chunk(args) -> list:
    """Profiles one prefill chunk of `--prefill-tokens` tokens under offload with `--slots-gb` of
    slots through two borrowed layer buffers, each layer's missing experts fetched by the Pallas
    kernel or copied whole (`--prefill-load`), for each expert implementation of `--variants`
    (`auto`: the engine's choice, `dense` at this size; `ragged`: grouped matmuls), the experts
    routed by `--routing-skew` (synthetic routing: a preset's random router sends most tokens
    to a few experts); writes each compiled step's HLO beside the profile."""
    from freetoken_jax.bench.compare import Bench
    from freetoken_jax.memory.kv_cache import init_cache
    from freetoken_jax.memory.slot_cache import init_slot_cache
    from freetoken_jax.runtime.bank_copy import carried
    from freetoken_jax.runtime.experts import Offload
    from freetoken_jax.runtime.routing import SyntheticRouting
    from freetoken_jax.runtime.steps import PrefillBatch, on_device, prefill_step_buffered

    T = args.prefill_tokens
    bench = Bench(args.preset, dtype=args.dtype, max_batch=1, max_context=T + 32, prefill_chunk=T, layers=args.layers,
                  expert_format=args.expert_format)  # fmt: skip
    cfg, ecfg, summary = bench.cfg, bench.ecfg, []
    load = bench.ecfg.prefill_load if args.prefill_load == "auto" else args.prefill_load  # "auto": as the engine resolved it
    weights, experts = bench.engine.weights, Offload(load, host_banks=carried(bench.views))
    n = bench.slots_for(args.slots_gb, 1)
    if experts.prefill_path(cfg, T, n) != "buffered":
        raise SystemExit(f"{n} slots at {args.slots_gb} GB: a {T}-token chunk would not take the buffered prefill")
    dtype = jnp.dtype(args.dtype)
    box = [on_device(init_cache(cfg, ecfg, dtype)), on_device(init_slot_cache(cfg, n, 1, dtype))]  # this profile's own state
    table = np.arange(1, ecfg.pages_per_sequence + 1, dtype=np.int32)[None]
    rng = np.random.default_rng(0)
    batch = PrefillBatch.chunk([rng.integers(0, cfg.vocab_size, T)], [0], table, T, Sampling.greedy(1))
    for impl in args.variants:
        step = jax.jit(lambda *a: prefill_step_buffered(*a), donate_argnums=(1, 3))  # a fresh trace per implementation
        backend = SyntheticRouting(dataclasses.replace(experts, compute=named(impl)), jnp.float32(args.routing_skew))
        pgle = None
        for tag in ("", "_pgle") if args.pgle else ("",):
            t = time.perf_counter()
            # (the profile's costs are read by the latency-hiding scheduler, switched on for that compile)
            options = {"fdo_profile": pgle, "xla_gpu_enable_latency_hiding_scheduler": True} if pgle else None
            compiled = step.lower(weights, box[0], batch, box[1], backend).compile(options)
            compile_s = time.perf_counter() - t
            with open(os.path.join(args.out, f"prefill_t{T}_{load}_{impl}{tag}.hlo.txt"), "w") as f:
                f.write(compiled.as_text())

            def run(k, compiled=compiled, backend=backend):
                tok = None
                for _ in range(k):
                    tok, box[0], box[1] = compiled(weights, box[0], batch, box[1], backend)
                tok.block_until_ready()

            run(1)
            t = time.perf_counter()
            run(3)
            wall = (time.perf_counter() - t) / 3 * 1e3
            if args.pgle and not tag:
                pgle = pgle_profile(run)  # before the CUPTI profile: one profiler at a time
            profile = None if args.no_profile else kernel_profile(run, n=2, top=args.top)
            report(summary, 1, f"prefill {T} {load} {impl}{tag.replace('_', ' ')}", wall, profile, compile_s)
    return summary


def pgle_profile(run) -> bytes:
    """A profile of three runs as XLA's latency-hiding scheduler reads it (`fdo_profile`: each
    instruction's measured time, the copies' among them), made as jax's automatic PGLE makes it:
    the trace's FDO profile, aggregated at the 90th percentile."""
    from jax._src import profiler
    from jax._src.lib import _profiler

    jax.profiler.start_trace(tempfile.mkdtemp())
    run(3)
    fdo = profiler.stop_and_get_fdo_profile()
    proto = _profiler.aggregate_profiled_instructions([fdo], 90) if fdo else b""
    proto = proto.encode() if isinstance(proto, str) else proto
    print(f"   PGLE profile: {len(fdo)} bytes from the trace, {len(proto)} aggregated, {proto.count(b'copy-start')} copy-start costs")
    return proto


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--variants", nargs="+", default=["auto"])
    ap.add_argument("--strategies", nargs="+", default=None, choices=["offload", "hybrid", "naive", "cpu"])
    ap.add_argument("--slots-gb", type=float, default=16.0)
    ap.add_argument("--routing-skew", type=float, default=0.0, help="Zipf exponent of the synthetic routing (0: uniform)")
    ap.add_argument("--warm", type=int, default=16, help="steps before timing (host-bank strategies)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--expert-format", default=None, help="the experts' format (bf16, q4_0, ...)")
    ap.add_argument("--layers", type=int, default=None, help="keep the preset's first layers")
    ap.add_argument("--no-profile", action="store_true", help="no CUPTI profile (wall time only)")
    ap.add_argument("--out", default=".")
    ap.add_argument("--sampling", nargs="+", default=["plain"], choices=["plain", "sort", "cond", "greedy"],
                    help="host-bank strategies: how the sampler picks greedy or stochastic (see use_sampling)")  # fmt: skip
    ap.add_argument("--token", nargs="+", default=["last"], choices=["last", "first"],
                    help="host-bank strategies: the decode step's sampled token as its last output (the engine's) or first")  # fmt: skip
    ap.add_argument("--handoff", default="auto", choices=["auto", "ffi", "ffi_nograph", "callback"], help="hybrid and cpu: the handoff")
    ap.add_argument("--stacks", type=int, default=0, metavar="N",
                    help="host-bank strategies: sample the calling thread's native stack over N more steps (benchmarks/native_stacks.py)")  # fmt: skip
    ap.add_argument("--addresses", action="store_true", help="host-bank strategies: list the outputs whose address moves")
    ap.add_argument("--top", type=int, default=12, help="how many of the heaviest kernels to list")
    ap.add_argument("--timeline", type=int, default=0, metavar="N", help="list N events of the last profiled step's middle in time order")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="profile one offload prefill chunk of this many tokens instead")
    ap.add_argument("--prefill-load", default="auto", choices=["auto", "fetch", "copy", "copy2"],
                    help="prefill: how layers come in (auto: as the engine resolves it from its memory plan)")  # fmt: skip
    ap.add_argument("--pgle", action="store_true",
                    help="prefill: compile the chunk again with a profile of its runs (XLA's profile-guided latency estimator) and time it too")  # fmt: skip
    args = ap.parse_args()
    global TIMELINE
    TIMELINE = args.timeline
    if args.strategies or args.prefill_tokens:
        summary = prefill_chunk(args) if args.prefill_tokens else host_bank_strategies(args)
        print(f"\n{'B':>3} {'strategy':>14} {'wall ms':>8} {'kernels':>8} {'kern ms':>8}")
        for B, v, wall, nk, ksum in summary:
            print(f"{B:>3} {v:>14} {wall:8.3f} {nk:8.0f} {ksum:8.3f}")
        return 0
    cfg = preset_config(args.preset, args.layers)
    Bmax = max(args.batch)
    ecfg = EngineConfig(dtype=args.dtype, max_context=256, max_batch=Bmax, page_size=16, expert_format=args.expert_format)
    engine = FreeTokenEngine(cfg, ecfg)
    engine.runner.close()  # the profile runs on a state of its own
    summary = []
    for B in args.batch:
        table = jnp.asarray(np.tile(np.arange(1, ecfg.pages_per_sequence + 1, dtype=np.int32), (B, 1)) + np.arange(B)[:, None] * 16)
        batch = DecodeBatch(table, jnp.ones((B,), bool), Sampling.greedy(B))
        for variant in args.variants:
            impl = variant
            if impl == "slices" and B * cfg.top_k > 16:
                continue
            step = jax.jit(functools.partial(decode_step_plain), donate_argnums=(1,))
            cache = init_cache(cfg, ecfg, jnp.dtype(args.dtype))
            state = DecodeState.start(cache, np.arange(B), np.full(B, 64))
            t = time.perf_counter()
            backend = Fused(named(impl))
            compiled = step.lower(engine.weights, state, batch, backend).compile()
            compile_s = time.perf_counter() - t
            with open(os.path.join(args.out, f"decode_b{B}_{impl}.hlo.txt"), "w") as f:
                f.write(compiled.as_text())
            box = [state]

            def run(n, box=box, compiled=compiled, batch=batch, experts=backend):
                tok = None
                for _ in range(n):
                    tok, box[0] = compiled(engine.weights, box[0], batch, experts)
                tok.block_until_ready()

            run(3)
            t = time.perf_counter()
            run(20)
            wall = (time.perf_counter() - t) / 20 * 1e3
            profile = None if args.no_profile else kernel_profile(run, top=args.top)
            report(summary, B, variant, wall, profile, compile_s)
    print(f"\n{'B':>3} {'variant':>14} {'wall ms':>8} {'kernels':>8} {'kern ms':>8}")
    for B, v, wall, nk, ksum in summary:
        print(f"{B:>3} {v:>14} {wall:8.3f} {nk:8.0f} {ksum:8.3f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    sys.exit(main())
