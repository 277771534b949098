"""The built-in demo model: a tiny MoE of the generic family (4 layers, 16 experts of which
2 are routed per token, a shared expert; 1.6 M parameters) with a byte-level tokenizer, trained
by `tools/train_demo.py` (11 minutes on two cores) on the English help text that ships with
Python (`pydoc_data.topics`). Its weights (bf16, 3.3 MB) come with the package, so the demo needs no
download and exercises the real loading path; it writes English words and phrases of Python's
documentation, not sense.
"""

from __future__ import annotations

import os

from freetoken_jax.checkpoint.safetensors_io import CheckpointError
from freetoken_jax.config import MoEModelConfig
from freetoken_jax.tokenizer import ByteTokenizer

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")

DEMO_CONFIG = MoEModelConfig(
    vocab_size=320,
    hidden_dim=128,
    intermediate_dim=256,
    moe_intermediate_dim=64,
    num_layers=4,
    num_experts=16,
    top_k=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    qk_norm=True,
    shared_expert_dim=64,
    moe_layers=(False, True, True, True),
    max_position_embeddings=4096,
    bos_token_id=ByteTokenizer.bos_token_id,
    eos_token_ids=(ByteTokenizer.eos_token_id,),
)

DEMO_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def demo_path() -> str:
    """The demo checkpoint directory (inside the package)."""
    if not os.path.isfile(os.path.join(DEMO_DIR, "model.safetensors")):
        raise CheckpointError(
            f"the demo model's weights are missing from {DEMO_DIR} (a broken install? `python tools/train_demo.py` writes them)"
        )
    return DEMO_DIR


def write_demo(params, path: str = DEMO_DIR) -> None:
    """Writes the demo checkpoint: `params` (an `nnx.State` of DEMO_CONFIG's model) in bf16, the
    config and the byte tokenizer's settings with the chat template."""
    import jax
    import jax.numpy as jnp

    from freetoken_jax.checkpoint.native import save_native

    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    save_native(DEMO_CONFIG, params, path, {"tokenizer_config.json": {"freetoken_tokenizer": "bytes", "chat_template": DEMO_CHAT_TEMPLATE}})
