"""Helpers shared by the tests."""

import contextlib
import time

import jax
import numpy as np


def jitted(fn, *args, **kw):
    """`fn(*args, **kw)` jitted, as a step calls it: one compile instead of one per eager op. Array
    arguments (and tuples or lists of arrays) are traced, the rest closed over; it is traced afresh
    at each call, so module settings a test patches apply."""

    def arrays(a) -> bool:
        return isinstance(a, (jax.Array, np.ndarray)) or (
            isinstance(a, (tuple, list)) and len(a) > 0 and all(isinstance(b, (jax.Array, np.ndarray)) for b in a)
        )

    traced = [i for i, a in enumerate(args) if arrays(a)]

    def call(*values):
        full = list(args)
        for i, v in zip(traced, values):
            full[i] = v
        return fn(*full, **kw)

    return jax.jit(call)(*(tuple(args[i]) if isinstance(args[i], list) else args[i] for i in traced))


def wait_idle(sched, timeout: float = 30.0) -> bool:
    """Whether the scheduler has nothing waiting, running or in flight within `timeout` seconds."""
    t = time.time() + timeout
    while time.time() < t:
        if sched.idle():
            return True
        time.sleep(0.01)
    return False


def check_kernel_choice(monkeypatch, env: str, want: dict, choose, bad: str) -> None:
    """A kernel switch (environment variable `env`): for each (setting, backend) of `want`, what
    `choose()` returns under them equals the value; the setting `bad` raises ValueError."""
    import jax
    import pytest

    for (how, backend), expect in want.items():
        monkeypatch.setenv(env, how)
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        assert choose() == expect, (how, backend)
    monkeypatch.setenv(env, bad)
    with pytest.raises(ValueError, match=f"{env}={bad!r}"):
        choose()


def gated_reference(act: str, g, u):
    """The gated activation h(g, u) of `act` in float64 (config.ACTIVATIONS's definitions)."""
    if act == "swiglu_oai":  # gpt-oss: alpha 1.702, limit 7
        g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
        return (u + 1) * g / (1 + np.exp(-1.702 * g))
    f = {"silu": lambda v: v / (1 + np.exp(-v)), "gelu": lambda v: 0.5 * v * (1 + np.vectorize(__import__("math").erf)(v / np.sqrt(2))),
         "gelu_tanh": lambda v: 0.5 * v * (1 + np.tanh(0.7978845608028654 * (v + 0.044715 * v**3)))}[act]  # fmt: skip
    return f(g) * u


def executor_reference(x, tokens, experts, weights, gate, up, down, F, act, round_activations=None, bias=None):
    """The CPU executor's job in float64: out[t] += w · (down_e act(gate_e x_t + bg_e, up_e x_t +
    bu_e) + bd_e), biases (gate, up, down per expert) where given; `round_activations(v)`, when
    given, is applied to x_t and to the hidden vector first (as kernels that quantize their
    activations do)."""
    rnd = round_activations or (lambda v: v)
    x = rnd(x.astype(np.float64))
    T, H = x.shape
    g64, u64, d64 = (np.asarray(b, np.float64) for b in (gate, up, down))
    bg, bu, bd = (
        (np.asarray(b, np.float64) for b in bias) if bias is not None else (np.zeros((len(g64), F)),) * 2 + (np.zeros((len(g64), H)),)
    )
    out = np.zeros((T, H))
    for t, e, w in zip(tokens, experts, weights):
        G, U, D = g64[e].reshape(F, H), u64[e].reshape(F, H), d64[e].reshape(H, F)
        out[t] += w * (D @ rnd(gated_reference(act, G @ x[t] + bg[e], U @ x[t] + bu[e])) + bd[e])
    return out


# Where each K-quant's f16 super-block scales sit in its block (the rest may be any byte).
K_SCALE_BYTES = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def int8_activations(tier: str, fmt: str) -> bool:
    """Whether the CPU executor's kernels of `fmt` at `tier` read activations rounded to int8 per
    block of 32 (cpu_ext/src/quant_dot.cc: the VNNI kernels from avx512_bf16 on, all but fp8; the
    AVX2 tier's int8 kernels of q4_0, mxfp4 and nvfp4)."""
    if tier == "avx512_bf16":
        return fmt != "fp8"
    return tier == "avx2_fma" and fmt in ("q4_0", "mxfp4", "nvfp4")


