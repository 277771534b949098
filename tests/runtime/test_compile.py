"""One executable per bucket: repeated requests of other lengths in the same buckets compile nothing."""

import collections
import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.engine import GenerationParams
from freetoken_jax.runtime.steps import DecodeBatch, DecodeState, Sampling


def test_compiles_once_per_bucket():
    engine = FreeTokenEngine.from_pretrained(
        "demo", EngineConfig(dtype="float32", max_context=64, max_batch=2, page_size=8, prefill_chunk=16)
    )
    list(engine.generate(list(range(1, 10)), max_new_tokens=5, ignore_eos=True))
    first = engine.compilations()
    assert first == {"prefill": 1, "decode": 1, "score": 0}
    # Same buckets (B=1, T=16, 2 pages of 8): other prompt lengths, temperatures, seeds.
    for n, temp in ((5, 0.0), (9, 0.8), (4, 1.3)):
        list(engine.generate(list(range(1, n + 1)), max_new_tokens=5, temperature=temp, seed=n, ignore_eos=True))
    assert engine.compilations() == first
    # top-k / top-p take the decode step that sorts the vocabulary, compiled once for any values
    for n, k, p in ((5, 4, 1.0), (9, 0, 0.9), (4, 7, 0.5)):
        list(engine.generate(list(range(1, n + 1)), max_new_tokens=5, temperature=0.8, top_k=k, top_p=p, seed=n, ignore_eos=True))
    first = {**first, "decode": 2}
    assert engine.compilations() == first
    # Two prompts prefilled together are a new prefill bucket, compiled once; decode always runs
    # every row (the idle ones masked) in its one executable.
    engine.generate_batch([[1, 2], [3, 4, 5]], max_new_tokens=6)
    engine.generate_batch([[7], [8, 9]], max_new_tokens=8)
    assert engine.compilations() == {"prefill": 2, "decode": 2, "score": 0}


