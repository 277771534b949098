"""Prefill under "offload" through two borrowed layer buffers of the slot cache: logits equal
fused on every family for prompts of 1, page − 1, page + 1 tokens and several chunks, with both
load paths (whole-layer copy of small banks; per-expert fetch with resident experts used in
place); the slot maps stay coherent and the decode that follows gives the fused tokens."""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import make_checkpoint

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.memory.kv_cache import init_cache
from freetoken_jax.runtime.steps import PrefillBatch, Sampling, forward

BASE = dict(dtype="float32", max_context=40, max_batch=2, page_size=4, prefill_chunk=8)


@jax.jit
def buffered_step(weights, experts, cache, batch, slots):
    b = batch
    h, cache, slots = forward(weights, experts, cache, b.tokens_BT, b.positions_BT, b.valid_BT, b.page_table_BP, slots, buffered=True)
    return weights.model().logits(h), cache, slots


def buffered_args(eng):
    """A KV cache of the test's own and a one-row page table over it."""
    ecfg = eng.engine_config
    table = np.zeros((1, ecfg.pages_per_sequence), np.int32)
    table[0] = np.arange(1, ecfg.pages_per_sequence + 1)
    return init_cache(eng.model_config, ecfg, jnp.float32), table


def buffered_logits(eng, prompt, slots=None):
    """Logits at every prompt position, computed chunk by chunk through the buffered prefill
    (`buffered_step`) and the slot cache `slots` (default: the engine's); returns (logits, slot
    cache after)."""
    ecfg = eng.engine_config
    cache, table = buffered_args(eng)
    slots, out = eng.runner.slots if slots is None else slots, []
    for start in range(0, len(prompt), ecfg.prefill_chunk):
        seg = prompt[start : start + ecfg.prefill_chunk]
        batch = PrefillBatch.chunk([seg], [start], table, ecfg.prefill_chunk, Sampling.greedy(1))
        lg, cache, slots = buffered_step(eng.weights, eng.experts, cache, batch, slots)
        out.append(np.asarray(lg[0, : len(seg)]))
    return np.concatenate(out), slots


def test_copied_banks_go_into_buffers_for_the_last_two_layers_only(ckpt_root):
    """Under whole-bank copies a layer computes from its copied bank: the only writes of whole
    banks into the slot arrays are the last two layers' (which stay resident)."""
    import re

    path = make_checkpoint("mixtral", ckpt_root)  # three MoE layers
    eng = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE, moe_strategy="offload", expert_slots=8 * 3, prefill_load="copy"))
    L = eng.model_config.num_moe_layers
    cache, table = buffered_args(eng)
    batch = PrefillBatch.chunk([[3, 4, 5]], [0], table, eng.engine_config.prefill_chunk, Sampling.greedy(1))
    text = buffered_step.lower(eng.weights, eng.experts, cache, batch, eng.runner.slots).as_text()
    s = eng.runner.slots
    arrays = {"x".join(map(str, a.shape)) + "xf32" for a in (s.gate_SR, s.up_SR, s.down_SR)}
    results = re.findall(r'"stablehlo.scatter".*?\}\) : \([^)]*\) -> tensor<([^>]*)>', text, re.S)
    assert L == 3 and sum(r in arrays for r in results) == 2 * 3, results


def check_maps(c):
    ids, sfi = np.asarray(c.id_of_slot), np.asarray(c.slot_for_id)
    assert all(sfi[i] == s for s, i in enumerate(ids) if i >= 0)
    assert (sfi >= 0).sum() == (ids >= 0).sum()  # a bijection between held slots and resident ids


