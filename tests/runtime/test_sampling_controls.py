"""The full sampler against a numpy model of its definitions, and end to end: penalties, logit
bias, min_tokens and grammars through the engine's generation loop, token for token against a
float64 reference that re-scores the whole sequence at every step."""

import json

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.runtime.sampling import (
    MAX_LOGIT_BIAS,
    NO_TOKEN,
    GenerationParams,
    RequestError,
    process_logits,
    sample_full,
    sampling_row,
    sampling_rows,
)


def reference_process(logits, counts, p: GenerationParams, position, prompt_len, stops, allowed=None):
    """The definitions, in float64, one row at a time."""
    x = logits.astype(np.float64).copy()
    out, seen = counts >> 1, counts > 0
    r = p.repetition_penalty
    x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    x -= p.frequency_penalty * out + p.presence_penalty * (out > 0)
    for t, b in p.logit_bias:
        x[t] += b
    if position - (prompt_len - 1) < p.min_tokens:  # the output index this step samples
        x[list(stops)] = -np.inf
    if allowed is not None:
        x[~allowed] = -np.inf
    return x


@pytest.mark.parametrize("V", [7, 64, 300])
def test_process_logits_equals_the_definitions(V):
    rng = np.random.default_rng(V)
    B = 4
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    counts = (rng.integers(0, 4, (B, V)) * 2 + rng.integers(0, 2, (B, V))) * (rng.random((B, V)) < 0.3)
    counts = counts.astype(np.int32)
    ps = [
        GenerationParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((1, 5.0), (V - 1, -2.5))),
        GenerationParams(min_tokens=3, stop_token_ids=(2,)),
        GenerationParams(repetition_penalty=0.8, frequency_penalty=-1.0),
        GenerationParams(),
    ]
    prompt_len, positions = 5, np.array([4, 5, 6, 7])
    s = sampling_rows([sampling_row(p, prompt_len, (0,)) for p in ps])
    allowed = rng.random((B, V)) < 0.5
    allowed[:, 0] = True
    words = np.zeros((B, (V + 31) // 32), np.uint32)
    for b, t in zip(*np.nonzero(allowed)):
        words[b, t // 32] |= np.uint32(1 << (t % 32))
    got = np.asarray(process_logits(jnp.asarray(logits), s, jnp.asarray(counts), jnp.asarray(positions), jnp.asarray(words.view(np.int32))))
    for b, p in enumerate(ps):
        want = reference_process(logits[b], counts[b], p, positions[b], prompt_len, p.stop_set((0,)), allowed[b])
        np.testing.assert_allclose(got[b], want, rtol=1e-6, atol=1e-5)
    # min_tokens lifts its ban at the step that samples output token min_tokens
    assert np.isneginf(got[1, [0, 2]]).all() if positions[1] - (prompt_len - 1) < 3 else True
    later = np.asarray(process_logits(jnp.asarray(logits), s, jnp.asarray(counts), jnp.asarray(positions + 2)))
    assert np.isfinite(later[1, [0, 2]]).all()


def test_min_p_support_and_logprobs():
    logits = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]] * 3, jnp.float32)
    p = np.asarray(jax.nn.softmax(logits[0]))
    s = sampling_rows([GenerationParams(temperature=1.0, min_p=0.3, seed=i) for i in range(3)])
    draw = jax.jit(lambda seeds: sample_full(logits, s.__class__(**{**vars(s), "seeds_B": seeds}), jnp.zeros((3, 6), jnp.int32),
                                             jnp.zeros(3, jnp.int32)))  # fmt: skip
    seen = set()
    for k in range(200):
        tok, lp = draw(jnp.arange(3 * k, 3 * k + 3, dtype=jnp.uint32))
        seen |= set(np.asarray(tok).tolist())
    assert seen == {i for i in range(6) if p[i] >= 0.3 * p.max()}
    want = np.log(p)
    np.testing.assert_allclose(np.asarray(lp.chosen_B), want[np.asarray(tok)], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(lp.top_ids_BN)[0], np.argsort(-want))
    np.testing.assert_allclose(np.asarray(lp.top_BN)[0], np.sort(want)[::-1], atol=1e-5)


