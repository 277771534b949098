"""The built-in demo model: a small deterministic random MoE with a byte-level tokenizer.

It is written once to the user's cache directory on first use (no download) and then loaded
like any other checkpoint, so the demo exercises the real loading path.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from freetoken_jax.config import MoEModelConfig
from freetoken_jax.paths import cache_dir
from freetoken_jax.tokenizer import ByteTokenizer

DEMO_VERSION = 2

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
    """The demo checkpoint directory, created on first use."""
    path = os.path.join(cache_dir(), f"demo-v{DEMO_VERSION}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from flax import nnx

    from freetoken_jax.checkpoint.native import save_native
    from freetoken_jax.models import build_random

    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir(), prefix=".demo-")
    try:
        params = nnx.state(build_random(DEMO_CONFIG, "float32", seed=1234), nnx.Param)
        tok = {"freetoken_tokenizer": "bytes", "chat_template": DEMO_CHAT_TEMPLATE}
        save_native(DEMO_CONFIG, params, tmp, {"tokenizer_config.json": tok})
        try:
            os.rename(tmp, path)
        except OSError:  # another process made it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
