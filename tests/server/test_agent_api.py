"""What agents and apps send, through the official openai client against the demo model:
log-probabilities against engine.logits, structured output against its schema (streamed and
not, many seeds), penalties and biases as the engine applies them, and 400s for what is not
supported."""

import json

import jax
import jsonschema
import numpy as np
import openai
import pytest
from helpers import demo_server

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.server.text import render_chat

EC = EngineConfig(dtype="float32", max_context=160, max_batch=4, page_size=8, prefill_chunk=32)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 30}},
          "required": ["city", "days"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def server():
    with demo_server(EC) as (url, service):
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120), service


@pytest.fixture(scope="module")
def reference():
    return FreeTokenEngine.from_pretrained("demo", EC)


def log_softmax(x):
    return np.asarray(jax.nn.log_softmax(np.asarray(x, np.float32), axis=-1))


def test_chat_logprobs_are_the_models(server, reference):
    client, service = server
    msgs = [{"role": "user", "content": "Name a color"}]
    r = client.chat.completions.create(model="demo", messages=msgs, max_tokens=8, temperature=0.8, seed=5, logprobs=True, top_logprobs=4)
    content = r.choices[0].logprobs.content
    prompt = service.encode(render_chat(service.template, msgs))
    toks = list(reference.generate(prompt, max_new_tokens=8, temperature=0.8, seed=5))  # the same seed samples the same tokens
    assert len(content) == r.usage.completion_tokens == len(toks)
    lp = log_softmax(reference.logits(prompt + toks)[len(prompt) - 1 : -1])
    for k, e in enumerate(content):
        assert e.token == service.tokenizer.decode([toks[k]])
        assert abs(e.logprob - lp[k, toks[k]]) < 1e-3
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], np.sort(lp[k])[::-1][:4], atol=1e-3)
        assert [t.token for t in e.top_logprobs] == [service.tokenizer.decode([t]) for t in np.argsort(-lp[k])[:4]]


def test_completion_logprobs_are_the_models(server, reference):
    client, service = server
    prompt = service.encode("Once upon")
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    got = list(reference.generate(prompt, max_new_tokens=6))
    want = log_softmax(reference.logits(prompt + got)[len(prompt) - 1 : -1])
    n = len(lp.token_logprobs)
    assert n == r.usage.completion_tokens == len(got)
    np.testing.assert_allclose(lp.token_logprobs, want[np.arange(n), got[:n]], atol=1e-3)
    for k in range(n):  # keyed by text: tokens that read the same share an entry
        expect = {}
        for t in np.argsort(-want[k])[:3]:
            expect.setdefault(service.tokenizer.decode([t]), float(want[k, t]))
        assert lp.top_logprobs[k] == pytest.approx(expect, abs=1e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(n)]


def test_streamed_logprobs_equal_non_streamed(server):
    client, _ = server
    kw = dict(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=10, temperature=0.7, seed=9, logprobs=True, top_logprobs=2
    )
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    parts = []
    for c in client.chat.completions.create(stream=True, **kw):
        if c.choices and c.choices[0].logprobs:
            parts += c.choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 4)) for e in parts] == [(e.token, round(e.logprob, 4)) for e in whole]


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(server, stream):
    client, _ = server
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    for seed in range(20):
        kw = dict(
            model="demo", messages=[{"role": "user", "content": "plan"}], max_tokens=64, temperature=1.0, seed=seed, response_format=fmt
        )
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices)
        else:
            r = client.chat.completions.create(**kw)
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_regex_and_gbnf(server):
    client, _ = server
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=48, temperature=1.0, seed=1,
                                       response_format={"type": "json_object"})  # fmt: skip
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model="demo", prompt="Date:", max_tokens=16, temperature=1.0, seed=2,
                                  extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])"})  # fmt: skip
    assert len(r.choices[0].text) == 7 and r.choices[0].text.startswith("20")
    r = client.completions.create(model="demo", prompt="Answer:", max_tokens=8, temperature=1.0, seed=3,
                                  extra_body={"grammar": 'root ::= ("yes" | "no") "."'})  # fmt: skip
    assert r.choices[0].text in ("yes.", "no.")


def test_guided_choice_and_structured_outputs(server):
    """vLLM's guided_choice and its structured_outputs spelling of every guided field: the output
    is one of the choices (quotes, backslashes, regex characters and non-ASCII taken literally)."""
    client, _ = server
    choices = ['yes "quoted"', "no\\back", "ünïcode ☃", "a|b (c)*"]
    seen = set()
    for seed in range(8):
        r = client.completions.create(model="demo", prompt="Pick:", max_tokens=24, temperature=1.5, seed=seed,
                                      extra_body={"guided_choice": choices})  # fmt: skip
        assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"
        seen.add(r.choices[0].text)
    assert len(seen) > 1
    chat = dict(model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=40, temperature=1.0, seed=4)
    so = lambda **kw: client.chat.completions.create(**chat, extra_body={"structured_outputs": kw}).choices[0].message.content  # noqa: E731
    assert so(choice=["left", "right"]) in ("left", "right")
    assert len(so(regex="[0-9]{3}")) == 3 and so(regex="[0-9]{3}").isdigit()
    assert isinstance(json.loads(so(json_object=True)), dict)
    assert json.loads(
        so(
            json={
                "type": "object",
                "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["k"],
                "additionalProperties": False,
            }
        )
    ).keys() == {"k"}
    assert so(grammar='start: "ab" | "cd"') in ("ab", "cd")


