"""A prompt's log-probabilities (`GenerationParams.prompt_logprobs`) come from the prefill chunks
that compute it: `steps.chunk_logprobs` against float64 arithmetic over the same hidden states,
and a request's records against `engine.logits` under every strategy's prefill path, its rows
sharing chunks with rows that ask for nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.engine import GenerationParams
from freetoken_jax.runtime.sampling import TOP_LOGPROBS, RequestError
from freetoken_jax.runtime.steps import chunk_logprobs


@pytest.mark.parametrize("T,block", [(1, 8), (20, 8), (24, 8), (20, 128), (37, 5)])
def test_chunk_logprobs_equals_float64(demo_engine, T, block):
    weights = demo_engine.runner.weights
    model = weights.model()
    rng = np.random.default_rng(T * 100 + block)
    h = rng.standard_normal((2, T, demo_engine.model_config.hidden_dim)).astype(np.float32)
    V = demo_engine.model_config.vocab_size
    targets = rng.integers(0, V, (2, T)).astype(np.int32)
    targets[1, T // 2 :] = -1
    got = jax.jit(lambda w, h, t: chunk_logprobs(w, h, t, block))(weights, jnp.asarray(h), jnp.asarray(targets))
    logits = np.asarray(model.logits(jnp.asarray(h)), np.float64)  # [2, T, V]
    lp = logits - logits.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    b, t = np.nonzero(targets >= 0)
    np.testing.assert_allclose(np.asarray(got.chosen_B)[b, t], lp[b, t, targets[b, t]], atol=2e-5)
    N = min(TOP_LOGPROBS, V)
    assert got.top_ids_BN.shape == (2, T, N)
    np.testing.assert_allclose(np.asarray(got.top_BN), -np.sort(-lp, axis=-1)[..., :N], atol=2e-5)
    np.testing.assert_allclose(np.take_along_axis(lp, np.asarray(got.top_ids_BN), -1), np.asarray(got.top_BN), atol=2e-5)


PROMPTS = [[256] + list(b"a prompt scored position by position, over three chunks"), [256] + list(b"not scored"), [256, 7], [256]]


@pytest.mark.parametrize("strategy", ["fused", "offload", "hybrid"])
def test_prompt_records_are_the_models(strategy):
    ecfg = EngineConfig(dtype="float32", max_context=96, max_batch=4, page_size=8, prefill_chunk=16, moe_strategy=strategy,
                        expert_slots=None if strategy == "fused" else 40)  # fmt: skip
    e = FreeTokenEngine.from_pretrained("demo", ecfg)
    ps = [GenerationParams(max_new_tokens=3, prompt_logprobs=3), GenerationParams(max_new_tokens=3),
          GenerationParams(max_new_tokens=2, prompt_logprobs=0, logprobs=1), GenerationParams(max_new_tokens=2, prompt_logprobs=2)]  # fmt: skip
    handles = e._submit(PROMPTS, ps)  # prefilled together: scored rows beside one that is not
    firsts = {}
    for i, ev in e._drive(handles):
        if ev.kind == "token" and i not in firsts:
            firsts[i] = list(handles[i].prompt_logprobs)  # complete before the first token arrives
    for p, h, q, i in zip(PROMPTS, handles, ps, range(4)):
        assert h.prompt_logprobs == firsts[i]
        if q.prompt_logprobs is None:
            assert h.prompt_logprobs == []
            continue
        lp = np.asarray(jax.nn.log_softmax(e.logits(p), axis=-1))
        assert [r[0] for r in h.prompt_logprobs] == p[1:]
        np.testing.assert_allclose([r[1] for r in h.prompt_logprobs], lp[np.arange(len(p) - 1), p[1:]], atol=1e-4)
        for k, r in enumerate(h.prompt_logprobs):
            assert [t for t, _ in r[2]] == list(np.argsort(-lp[k])[: q.prompt_logprobs])
    # the tokens are those of a request that scores nothing
    assert [h.generated for h in handles] == [list(e.generate(p, max_new_tokens=q.max_new_tokens)) for p, q in zip(PROMPTS, ps)]


def test_prompt_logprobs_out_of_range_is_refused(demo_engine):
    with pytest.raises(RequestError, match="prompt_logprobs"):
        demo_engine.check_request([256, 7], GenerationParams(max_new_tokens=2, prompt_logprobs=TOP_LOGPROBS + 1))