def test_bad_controls_are_refused():
    for bad in (dict(min_p=1.5), dict(presence_penalty=3), dict(repetition_penalty=0), dict(min_tokens=99, max_new_tokens=4),
                dict(logit_bias=((5, 101.0),)), dict(logit_bias=((999, 1.0),)), dict(logprobs=21),
                dict(logit_bias=tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1)))):  # fmt: skip
        with pytest.raises(RequestError):
            GenerationParams(**bad).check([1, 2], 320, 128)
    assert sampling_row(GenerationParams())[8][0] == NO_TOKEN


# End to end ---------------------------------------------------------------------------------------
EC = EngineConfig(dtype="float32", max_context=64, max_batch=4, page_size=8, prefill_chunk=16)
PROMPT = [256] + list(b"abcabcabc ab")


@pytest.fixture(scope="module")
def engine():
    return FreeTokenEngine.from_pretrained("demo", EC)


def reference_generate(engine, prompt, p: GenerationParams, n):
    """Greedy decoding of the processed logits, each step scored from scratch."""
    V = engine.model_config.vocab_size
    stops = p.stop_set(engine.model_config.eos_token_ids)
    out = []
    for _ in range(n):
        logits = engine.logits(prompt + out)[-1]
        counts = np.zeros(V, np.int64)
        counts[prompt] = 1
        for t in out:
            counts[t] += 2
        x = reference_process(logits, counts, p, len(prompt) + len(out) - 1, len(prompt), stops)
        out.append(int(np.argmax(x)))
        if out[-1] in stops:
            break
    return out


@pytest.mark.parametrize(
    "controls",
    [
        dict(repetition_penalty=1.5),
        dict(presence_penalty=1.5, frequency_penalty=0.7),
        dict(logit_bias={98: 4.0, 99: 3.0}, frequency_penalty=2.0),
    ],
)
def test_penalties_end_to_end(engine, controls):
    p = GenerationParams(max_new_tokens=10, ignore_eos=True, **{k: v for k, v in controls.items() if k != "logit_bias"},
                         logit_bias=tuple(controls.get("logit_bias", {}).items()))  # fmt: skip
    got = list(engine.generate(PROMPT, **vars(p)))
    assert got == reference_generate(engine, PROMPT, p, 10)
    assert got != list(engine.generate(PROMPT, max_new_tokens=10, ignore_eos=True))  # the controls changed the output


def test_min_tokens_holds_back_stop_tokens(engine):
    plain = list(engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True))
    stop = plain[1]
    got = list(engine.generate(PROMPT, max_new_tokens=8, stop_token_ids=[stop], ignore_eos=True, min_tokens=4))
    p = GenerationParams(max_new_tokens=8, stop_token_ids=(stop,), ignore_eos=True, min_tokens=4)
    assert got == reference_generate(engine, PROMPT, p, 8)
    assert stop not in got[:4] and len(got) >= 4


def test_logprobs_of_every_step(engine):
    p = GenerationParams(max_new_tokens=6, temperature=0.9, seed=3, ignore_eos=True, logprobs=5)
    events = [ev for _, ev in engine._drive(engine._submit([PROMPT], [p])) if ev.kind == "token"]
    toks = [ev.token for ev in events]
    logits = engine.logits(PROMPT + toks)[len(PROMPT) - 1 : -1]
    lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)))
    for k, ev in enumerate(events):
        chosen, top = ev.logprobs
        assert abs(chosen - lp[k, toks[k]]) < 1e-3
        assert [t for t, _ in top] == np.argsort(-lp[k])[:5].tolist()
        np.testing.assert_allclose([v for _, v in top], np.sort(lp[k])[::-1][:5], atol=1e-3)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False}  # fmt: skip