def test_penalties_and_bias_are_applied(server, reference):
    client, service = server
    prompt = service.encode("abcabcabc")
    for kw in (dict(presence_penalty=1.5, frequency_penalty=0.5), dict(extra_body={"repetition_penalty": 1.4}),
               dict(logit_bias={"120": 8.0}), dict(extra_body={"min_tokens": 6}, stop=None)):  # fmt: skip
        r = client.completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0, **kw)
        eng = {**{k: v for k, v in kw.items() if k not in ("extra_body", "stop")}, **kw.get("extra_body", {})}
        want = list(reference.generate(prompt, max_new_tokens=10, **eng))
        eos = reference.model_config.eos_token_ids
        assert r.choices[0].text == service.tokenizer.decode([t for t in want if t not in eos])
        assert r.usage.completion_tokens == len(want)
    plain = client.completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0).choices[0].text
    biased = client.completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0, logit_bias={"120": 100.0}).choices[0].text
    assert biased == "x" * 10 != plain


@pytest.mark.parametrize(
    "extra",
    [{"logit_bias": {"abc": 1}}, {"logit_bias": {"5": 500}}, {"min_p": 2}, {"response_format": {"type": "json_schema"}},
     {"guided_regex": "([a-z"}, {"guided_json": {"type": "object"}, "guided_regex": "a"}, {"top_logprobs": 3}, {"n": 17},
     {"presence_penalty": 9}, {"functions": [{"name": "f"}]}, {"guided_choice": []}, {"guided_choice": ["a"], "guided_regex": "b"},
     {"structured_outputs": {"structural_tag": "x"}}, {"structured_outputs": {"choice": ["a"], "regex": "b"}}],
)  # fmt: skip
def test_bad_or_unsupported_fields_are_400(server, extra):
    client, _ = server
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=4, extra_body=extra)
    assert client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=2).choices


