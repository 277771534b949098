"""Strategy "cpu": every routed expert computed by the C++ executor from the host banks (handed
over with pure_callback, and with the split FFI submit/wait targets) gives the fused strategy's
tokens and logits on every family."""

import jax
import numpy as np
import pytest
from hf_models import make_checkpoint

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.runtime.cpu_executor import host_view

BASE = dict(dtype="float32", max_context=48, max_batch=2, page_size=4, prefill_chunk=16)
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [27, 18, 28]]


# every family runs "cpu" in tests/quant/test_quantized_strategies.py; here both handoffs on two
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_cpu_matches_fused(family, ckpt_root):
    path = make_checkpoint(family, ckpt_root)
    fused = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE))
    want = fused.generate_batch(PROMPTS, max_new_tokens=12, ignore_eos=True)
    for handoff in ("callback", "ffi"):
        cpu = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE, moe_strategy="cpu", cpu_handoff=handoff))
        assert cpu.experts.handoff == handoff
        assert cpu.generate_batch(PROMPTS, max_new_tokens=12, ignore_eos=True) == want, handoff
        np.testing.assert_allclose(cpu.logits(PROMPTS[0]), fused.logits(PROMPTS[0]), atol=1e-5, rtol=0)
        assert cpu.plan.slots == 0 and cpu.compilations()["decode"] == 1


def test_host_view_is_the_bank_itself():
    from freetoken_jax.runtime.offload import host_memory_kind

    bank = jax.numpy.arange(24, dtype=jax.numpy.float32).reshape(4, 6)
    if host_memory_kind():  # a GPU: the banks live in pinned host memory
        bank = jax.device_put(bank, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=host_memory_kind()))
    v = host_view(bank)
    assert v.ctypes.data == bank.unsafe_buffer_pointer()  # no copy: the executor reads the bank
    np.testing.assert_array_equal(v, np.arange(24).reshape(4, 6))
    assert not v.flags.writeable