@contextlib.contextmanager
def backend_compiles():
    """Counts the executables XLA compiles inside the block, by jitted function name."""
    seen = collections.Counter()

    def listen(event, _duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            seen[kw.get("fun_name")] += 1

    monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        monitoring.unregister_event_duration_listener(listen)


STEPS = (
    "jit(decode_step_plain)",
    "jit(decode_step)",
    "jit(prefill_step)",
    "jit(prefill_step_slots)",
    "jit(prefill_step_buffered)",
    "jit(decode_forward)",
    "jit(sample_step)",
    "jit(_copy_tokens)",  # the decode steps' token, copied out of the state
)


def test_first_steps_share_the_later_steps_executables(demo_scheduler):
    """Fresh state arrays are committed to the device as the steps' outputs are: the first decode
    step compiles nothing the second would compile again (engine, scheduler), and a resize
    compiles the decode step the serving loop then uses."""
    ec = EngineConfig(dtype="float32", max_context=64, max_batch=2, page_size=8, prefill_chunk=16, moe_strategy="offload", expert_slots=6)
    engine = FreeTokenEngine.from_pretrained("demo", ec)
    with backend_compiles() as first:
        list(engine.generate([1, 2, 3, 4, 5], max_new_tokens=6, ignore_eos=True))
    assert first["jit(decode_step_plain)"] == 1
    with backend_compiles() as again:
        list(engine.generate([7, 8, 9], max_new_tokens=6, ignore_eos=True))  # same buckets
    assert not any(again[s] for s in STEPS), again

    sched = demo_scheduler(ec)
    p = GenerationParams(max_new_tokens=6, ignore_eos=True)
    sched.submit([1, 2, 3, 4, 5], p).result(60)
    with backend_compiles() as second:
        sched.submit([1, 2, 3, 4, 6], p).result(60)
    assert not any(second[s] for s in STEPS), second
    with backend_compiles() as resize:
        sched.rebuild_cache(expert_slots=12)
    assert resize["jit(decode_step_plain)"] == 1
    with backend_compiles() as after:
        sched.submit([1, 2, 3, 4, 5], p).result(60)
    assert after["jit(decode_step_plain)"] == 0, after


def test_warm_up_compiles_every_step_serving_runs(demo_scheduler):
    """After `Scheduler.warm_up`, requests of every chunk bucket (slot-cache prefill for short
    chunks, buffered prefill for longer ones, several chunks) and decoding compile no step; nor
    after a resize of the warmed-up server."""
    ec = EngineConfig(dtype="float32", max_context=128, max_batch=2, page_size=8, prefill_chunk=64, moe_strategy="offload", expert_slots=40)
    sched = demo_scheduler(ec)
    with backend_compiles() as warm:
        out = sched.warm_up(workers=2)
    # decode with and without top-k / top-p, its two halves (sampling with and without log-probabilities), prefill chunks of 16, 32, 64
    assert out["steps"] == 5 + 3
    assert warm["jit(decode_step)"] == warm["jit(decode_step_plain)"] == warm["jit(prefill_step_slots)"] == 1
    assert warm["jit(prefill_step_buffered)"] == 2
    assert warm["jit(decode_forward)"] == 1 and warm["jit(sample_step)"] == 2
    p = GenerationParams(max_new_tokens=4, ignore_eos=True)
    full = GenerationParams(max_new_tokens=4, ignore_eos=True, presence_penalty=0.5)  # the two halves
    lp = GenerationParams(max_new_tokens=4, ignore_eos=True, logprobs=2)
    nucleus = GenerationParams(max_new_tokens=4, ignore_eos=True, temperature=0.8, top_p=0.9)  # the decode step that sorts
    with backend_compiles() as serving:
        for n in (5, 20, 40, 100):
            for params in (p, full, lp, nucleus):
                sched.submit(list(range(1, n + 1)), params).result(120)
    assert not any(serving[s] for s in STEPS), serving
    # A resize of a warmed-up server compiles the new geometry's steps with it.
    assert sched.rebuild_cache(expert_slots=48)["warm_up"]["steps"] == 8
    with backend_compiles() as resized:
        for n in (5, 20, 40, 100):
            sched.submit(list(range(1, n + 1)), p).result(120)
    assert not any(resized[s] for s in STEPS), resized


def test_warm_up_for_scoring_compiles_the_scored_prefills(demo_scheduler):
    """`warm_up(scoring=True)` compiles the prefill steps that score prompts too: requests with
    prompt log-probabilities of every chunk bucket then compile nothing."""
    ec = EngineConfig(dtype="float32", max_context=128, max_batch=2, page_size=8, prefill_chunk=64, moe_strategy="offload", expert_slots=40)
    sched = demo_scheduler(ec)
    assert sched.warm_up(workers=2, scoring=True)["steps"] == 5 + 3 + 3
    scored = GenerationParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=1)
    with backend_compiles() as serving:
        for n in (5, 20, 40, 100):
            h = sched.submit(list(range(1, n + 1)), scored)
            h.result(120)
            assert [r[0] for r in h.prompt_logprobs] == list(range(2, n + 1))
    assert not any(serving[s] for s in STEPS), serving


