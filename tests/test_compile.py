"""One executable per bucket: repeated requests of other lengths in the same buckets compile nothing."""

from freetoken_jax import EngineConfig, FreeTokenEngine


def test_compiles_once_per_bucket():
    engine = FreeTokenEngine.from_pretrained(
        "demo", EngineConfig(dtype="float32", max_context=64, max_batch=2, page_size=8, prefill_chunk=16)
    )
    list(engine.generate(list(range(1, 10)), max_new_tokens=5, ignore_eos=True))
    first = engine.compilations()
    assert first == {"prefill": 1, "decode": 1, "score": 0}
    # Same buckets (B=1, T=16, 2 pages of 8): other prompt lengths, sampling settings, seeds.
    for n, temp in ((5, 0.0), (9, 0.8), (4, 1.3)):
        list(engine.generate(list(range(1, n + 1)), max_new_tokens=5, temperature=temp, top_k=4, seed=n, ignore_eos=True))
    assert engine.compilations() == first
    # A new batch bucket compiles one more of each, once.
    engine.generate_batch([[1, 2], [3, 4, 5]], max_new_tokens=6)
    engine.generate_batch([[7], [8, 9]], max_new_tokens=8)
    assert engine.compilations() == {"prefill": 2, "decode": 2, "score": 0}