def float_tier(tiers: list[str]) -> str:
    """The highest tier of `tiers` whose quantized kernels read float32 activations."""
    return "avx512f" if "avx512f" in tiers else "scalar"


def random_blocks(fmt, O, I, rng, scale=0.01):
    """uint8 [O, row_bytes] of `fmt` with every code and sub-block scale random and each f16
    super-block scale a random finite value of about `scale` (what GGUF files of K-quants hold:
    bytes from ggml's own quantizer, not ours)."""
    from freetoken_jax.quant.formats import get_format

    f = get_format(fmt)
    b = rng.integers(0, 256, (O, f.blocks(I), f.block_bytes), dtype=np.uint8)
    for at in K_SCALE_BYTES[fmt]:
        d = (rng.random((O, f.blocks(I))) * scale).astype(np.float16)
        b[..., at : at + 2] = d[..., None].view(np.uint8)
    return b.reshape(O, -1)


@contextlib.contextmanager
def demo_server(ecfg):
    """The demo model served over HTTP on a free loopback port: yields (base URL, `Service`)."""
    with model_server("demo", "demo", ecfg) as served:
        yield served


@contextlib.contextmanager
def model_server(path, name, ecfg):
    """The model at `path` served over HTTP as `name` on a free loopback port: yields (base URL, `Service`)."""
    from freetoken_jax import FreeTokenEngine
    from freetoken_jax.scheduler.scheduler import Scheduler
    from freetoken_jax.server.http import Service, serve_http

    engine = FreeTokenEngine.from_pretrained(path, ecfg)
    sched = Scheduler(engine)
    service = Service(sched, name, engine.model_path)
    httpd = serve_http(service, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", service
    finally:
        httpd.shutdown()
        sched.shutdown()


def chat_checkpoint(path: str, template: str, special: list[str], added: list[str] = (), eos: str | list[str] = "<|im_end|>") -> str:
    """A tiny random Qwen3-MoE checkpoint at `path` with a byte-level tokenizer holding `special`
    and `added` tokens and the chat `template`; `eos`: its end-of-sequence token(s)."""
    import json
    import os

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(special)
    tok.add_tokens(list(added))
    tok.save(os.path.join(path, "tokenizer.json"))
    eos = [eos] if isinstance(eos, str) else eos
    json.dump({"chat_template": template, "eos_token": eos[0]}, open(os.path.join(path, "tokenizer_config.json"), "w"))
    ids = [tok.token_to_id(t) for t in eos]
    cfg = Qwen3MoeConfig(vocab_size=288, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, eos_token_id=ids[0] if len(ids) == 1 else ids,
                         initializer_range=0.05)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def random_slot_cache(rng, L: int, E: int, S: int, N: int):
    """A consistent slot cache of S slots for L MoE layers of E experts (N routed entries a
    layer): a random subset of the experts resident in random slots, random clocks before 50."""
    import jax.numpy as jnp

    from freetoken_jax.memory.slot_cache import SlotCache

    ids = rng.permutation(L * E)[: rng.integers(0, S + 1)]
    slots = rng.permutation(S)[: len(ids)]
    slot_for_id = np.full(L * E, -1, np.int32)
    slot_for_id[ids] = slots
    id_of_slot = np.full(S, -1, np.int32)
    id_of_slot[slots] = ids
    last_use = np.where(id_of_slot >= 0, rng.integers(0, 50, S), -1).astype(np.int32)
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    z = jnp.zeros((S, 1), jnp.float32)
    return SlotCache(
        z, z, z, i32(slot_for_id), i32(id_of_slot), i32(last_use), i32(50), i32(np.zeros(L)), i32(np.zeros(L)),
        i32(np.full((L, N), -1)), i32(rng.integers(-1, 50, L * E)), i32(np.zeros(L)),
    )  # fmt: skip
