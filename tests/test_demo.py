"""The built-in demo model writes English: its greedy continuations are made of words of the
text it was trained on (`tools/train_demo.py`), where random weights of its shape are not."""

import re

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.demo import DEMO_CONFIG
from freetoken_jax.tokenizer import ByteTokenizer

EC = EngineConfig(dtype="float32", max_context=256, max_batch=1)
PROMPTS = ["The return statement", "A class is", "If the"]


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]{2,}", text)


def known_share(engine, vocab) -> tuple[float, list[str]]:
    got = []
    for p in PROMPTS:
        got += words(engine.tokenizer.decode(list(engine.generate(p, max_new_tokens=96))))
    return sum(w in vocab for w in got) / max(1, len(got)), got


def test_demo_model_writes_english_words():
    from pydoc_data.topics import topics

    vocab = set(words(" ".join(topics.values())))
    share, got = known_share(FreeTokenEngine.from_pretrained("demo", EC), vocab)
    assert len(got) >= 3 * 8, got  # words, not runs of punctuation or spaces
    assert share >= 0.9, (share, got)
    assert len({"the", "is", "of", "to", "and", "in", "an"} & set(got)) >= 2, got
    random_share, random_got = known_share(FreeTokenEngine(DEMO_CONFIG, EC, tokenizer=ByteTokenizer()), vocab)
    assert random_share < 0.5 or len(random_got) < 8, (random_share, random_got)  # the check tells the two apart