# MLA through deepseek_v3 (whole-bank copies); mixtral's three MoE layers by the per-expert fetch
# and by copies (its first layer computed from the copy itself, the last two written into buffers)
@pytest.mark.parametrize("family, load", [("qwen3_moe", "auto"), ("deepseek_v3", "auto"), ("mixtral", "fetch"), ("mixtral", "copy")])
def test_buffered_prefill_matches_fused(family, load, ckpt_root):
    """ "auto" copies these tiny banks whole; "fetch" takes the per-expert path."""
    path = make_checkpoint(family, ckpt_root)
    fused = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE))
    cfg = fused.model_config
    ecfg = EngineConfig(**BASE, moe_strategy="offload", expert_slots=3 * cfg.num_experts, prefill_load=load)
    off = FreeTokenEngine.from_pretrained(path, ecfg)
    rng = np.random.default_rng(5)
    slots = off.runner.slots
    for n in (1, 3, 5, 19):  # 1, page − 1, page + 1, three chunks
        prompt = [int(t) for t in rng.integers(3, cfg.vocab_size, n)]
        got, slots = buffered_logits(off, prompt, slots)
        np.testing.assert_allclose(got, fused.logits(prompt), atol=1e-5, rtol=0, err_msg=f"{family} n={n}")
        check_maps(slots)
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, n)] for n in (13, 6)]
    want = fused.generate_batch(prompts, max_new_tokens=8, ignore_eos=True)
    for _ in range(2):  # the second time, experts the first left resident are used in place
        assert off.generate_batch(prompts, max_new_tokens=8, ignore_eos=True) == want
        check_maps(off.runner.slots)
    assert off.compilations()["decode"] == 1


@pytest.mark.parametrize("family, load", [("qwen3_moe", "auto"), ("qwen3_moe", "fetch"), ("mixtral", "copy")])
def test_buffers_keep_the_last_layers_and_fallback_is_logged(family, load, ckpt_root, caplog):
    path = make_checkpoint(family, ckpt_root)
    fused = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE))
    cfg = fused.model_config
    E, L = cfg.num_experts, cfg.num_moe_layers
    off = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE, moe_strategy="offload", expert_slots=(L + 2) * E, prefill_load=load))
    prompt = list(range(3, 20))
    _, slots = buffered_logits(off, prompt)
    sfi = np.asarray(slots.slot_for_id).reshape(L, E)
    assert (sfi[-2:] >= 0).all()  # the last two layers stay resident after prefill
    # ... and their slots hold their experts' rows exactly (whichever way they were loaded)
    layers = [v for _, v in sorted(off.weights.params["layers"].items()) if "experts" in v["mlp"]]
    for m in (L - 2, L - 1):
        for k, arr in (("gate", slots.gate_SR), ("up", slots.up_SR), ("down", slots.down_SR)):
            bank = np.asarray(layers[m]["mlp"]["experts"][k].get_value())
            np.testing.assert_array_equal(np.asarray(arr)[sfi[m]], bank, err_msg=f"{load} layer {m} {k}")
    if family != "qwen3_moe" or load != "auto":
        return
    # too few slots for two buffers: whole layers are streamed, logged once, results unchanged
    small = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE, moe_strategy="offload", expert_slots=2 * E - 1))
    with caplog.at_level(logging.INFO, logger="freetoken_jax"):
        got = small.generate_batch([prompt], max_new_tokens=6, ignore_eos=True)
    assert got == fused.generate_batch([prompt], max_new_tokens=6, ignore_eos=True)
    assert any("without double buffering" in r.message for r in caplog.records)
    assert small.compilations()["prefill"] >= 1 and "prefill_step_buffered" not in small.runner.steps.traces


