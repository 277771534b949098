"""Strategy `auto` on a bench preset, as a server would start it: the profile `bench bw` wrote
decides the candidates, the engine's decode probe measures them, and the chosen strategy's
decode rate is then timed like a user's generation (the same 16-token prompt and 64 tokens as
`bench decode --prompt-len 16 --gen-len 64`) and routing (`--routing-skew`, uniform by default),
for comparison with `bench decode`'s rows of the same lease: over every decode step of the request
(`decode_tok_s`), and after the first quarter of the steps, at most 16, as `bench decode` times
its rows (`decode_tok_s_after_warmup`). Prints one JSON line.

    python benchmarks/auto_choice.py --preset qwen3-30b-a3b --layers 24 --slots-gb 16
"""

import argparse
import json
import time

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.bench.presets import preset_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--layers", type=int, default=None, help="keep the preset's first layers")
    ap.add_argument("--slots-gb", type=float, required=True, help="expert-slot budget (GB = 1e9)")
    ap.add_argument(
        "--vram-gb", type=float, default=None, help="the device budget (default: the slots and 4 GB): the experts must not fit it"
    )
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16, help="a long one shows the prefill chunk the engine chose at work (TTFT)")
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--expert-format", default="bf16", help="the experts' format (bench decode's --expert-format)")
    ap.add_argument("--routing-skew", type=float, default=0.0, help="Zipf exponent of the synthetic routing (bench decode's; 0: uniform)")
    a = ap.parse_args()
    cfg = preset_config(a.preset, a.layers or None)
    vram = a.vram_gb if a.vram_gb is not None else a.slots_gb + 4
    ecfg = EngineConfig(dtype="bfloat16", moe_strategy=a.strategy, expert_slots_gb=a.slots_gb, total_vram_gb=vram, max_batch=1,
                        max_context=max(a.max_context, a.prompt_len + a.gen_len + 16), prefix_cache=False, expert_format=a.expert_format)  # fmt: skip
    t0 = time.perf_counter()
    engine = FreeTokenEngine(cfg, ecfg, routing_skew=a.routing_skew)
    started = time.perf_counter() - t0
    prompt = [1 + i % (cfg.vocab_size - 1) for i in range(a.prompt_len)]
    list(engine.generate(prompt, max_new_tokens=8, ignore_eos=True))  # compiles the prefill of this prompt
    engine.batcher.reset_metrics()
    t1 = time.perf_counter()
    tokens = engine.generate(prompt, max_new_tokens=a.gen_len, ignore_eos=True)
    out = [next(tokens)]
    ttft = time.perf_counter() - t1
    at = []  # each later token's arrival
    for t in tokens:
        out.append(t)
        at.append(time.perf_counter())
    wall = time.perf_counter() - t1
    warm = min(16, a.gen_len // 4)  # as `bench decode` times its rows: after the first quarter, at most 16 steps
    after = (len(at) - 1 - warm) / (at[-1] - at[warm]) if len(at) > warm + 1 else None
    m = engine.get_metrics()
    print(json.dumps(dict(preset=a.preset, layers=cfg.num_layers, slots_gb=a.slots_gb, strategy=engine.engine_config.moe_strategy.value,
                          q=engine.engine_config.hybrid_q, reason=engine.strategy_reason, start_s=round(started, 1),
                          prefill_chunk=engine.engine_config.prefill_chunk, prompt_len=len(prompt), ttft_s=round(ttft, 3),
                          prefill_tok_s=round(len(prompt) / ttft, 1),
                          decode_tok_s=round(m["decode_tokens_per_second"], 2), wall_tok_s=round(len(out) / wall, 2),
                          decode_tok_s_after_warmup=after and round(after, 2))))  # fmt: skip


if __name__ == "__main__":
    main()
