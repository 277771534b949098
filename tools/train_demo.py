"""Trains the built-in demo model: the tiny MoE of `freetoken_jax.demo.DEMO_CONFIG` (generic
family, byte-level tokenizer) on the English text every Python installation ships, the help
topics of `pydoc_data.topics`, and writes it to `freetoken_jax/demo_model/`.

    python tools/train_demo.py            # 600 steps: 11 minutes on two CPU cores (held-out loss 1.03 nats a byte)

The model is trained through the engine's own module (`MoETransformer` over a paged KV cache
of one page per sequence, experts computed by `routed_experts`), so the weights it writes are
exactly the ones the engine serves. The initialisation and the data order are seeded (`--seed`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from freetoken_jax.demo import DEMO_CONFIG, DEMO_DIR, write_demo
from freetoken_jax.memory.kv_cache import KVView
from freetoken_jax.models import build_random
from freetoken_jax.tokenizer import ByteTokenizer


def corpus() -> np.ndarray:
    """The help topics, in a fixed order, as byte ids."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k].strip() for k in sorted(topics))
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def batches(data: np.ndarray, batch: int, length: int, seed: int):
    """Endless batches of [BOS] + `length - 1` bytes starting at a word's beginning."""
    starts = np.flatnonzero(np.isin(data[:-length], (ord(" "), ord("\n")))) + 1
    rng = np.random.default_rng(seed)
    while True:
        s = rng.choice(starts, batch)
        rows = np.stack([data[i : i + length - 1] for i in s])
        yield np.concatenate([np.full((batch, 1), ByteTokenizer.bos_token_id, np.int32), rows], axis=1)


def loss_fn(model, tokens_BT):
    """Next-byte cross-entropy of `tokens_BT` through the engine's forward pass."""
    B, T = tokens_BT.shape
    cfg = model.cfg
    positions = jnp.broadcast_to(jnp.arange(T - 1, dtype=jnp.int32), (B, T - 1))
    table = jnp.arange(1, B + 1, dtype=jnp.int32)[:, None]  # one page per sequence; page 0 unused
    view = KVView.build(positions, jnp.ones_like(positions, bool), table, T - 1)
    cache = tuple(tuple(jnp.zeros((B + 1, T - 1, *s), jnp.float32) for s in cfg.kv_entry_shapes()) for _ in range(cfg.num_layers))
    h, _ = model(tokens_BT[:, :-1], positions, view, cache)
    logits = model.logits(h)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens_BT[:, 1:]).mean()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=129, help="tokens per row, BOS included")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEMO_DIR)
    args = p.parse_args(argv)

    data = corpus()
    held = len(data) // 20  # the last 5% measures the loss on text not trained on
    train, val = data[:-held], data[-held:]
    print(f"corpus: {len(data)} bytes of pydoc_data.topics ({len(train)} train, {held} held out)", file=sys.stderr)
    model = build_random(DEMO_CONFIG, "float32", seed=args.seed)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10), args.steps, args.lr / 20)
    opt = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, tokens):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        opt.update(model, grads)
        return loss

    evaluate = nnx.jit(loss_fn)
    val_batch = next(batches(val, 16, args.length, seed=1))
    it, t0, avg = batches(train, args.batch, args.length, args.seed), time.perf_counter(), None
    for step in range(1, args.steps + 1):
        loss = float(train_step(model, opt, jnp.asarray(next(it))))
        avg = loss if avg is None else 0.95 * avg + 0.05 * loss
        if step % 50 == 0 or step == args.steps:
            v = float(evaluate(model, jnp.asarray(val_batch)))
            print(f"step {step}/{args.steps}: train {avg:.3f}  held-out {v:.3f} nats/byte  ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr)  # fmt: skip
    write_demo(nnx.state(model, nnx.Param), args.out)
    print(
        f"wrote {args.out} ({sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out)) / 1e6:.1f} MB)", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