def test_borrow_takes_least_recently_used_and_empties_them():
    from freetoken_jax.memory.slot_cache import SlotCache, borrow_for_prefill, keep_buffer

    S, E, L = 10, 3, 4
    ids = jnp.array([0, 1, 2, 3, 4, 5, 6, -1, 8, 9], jnp.int32)
    last = jnp.array([5, 1, 7, 2, 9, 0, 8, -1, 3, 6], jnp.int32)
    sfi = jnp.full((L * E,), -1, jnp.int32).at[jnp.where(ids >= 0, ids, L * E)].set(jnp.arange(S), mode="drop")
    z = jnp.zeros((S, 2))
    c = SlotCache(z, z, z, sfi, ids, last, jnp.int32(10), *(jnp.zeros((L,), jnp.int32),) * 2, jnp.zeros((L, 2), jnp.int32),
                  jnp.full((L * E,), -1, jnp.int32), jnp.zeros((L,), jnp.int32))  # fmt: skip
    c2, bufs = borrow_for_prefill(c, E)
    assert sorted(np.asarray(bufs).reshape(-1).tolist()) == [0, 1, 3, 5, 7, 8]  # the 6 least recently used, empty first
    assert (np.asarray(c2.id_of_slot)[np.asarray(bufs).reshape(-1)] == -1).all()
    check_maps(c2)
    c3 = keep_buffer(c2, bufs[0], 3)  # layer 3's experts (ids 9, 10, 11): 9 is resident elsewhere
    check_maps(c3)
    sfi3 = np.asarray(c3.slot_for_id)
    assert sfi3[9] == 9 and sfi3[10] in np.asarray(bufs[0]) and sfi3[11] in np.asarray(bufs[0])


def test_short_chunks_go_through_the_slot_cache(ckpt_root):
    """A chunk whose routed experts would reach few of a layer's experts is prefilled as decode
    does (looked up and fetched per token); a longer one loads whole layers. Both give the fused
    tokens and leave the maps coherent."""
    from freetoken_jax.runtime.offload import slot_prefill_pays

    path = make_checkpoint("qwen3_moe", ckpt_root)
    one = {**BASE, "max_batch": 1}
    fused = FreeTokenEngine.from_pretrained(path, EngineConfig(**one))
    cfg = fused.model_config
    prompt = [int(t) for t in np.random.default_rng(9).integers(3, cfg.vocab_size, 19)]
    want = fused.generate_batch([prompt], max_new_tokens=6, ignore_eos=True)
    for chunk, path_taken in ((8, "prefill_step_slots"), (16, "prefill_step_buffered")):
        ecfg = EngineConfig(**{**one, "prefill_chunk": chunk}, moe_strategy="offload", expert_slots=3 * cfg.num_experts)
        off = FreeTokenEngine.from_pretrained(path, ecfg)
        assert off.generate_batch([prompt], max_new_tokens=6, ignore_eos=True) == want
        check_maps(off.runner.slots)
        taken = {k for k in off.runner.steps.traces if k.startswith("prefill_step")}
        assert taken == {path_taken}, (chunk, taken)
    # 8 of 128 experts per token: up to 35 tokens reach at most 90% of a layer's experts, if they fit the slots
    big = dataclasses.replace(cfg, num_experts=128, top_k=8)
    assert slot_prefill_pays(big, 35, 4096) and not slot_prefill_pays(big, 36, 4096) and not slot_prefill_pays(big, 35, 279)


def copies_before_each_layer(n: int, ahead: int, late: tuple) -> list[int]:
    """A plain-Python model of the buffered prefill's copy issue: how many banks are copied
    between layer m-1's experts and layer m's. Layer m's barrier issues layer 0's banks (m = 0)
    and every bank of layers m+1 .. m+ahead not yet issued, less the newest layer's `late` kinds,
    which layer m's output issues (counted before layer m+1)."""
    issued, counts = set(), []
    for m in range(n):
        count = 3 if m == 0 else 0
        if m > 0 and m - 1 + ahead < n:
            count += len(late)
            issued |= {(m - 1 + ahead, k) for k in late}
        for j in range(m + 1, min(n, m + 1 + ahead)):
            for k in range(3):
                if (j, k) not in issued and not (j == m + ahead and k in late):
                    issued.add((j, k))
                    count += 1
        counts.append(count)
    assert len(issued) == 3 * (n - 1)  # every bank after layer 0's, once
    return counts