def test_n_choices_share_the_prompt_prefill(server, reference):
    client, service = server
    prompt = service.encode("four choices of one prompt, prefilled once")
    P = EC.page_size
    assert len(prompt) % P  # the last partial page is each choice's own
    before = service.scheduler.get_metrics()
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=1.0, seed=40, n=4)
    after = service.scheduler.get_metrics()
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    eos = reference.model_config.eos_token_ids
    for i, c in enumerate(r.choices):
        want = list(reference.generate(prompt, max_new_tokens=8, temperature=1.0, seed=40 + i))
        assert c.text == service.tokenizer.decode([t for t in want if t not in eos])
    shared = (len(prompt) // P) * P
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 3 * shared
    assert after["prefilled_tokens"] - before["prefilled_tokens"] == len(prompt) + 3 * (len(prompt) - shared)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == sum(
        len(list(reference.generate(prompt, max_new_tokens=8, temperature=1.0, seed=40 + i))) for i in range(4)
    )


def test_n_choices_stream_as_they_do_alone(server):
    client, _ = server
    kw = dict(model="demo", messages=[{"role": "user", "content": "two"}], max_tokens=10, temperature=0.9, seed=7, n=2)
    whole = client.chat.completions.create(**kw)
    parts, finishes = ["", ""], [None, None]
    for c in client.chat.completions.create(stream=True, **kw):
        for ch in c.choices:
            parts[ch.index] += ch.delta.content or ""
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    assert parts == [c.message.content for c in whole.choices] and finishes == [c.finish_reason for c in whole.choices]


def test_best_of_keeps_the_most_likely_and_echo_prepends_the_prompt(server, reference):
    client, service = server
    prompt = service.encode("best of three")
    r = client.completions.create(
        model="demo", prompt=prompt, max_tokens=6, temperature=1.0, seed=3, best_of=3, extra_body={"ignore_eos": True}
    )
    cands = [list(reference.generate(prompt, max_new_tokens=6, temperature=1.0, seed=3 + i, ignore_eos=True)) for i in range(3)]
    score = [sum(log_softmax(reference.logits(prompt + c)[len(prompt) - 1 : -1])[np.arange(6), c]) for c in cands]
    assert len(r.choices) == 1 and r.choices[0].text == service.tokenizer.decode(cands[int(np.argmax(score))])
    e = client.completions.create(model="demo", prompt="Echo me", max_tokens=3, temperature=0, echo=True)
    assert e.choices[0].text.startswith("Echo me") and len(e.choices[0].text) > len("Echo me")


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(server, reference):
    """lm-evaluation-harness's `local-completions` scores a continuation by sending context and
    continuation as token ids with echo, logprobs 1 and max_tokens 1, and summing
    token_logprobs[len(context):-1]; two prompts in one request, one longer than a prefill chunk."""
    client, service = server
    ctx = service.encode("Question: which word follows? The long answer is spread over several chunks of the prefill:")
    prompts = [ctx + service.encode(" blue", add_bos=False), service.encode("Short one")]
    assert len(prompts[0]) > EC.prefill_chunk
    r = client.completions.create(model="demo", prompt=prompts, max_tokens=1, logprobs=2, echo=True, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == sum(map(len, prompts))
    for c, p in zip(r.choices, prompts):
        lp = log_softmax(reference.logits(p))
        got = c.logprobs
        assert len(got.token_logprobs) == len(p) + 1 and got.token_logprobs[0] is None and got.top_logprobs[0] is None
        np.testing.assert_allclose(got.token_logprobs[1 : len(p)], lp[np.arange(len(p) - 1), p[1:]], atol=1e-4)
        for k in range(1, len(p)):
            expect = {}
            for t in np.argsort(-lp[k - 1])[:2]:
                expect.setdefault(service.tokenizer.decode([t]), float(lp[k - 1, t]))
            assert got.top_logprobs[k] == pytest.approx(expect, abs=1e-4)
        nxt = int(np.argmax(lp[-1]))  # the generated token, greedy, after the prompt
        assert got.token_logprobs[-1] == pytest.approx(float(lp[-1, nxt]), abs=1e-4)
        assert c.text == service.decode(p) + service.tokenizer.decode([nxt])
    cont = sum(r.choices[0].logprobs.token_logprobs[len(ctx) : -1])
    want = log_softmax(reference.logits(prompts[0]))[len(ctx) - 1 : -1]
    assert cont == pytest.approx(float(sum(want[np.arange(len(prompts[0]) - len(ctx)), prompts[0][len(ctx) :]])), abs=1e-3)
    # the first prompt is in the prefix cache now: a scored prompt is computed again, not read from it
    again = client.completions.create(model="demo", prompt=prompts[0], max_tokens=0, logprobs=0, echo=True)
    assert again.usage.prompt_tokens_details.cached_tokens == 0 and again.usage.completion_tokens == 0
    assert again.choices[0].text == service.decode(prompts[0]) and again.choices[0].finish_reason == "length"
    assert again.choices[0].logprobs.token_logprobs == pytest.approx(r.choices[0].logprobs.token_logprobs[:-1], abs=1e-5)
    assert again.choices[0].logprobs.top_logprobs[1:] == [{}] * (len(prompts[0]) - 1)
    # n choices share the first one's prompt log-probabilities (it alone computes them; the others read its pages)
    two = client.completions.create(model="demo", prompt=prompts[1], max_tokens=2, logprobs=1, echo=True, n=2, temperature=1.0, seed=3)
    want = r.choices[1].logprobs.token_logprobs[: len(prompts[1])]
    for c in two.choices:
        assert c.logprobs.token_logprobs[: len(prompts[1])] == pytest.approx(want, abs=1e-5)


def test_a_batch_of_prompts_gives_each_its_choices(server, reference):
    client, service = server
    texts = ["A batch", "of three", "prompts"]
    r = client.completions.create(model="demo", prompt=texts, max_tokens=5, temperature=0.8, seed=11, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(6))
    total = 0
    for i, t in enumerate(texts):
        p = service.encode(t)
        total += len(p)
        for k in range(2):
            want = list(reference.generate(p, max_new_tokens=5, temperature=0.8, seed=11 + k, ignore_eos=True))
            assert r.choices[2 * i + k].text == service.tokenizer.decode(want)
    assert r.usage.prompt_tokens == total and r.usage.completion_tokens == 30
    streamed = ["", "", "", "", "", ""]
    for c in client.completions.create(model="demo", prompt=texts, max_tokens=5, temperature=0.8, seed=11, n=2, stream=True,
                                       extra_body={"ignore_eos": True}):  # fmt: skip
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert streamed == [c.text for c in r.choices]
    ids = [service.encode(t) for t in texts[:2]]
    assert [c.text for c in client.completions.create(model="demo", prompt=ids, max_tokens=5, temperature=0.8, seed=11,
                                                      extra_body={"ignore_eos": True}).choices] == [r.choices[0].text, r.choices[2].text]  # fmt: skip


@pytest.mark.parametrize(
    "body",
    [{"prompt": [], "max_tokens": 2}, {"prompt": [[]], "max_tokens": 2}, {"prompt": ["x", 5], "max_tokens": 2},
     {"prompt": [True], "max_tokens": 2}, {"prompt": ["x"] * 1025, "max_tokens": 2}, {"prompt": "x", "max_tokens": 0},
     {"prompt": "x", "max_tokens": 0, "echo": True, "stream": True}, {"prompt": "x", "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True},
     {"prompt": "x", "max_tokens": 2, "echo": True, "logprobs": 21}, {"prompt": "x", "max_tokens": 2, "suffix": "y"}],
)  # fmt: skip
def test_bad_prompts_and_scoring_requests_are_400(server, body):
    client, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", **body)
    assert e.value.body["param"] in ("prompt", "max_tokens", "stream", "logprobs", "suffix")  # suffix: the demo has no FIM tokens
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=0)
