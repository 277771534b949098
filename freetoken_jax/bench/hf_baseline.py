"""The transformers baseline of `bench decode --strategy transformers`: the same Hugging Face
checkpoint decoded by transformers (torch), greedily, with the experts placed by accelerate's
`device_map="auto"` under a GPU memory cap when a GPU and accelerate are there (the usual way to
run a model larger than the GPU with transformers), else on the CPU."""

from __future__ import annotations

import os
import time


def transformers_decode(path: str, B: int, prompt_len: int, steps: int, slots_gb: float | None, dtype: str, log) -> dict | None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        log("transformers baseline: needs --model with a Hugging Face checkpoint directory; skipped")
        return None
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        log(f"transformers baseline: {e}; skipped")
        return None
    kw: dict = dict(dtype=getattr(torch, dtype))
    placement = "cpu"
    if torch.cuda.is_available():
        try:
            import accelerate  # noqa: F401

            kw.update(device_map="auto", max_memory={0: f"{slots_gb or 16}GB", "cpu": "200GB"})
            placement = f"device_map=auto, GPU capped at {slots_gb or 16} GB"
        except ImportError:
            kw.update(device_map="cuda")
            placement = "cuda (accelerate not installed)"
    model = AutoModelForCausalLM.from_pretrained(path, **kw).eval()
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(7 + B)
    ids = torch.randint(3, model.config.vocab_size, (B, prompt_len), generator=g).to(dev)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        first = model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
        total = time.perf_counter() - t0
    del first
    n = out.shape[1] - prompt_len
    dt = max(total - ttft, 1e-9) / max(n - 1, 1)
    return dict(strategy="transformers", batch=B, slots_gb=slots_gb, slots=None, routing_skew=None, ms_per_token=dt * 1e3,
                tokens_per_s=B / dt, ttft_ms=ttft * 1e3, hit_rate=None, gb_fetched_per_token=None, experts_on_cpu_per_step=None,
                q=None, bound_ms=None, ratio_to_bound=None, placement=placement)  # fmt: skip