def _addresses(tree) -> dict:
    return {jax.tree_util.keystr(k): v.unsafe_buffer_pointer() for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("outputs", ["donated", "fresh"])
def test_steps_keep_the_state_where_it_is(outputs, monkeypatch):
    """Each step's state arrays are written over their donated inputs: from step to step every
    array of the decode state (KV pages, tokens, positions, slot cache, counts) keeps its device
    address, whichever path samples, and the token a step returns stays readable after the next
    step. (XLA keeps CUDA graphs of the step that captured those addresses; an array that moves
    has every command reading it re-recorded before the next step runs.) FREETOKEN_DECODE_OUTPUTS
    "donated": the decode program returns the state alone (the token copied out of it apart) and
    the model half writes its logits over the last step's; "fresh": the token is the decode
    program's last output, and the logits the model half's own."""
    monkeypatch.setenv("FREETOKEN_DECODE_OUTPUTS", outputs)
    ec = EngineConfig(dtype="float32", max_context=64, max_batch=2, page_size=8, prefill_chunk=16, moe_strategy="offload", expert_slots=6)
    engine = FreeTokenEngine.from_pretrained("demo", ec)
    runner = engine.runner
    table = np.zeros((2, ec.pages_per_sequence), np.int32)
    table[:, :2] = runner.pages.allocate(16)[:2], runner.pages.allocate(16)[:2]
    runner.set_rows(np.arange(2), jnp.asarray([3, 4], jnp.int32), [0, 0])
    batch = DecodeBatch(jnp.asarray(table), jnp.asarray([True, True]), Sampling.greedy(2))
    tok = runner.decode(batch)  # the first step takes the state's arrays as the engine made them
    before = _addresses(runner.state)
    assert before and all(v for v in before.values())
    toks = []
    for _ in range(3):
        toks.append(runner.decode(batch))
        assert np.asarray(toks[-1]).tolist() == np.asarray(runner.state.tokens_B).tolist()  # the token is the state's
    assert _addresses(runner.state) == before
    out = jax.eval_shape(runner.steps.decode.jitted, runner.weights, runner.state, batch, runner.experts)
    # the compiled program's outputs written over donated inputs (its module's input_output_alias entries)
    header = runner.steps.decode.lower(runner.weights, runner.state, batch, runner.experts).compile().as_text().split("\n", 1)[0]
    aliased = len(re.findall(r"\{[\d,]*\}: \(\d+", header))
    assert isinstance(out[0], DecodeState)
    if outputs == "donated":  # the state alone: every output overwrites a donated input
        assert len(out) == 1 and len(jax.tree.leaves(out)) == len(before) == aliased
    else:  # the state, then the token: one output of its own
        assert out[-1].shape == (2,) and len(jax.tree.leaves(out)) == len(before) + 1 == aliased + 1
    mask = jnp.full((2, (engine.model_config.vocab_size + 31) // 32), -1, jnp.int32)
    written, kept = [], []  # every step's logits kept: under "fresh" no two live buffers share an address
    for _ in range(3):  # the two halves: the model's, then the full sampler's
        logits = runner.decode_logits(batch)
        written.append(logits.unsafe_buffer_pointer())
        kept.append(logits)
        toks.append(runner.sample(logits, batch, mask))
        assert _addresses(runner.state) == before
        assert np.asarray(toks[-1]).tolist() == np.asarray(runner.state.tokens_B).tolist()
    # the model half's logits: over the last step's (donated), or at an address of their own each step
    assert (len(set(written[1:])) == 1) == (outputs == "donated")
    assert np.asarray(tok).shape == (2,) and all(np.asarray(t).shape == (2,) for t in toks)
    assert np.asarray(toks[-1]).tolist() == np.asarray(runner.state.tokens_B).tolist()


def test_decode_steps_carry_no_jax_effect():
    """jit dispatches a step that has a JAX effect through its Python path at every call (on the
    H200 that cost a 24-layer hybrid step most of its host time): the decode step of every
    strategy, the CPU handoff's FFI pair included, has none."""
    for strategy in ("fused", "offload", "hybrid", "cpu"):
        ec = EngineConfig(dtype="float32", max_context=64, max_batch=2, page_size=8, prefill_chunk=16, moe_strategy=strategy,
                          expert_slots=None if strategy in ("fused", "cpu") else 6, cpu_handoff="ffi")  # fmt: skip
        runner = FreeTokenEngine.from_pretrained("demo", ec).runner
        batch = DecodeBatch(jnp.zeros((2, ec.pages_per_sequence), jnp.int32), jnp.asarray([True, False]), Sampling.greedy(2))
        jaxpr = jax.make_jaxpr(runner.steps.decode.jitted)(runner.weights, runner.state, batch, runner.experts)
        text = str(jaxpr)
        assert (strategy in ("hybrid", "cpu")) == ("freetoken_moe_submit" in text), strategy  # the pair is in the step
        assert jaxpr.effects == set(), (strategy, jaxpr.effects)
        runner.close()


def test_an_unknown_decode_outputs_setting_is_refused(monkeypatch):
    from freetoken_jax.runtime.runner import StepSet

    monkeypatch.setenv("FREETOKEN_DECODE_OUTPUTS", "host")
    with pytest.raises(ValueError, match="FREETOKEN_DECODE_OUTPUTS='host'"):
        StepSet("float32")