def test_copy2_issues_two_layers_ahead_with_the_same_numbers(ckpt_root, monkeypatch):
    """prefill_load "copy2": layer m's barrier issues layer m+2's bank copy (layer 0's those of
    layers 1 and 2), so that the copies come two layers ahead of the compute; "copy" one layer
    ahead; under copy2 FREETOKEN_PREFILL_COPY_SPLIT moves layer m+2's down (and up) bank to layer
    m's output. The banks copied before each layer's experts, as traced, follow the plain-Python
    model, and the logits equal "copy"'s bit for bit."""
    from freetoken_jax.runtime import offload

    path = make_checkpoint("mixtral_deep", ckpt_root)
    events = []
    on_device, routed = offload.OffloadExecutor._on_device, offload.routed_experts
    monkeypatch.setattr(offload.OffloadExecutor, "_on_device", staticmethod(lambda b: events.append("copy") or on_device(b)))
    monkeypatch.setattr(offload, "routed_experts", lambda *a, **k: events.append("compute") or routed(*a, **k))
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 96, 13)]
    got = {}
    for load, ahead, split in (
        ("copy", 1, "none"),
        ("copy2", 2, "none"),
        ("copy2", 2, "down"),
        ("copy2", 2, "up_down"),
        ("copy", 1, "down"),
    ):
        monkeypatch.setenv("FREETOKEN_PREFILL_COPY_SPLIT", split)
        eng = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE, moe_strategy="offload", expert_slots=3 * 6, prefill_load=load))
        n = eng.model_config.num_moe_layers
        events.clear()
        buffered_step.clear_cache()  # traced afresh: the events are the trace's
        cache, table = buffered_args(eng)
        batch = PrefillBatch.chunk([prompt[:8]], [0], table, 8, Sampling.greedy(1))
        buffered_step.lower(eng.weights, eng.experts, cache, batch, eng.runner.slots)
        counts, run = [], 0
        for e in events:
            if e == "compute":
                counts.append(run)
                run = 0
            else:
                run += 1
        late = offload.COPY_SPLITS[split] if ahead == 2 else ()  # one layer ahead, all at the barrier
        assert counts == copies_before_each_layer(n, ahead, late), (load, split, counts)
        assert run == 0  # nothing issued after the last layer's experts
        got[load, split] = buffered_logits(eng, prompt)[0]
    for key, logits in got.items():
        np.testing.assert_array_equal(got["copy", "none"], logits, err_msg=str(key))
    monkeypatch.delenv("FREETOKEN_PREFILL_COPY_SPLIT")
    assert offload.copy_split() == offload.COPY_SPLITS["down"]  # the default
    monkeypatch.setenv("FREETOKEN_PREFILL_COPY_SPLIT", "gate")
    with pytest.raises(ValueError, match="FREETOKEN_PREFILL_COPY_SPLIT"):
        offload.copy_split()


