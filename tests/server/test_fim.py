"""Fill in the middle (`server/fim.py`): each format found from its tokens, the prompt laid out as
the model reads it, and a completions request with `suffix` against the engine given those ids."""

import openai
import pytest
from helpers import chat_checkpoint, model_server
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.server import fim
from freetoken_jax.tokenizer import ByteTokenizer, HFTokenizer

QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|file_sep|>"]
EC = EngineConfig(dtype="float32", max_context=256, max_batch=2, page_size=8, prefill_chunk=64)


def byte_tokenizer(special: list[str]) -> HFTokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(special)
    return HFTokenizer(tok)


@pytest.mark.parametrize("f", fim.FORMATS, ids=lambda f: f.name)
def test_each_format_is_found_and_laid_out(f):
    markers = [t for t in (f.prefix, f.suffix, f.middle) if t]
    tok = byte_tokenizer(["<|endoftext|>", *markers, *f.extra_stops])
    assert fim.detect(tok) == f
    ids = f.ids(tok, "def f(x):", "  return y")
    p, s = tok.encode("def f(x):", add_bos=False), tok.encode("  return y", add_bos=False)
    t = tok.token_id
    want = [t(f.suffix), *s, t(f.prefix), *p] if f.middle is None else [t(f.prefix), *p, t(f.suffix), *s, t(f.middle)]
    assert ids == want
    assert sorted(f.stops(tok)) == sorted(t(m) for m in markers + list(f.extra_stops))
    assert fim.detect(byte_tokenizer(["<|endoftext|>", *markers[:-1]])) is None  # one marker missing
    assert fim.detect(ByteTokenizer()) is None


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    path = chat_checkpoint(str(tmp_path_factory.mktemp("coder")), "{{ messages[0]['content'] }}", QWEN, eos="<|endoftext|>")
    with model_server(path, "coder", EC) as (url, service):
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120), service, path


def test_suffix_completes_the_middle(coder):
    client, service, path = coder
    assert service.fim.name == "qwen"
    ref = FreeTokenEngine.from_pretrained(path, EC)
    tok = ref.tokenizer
    prefix, suffix = "def add(a, b):\n    ", "\n    return c\n"
    ids = [tok.token_id("<|fim_prefix|>"), *tok.encode(prefix, add_bos=False), tok.token_id("<|fim_suffix|>"),
           *tok.encode(suffix, add_bos=False), tok.token_id("<|fim_middle|>")]  # fmt: skip
    stops = [tok.token_id(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|file_sep|>")]
    for seed in range(3):
        want = list(ref.generate(ids, max_new_tokens=16, temperature=1.0, seed=seed, stop_token_ids=stops))
        r = client.completions.create(model="coder", prompt=prefix, suffix=suffix, max_tokens=16, temperature=1.0, seed=seed)
        assert r.choices[0].text == tok.decode(want) and r.usage.prompt_tokens == len(ids)
        assert r.choices[0].finish_reason == (
            "length" if len(want) == 16 and want[-1] not in stops + [tok.token_id("<|endoftext|>")] else "stop"
        )
    two = client.completions.create(model="coder", prompt=[prefix, "x = "], suffix=suffix, max_tokens=4, temperature=0)
    assert len(two.choices) == 2 and two.usage.prompt_tokens == len(ids) + len(fim.FORMATS[0].ids(tok, "x = ", suffix))
    for bad in (dict(prompt=tok.encode(prefix)), dict(prompt=prefix, echo=True)):
        with pytest.raises(openai.BadRequestError, match="suffix"):
            client.completions.create(model="coder", suffix=suffix, max_tokens=4, **bad)
    plain = client.completions.create(model="coder", prompt=prefix, suffix="", max_tokens=4, temperature=0)  # "" asks for nothing
    assert plain.usage.prompt_tokens == len(tok.encode(prefix))