def test_json_schema_and_regex_hold_on_random_weights(engine):
    tok = engine.tokenizer
    for seed in range(3):
        out = list(engine.generate(PROMPT, max_new_tokens=48, temperature=1.0, seed=seed, json_schema=SCHEMA))
        jsonschema.validate(json.loads(tok.decode(out)), SCHEMA)
    out = list(engine.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=7, regex=r"[0-9]{3}-[a-z]{2}"))
    text = tok.decode(out)
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()
    words = ["cat", "catalogue", 'a "b" \\ c']  # one a prefix of another; quotes and a backslash taken literally
    got = {tok.decode(list(engine.generate(PROMPT, max_new_tokens=20, temperature=1.5, seed=s, choice=words))) for s in range(6)}
    assert got <= set(words) and len(got) > 1


def test_grammar_rows_beside_free_rows(engine):
    """A constrained row in the batch (the two-half step) leaves the others' tokens as they are alone."""
    prompts = [PROMPT, [256] + list(b"other prompt"), [256] + list(b"third"), [256] + list(b"fourth")]
    alone = [list(engine.generate(q, max_new_tokens=10, ignore_eos=True)) for q in prompts[1:3]]
    gs = [engine._grammar(json_schema=SCHEMA), None, None, engine._grammar(regex="[a-c]{5}x")]  # two rows' masks in parallel
    ps = [GenerationParams(max_new_tokens=48, temperature=1.0, seed=1), GenerationParams(max_new_tokens=10, ignore_eos=True),
          GenerationParams(max_new_tokens=10, ignore_eos=True, logprobs=2), GenerationParams(max_new_tokens=10, temperature=1.0, seed=2)]  # fmt: skip
    out = [[], [], [], []]
    for i, ev in engine._drive(engine._submit(prompts, ps, gs)):
        if ev.kind == "token":
            out[i].append(ev.token)
    jsonschema.validate(json.loads(engine.tokenizer.decode(out[0])), SCHEMA)
    assert out[1:3] == alone
    text = engine.tokenizer.decode(out[3])
    assert len(text) == 6 and set(text[:5]) <= set("abc") and text[5] == "x"


def test_bad_grammar_is_a_request_error(engine):
    with pytest.raises(RequestError, match="grammar|schema"):
        list(engine.generate(PROMPT, regex="([a-z"))
    with pytest.raises(RequestError):
        list(engine.generate(PROMPT, json_schema=SCHEMA, regex="a"))
    for bad in ([], [""], "cat"):
        with pytest.raises(RequestError, match="choice"):
            list(engine.generate(PROMPT, choice=bad))


def test_stream_text_yields_whole_characters(engine):
    """Multi-byte characters split over byte tokens (the demo's tokenizer) come out whole; a
    token-by-token decode would print U+FFFD for each partial byte."""
    want = "héllo こんにちは 🙂"
    deltas = list(engine.stream_text(PROMPT, max_new_tokens=40, regex=want))
    assert "".join(deltas) == want and not any("\ufffd" in d for d in deltas) and len(deltas) > 1


def test_sampled_rows_beside_a_top_p_row_keep_their_tokens(engine):
    """A row with top-p sends its batch through the decode step that sorts the vocabulary; a
    sampling row beside it draws the tokens it draws alone through the plain decode step. The
    two steps are the engine's two decode executables."""
    prompts = [PROMPT, [256] + list(b"other prompt")]
    free = GenerationParams(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=5)
    alone = list(engine.generate(prompts[0], **vars(free)))
    ps = [free, GenerationParams(max_new_tokens=12, ignore_eos=True, temperature=1.0, top_p=0.5, seed=6)]
    out = [[], []]
    for i, ev in engine._drive(engine._submit(prompts, ps, [None, None])):
        if ev.kind == "token":
            out[i].append(ev.token)
    assert out[0] == alone and len(set(alone)) > 3
    assert engine.runner.steps.traces.get("decode_step") and engine.runner.steps.traces.get("decode_step_plain")
