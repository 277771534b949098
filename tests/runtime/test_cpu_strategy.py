"""Strategy "cpu": every routed expert computed by the C++ executor from the host banks (handed
over with pure_callback, and with the split FFI submit/wait targets) gives the fused strategy's
tokens and logits on every family."""

import gc
import weakref

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
    # the view holds the array while it (or a slice of it) lives, and only then
    alive = weakref.ref(bank)
    row = v[1]
    del bank, v
    gc.collect()
    assert alive() is not None
    np.testing.assert_array_equal(row, np.arange(6, 12))
    del row
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("engine", ["xla", "stream"])
def test_long_chunks_run_on_the_device(engine, ckpt_root, monkeypatch):
    """With prefill_load "copy" a chunk of at least CPU_PREFILL_PAIRS pairs an expert (16 tokens
    of top-3 of 8 experts: 48 ≥ 32) runs on the device — each layer's bank copied in, counted
    here (by XLA's copy or on the copy stream) — and a shorter one (4 tokens: 12) on the CPU;
    decode stays on the CPU. Tokens and logits are fused's either way."""
    from freetoken_jax.runtime import bank_copy, offload

    monkeypatch.setenv("FREETOKEN_PREFILL_COPY_ENGINE", engine)
    path = make_checkpoint("qwen2_moe", ckpt_root)
    copied, started = [], []
    real, start = offload.OffloadExecutor._buffered_prefill_fn, bank_copy.start
    monkeypatch.setattr(offload.OffloadExecutor, "_buffered_prefill_fn", lambda self, m: copied.append(m) or real(self, m))
    monkeypatch.setattr(bank_copy, "start", lambda v, dep: started.append(v) or start(v, dep))
    fused = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE))
    cpu = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE, moe_strategy="cpu", prefill_load="copy"))
    assert offload.device_prefill_pays(cpu.model_config, 16) and not offload.device_prefill_pays(cpu.model_config, 4)
    np.testing.assert_allclose(cpu.logits(PROMPTS[0]), fused.logits(PROMPTS[0]), atol=1e-5, rtol=0)
    assert copied == list(range(cpu.model_config.num_moe_layers))  # one traced chunk: every MoE layer copied in
    assert len(started) == (3 * len(copied) if engine == "stream" else 0)
    np.testing.assert_allclose(cpu.logits(PROMPTS[1]), fused.logits(PROMPTS[1]), atol=1e-5, rtol=0)
    assert len(copied) == cpu.model_config.num_moe_layers  # the short chunk: on the CPU
    assert cpu.generate_batch(PROMPTS, max_new_tokens=12, ignore_eos=True) == fused.generate_batch(
        PROMPTS, max_new_tokens=12, ignore_eos=True
    )
    assert not cpu.experts.on_device and cpu.plan.slots == 0 and cpu.compilations()["decode"] == 1