def test_copy_stream_starts_and_waits_in_the_layers_order_with_the_same_numbers(ckpt_root, monkeypatch):
    """FREETOKEN_PREFILL_COPY_ENGINE=stream: every whole-bank copy is a start on the copy stream,
    issued where the XLA engine issues its `device_put` (the plain-Python model, no kinds split
    off under copy2), and a wait between the previous layer's experts and the layer's own; the
    buffers are the FFI calls' (memcpy on the CPU backend) and the logits equal the XLA engine's
    bit for bit, one layer ahead and two."""
    from freetoken_jax.runtime import bank_copy, offload

    path = make_checkpoint("mixtral_deep", ckpt_root)
    events = []
    start, wait, routed = bank_copy.start, bank_copy.wait, offload.routed_experts
    monkeypatch.setattr(bank_copy, "start", lambda v, dep: events.append("start") or start(v, dep))
    monkeypatch.setattr(bank_copy, "wait", lambda c, dep: events.append("wait") or wait(c, dep))
    monkeypatch.setattr(offload, "routed_experts", lambda *a, **k: events.append("compute") or routed(*a, **k))
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 96, 13)]
    plain = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE, moe_strategy="offload", expert_slots=3 * 6))
    assert plain.experts.host_banks is None  # by default no views: equal backends share their executables
    for load, ahead in (("copy", 1), ("copy2", 2)):
        monkeypatch.setenv("FREETOKEN_PREFILL_COPY_ENGINE", "stream")  # read as the backend is made: it carries the banks' views
        eng = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE, moe_strategy="offload", expert_slots=3 * 6, prefill_load=load))
        assert eng.experts.host_banks is not None
        n = eng.model_config.num_moe_layers
        monkeypatch.setenv("FREETOKEN_PREFILL_COPY_ENGINE", "xla")
        buffered_step.clear_cache()
        want = buffered_logits(eng, prompt)[0]
        monkeypatch.setenv("FREETOKEN_PREFILL_COPY_ENGINE", "stream")
        buffered_step.clear_cache()
        events.clear()
        cache, table = buffered_args(eng)
        batch = PrefillBatch.chunk([prompt[:8]], [0], table, 8, Sampling.greedy(1))
        text = buffered_step.lower(eng.weights, eng.experts, cache, batch, eng.runner.slots).as_text()
        assert text.count("@freetoken_bank_copy_start") == text.count("@freetoken_bank_copy_wait") == 3 * n, load
        starts, waits = [0], [0]
        for e in events:
            if e == "compute":
                starts.append(0)
                waits.append(0)
            else:
                (starts if e == "start" else waits)[-1] += 1
        assert starts[:-1] == copies_before_each_layer(n, ahead, ()) and starts[-1] == 0, (load, starts)
        assert waits == [3] * n + [0], (load, waits)  # layer m's banks waited for after layer m-1's experts
        buffered_step.clear_cache()
        got, slots = buffered_logits(eng, prompt)
        np.testing.assert_array_equal(got, want, err_msg=load)
        check_maps(slots)


def test_copy_wait_moves_the_barriers_not_the_numbers(ckpt_root, monkeypatch):
    """FREETOKEN_PREFILL_COPY_WAIT: under whole-bank copies five MoE layers take up layer m+1's
    bank after layer m's output ("output": four barriers beside the four that issue the copies)
    or at layer m+1's experts ("experts": only the last two layers', written into their buffers,
    after an output; the default); the logits equal fused ones and each other bit for bit; a bad
    value raises."""
    from freetoken_jax.runtime.offload import copy_wait

    path = make_checkpoint("mixtral_deep", ckpt_root)
    fused = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE))
    eng = FreeTokenEngine.from_pretrained(path, EngineConfig(**BASE, moe_strategy="offload", expert_slots=3 * 6, prefill_load="copy"))
    assert eng.model_config.num_moe_layers == 5
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 96, 13)]
    got = {}
    for how, barriers in (("output", 8), ("experts", 6)):
        monkeypatch.setenv("FREETOKEN_PREFILL_COPY_WAIT", how)
        buffered_step.clear_cache()  # the switch is read when tracing
        cache, table = buffered_args(eng)
        batch = PrefillBatch.chunk([prompt[:8]], [0], table, 8, Sampling.greedy(1))
        text = buffered_step.lower(eng.weights, eng.experts, cache, batch, eng.runner.slots).as_text()
        assert text.count("stablehlo.optimization_barrier") == barriers, how
        got[how] = buffered_logits(eng, prompt, eng.runner.slots)[0]
    np.testing.assert_allclose(got["output"], fused.logits(prompt), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(got["output"], got["experts"])
    monkeypatch.delenv("FREETOKEN_PREFILL_COPY_WAIT")
    assert copy_wait() == "experts"  # the default
    monkeypatch.setenv("FREETOKEN_PREFILL_COPY_WAIT", "later")
    with pytest.raises(ValueError, match="FREETOKEN_PREFILL_COPY_WAIT"):
        copy_wait()
