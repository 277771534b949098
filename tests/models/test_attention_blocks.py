"""`attend_paged` (blocks of the page table with a running softmax, stopping after the last block
read) and `attend_chunk` (the chunk's own keys causal, joined with the blocks before it) against
`attend` over everything gathered (the reference), and the models' long prefill through both
against transformers; `attend_latent` (MLA decode in the latent space) against `attend`
over the keys and values expanded from the latents."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from freetoken_jax.memory import kv_cache
from freetoken_jax.memory.kv_cache import KVView, gather_pages
from freetoken_jax.models.attention import attend, attend_chunk, attend_latent, attend_paged

PAGE = 4


pytestmark = pytest.mark.usefixtures("full_float32_products")  # (conftest: these tests compare to 2e-6)


def _case(rng, B, T, K, G, P, start, valid_len):
    """Pools whose pages hold random K/V, each row's table a random set of distinct pages, a chunk
    of T tokens from `start` of which the first `valid_len` are real."""
    d, e, pool = 8, 6, B * P + 1
    k_pool = jnp.asarray(rng.standard_normal((pool, PAGE, K, d)), jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal((pool, PAGE, K, e)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, pool))[: B * P].reshape(B, P), jnp.int32)
    starts = np.broadcast_to(start, (B,))  # one start, or one a row
    pos = jnp.asarray(np.stack([np.arange(s, s + T) for s in starts]), jnp.int32)
    valid = jnp.broadcast_to(jnp.arange(T) < valid_len, (B, T))
    view = KVView.build(pos, valid, table, PAGE)
    q = jnp.asarray(rng.standard_normal((B, T, K * G, d)), jnp.float32)
    return q, k_pool, v_pool, view


@pytest.mark.parametrize(
    "B, T, K, G, P, start, valid_len, window, sinks",
    [
        (1, 8, 2, 2, 12, 0, 8, 0, False),  # a first chunk: one block of three read
        (2, 6, 1, 4, 12, 17, 6, 0, False),  # a later chunk crossing a block edge
        (1, 7, 2, 1, 10, 20, 5, 0, True),  # padding tokens, sinks, a table not a multiple of the block
        (2, 8, 2, 2, 16, 30, 8, 9, True),  # a sliding window: early blocks fully masked
        (1, 5, 1, 2, 9, 31, 5, 0, False),  # the last block of the table
    ],
)
def test_blocks_match_the_reference(B, T, K, G, P, start, valid_len, window, sinks, monkeypatch):
    monkeypatch.setattr(kv_cache, "ATTN_BLOCK", 4 * PAGE)  # 4 pages a block
    rng = np.random.default_rng(B * 100 + T + start)
    q, k_pool, v_pool, view = _case(rng, B, T, K, G, P, start, valid_len)
    sinks_H = jnp.asarray(rng.standard_normal(K * G), jnp.float32) if sinks else None
    mask = view.mask(window)
    want = attend(q, gather_pages(k_pool, view), gather_pages(v_pool, view), mask, 0.3, sinks_H)
    got = jax.jit(lambda q, k, v: attend_paged(q, (k, v), view, 0.3, lambda kv: kv, sinks_H, window))(q, k_pool, v_pool)
    real = np.asarray(view.positions_BT < start + valid_len)  # padding tokens' outputs are never read
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize(
    "B, T, K, G, P, start, valid_len, window, sinks",
    [
        (1, 8, 2, 2, 12, 0, 8, 0, False),  # a prompt's first chunk: nothing cached before it
        (2, 6, 1, 4, 12, 17, 6, 0, False),  # a later chunk: blocks before it joined with its own keys
        (1, 7, 2, 1, 10, 20, 5, 0, True),  # padding tokens, sinks
        (2, 8, 2, 2, 16, 30, 8, 9, True),  # a sliding window reaching back before the chunk
        (1, 8, 1, 2, 9, 0, 3, 5, False),  # a first chunk mostly padding, a window inside it
        (3, 6, 2, 2, 12, (0, 9, 21), 6, 0, True),  # rows at different starts (one with nothing before it)
    ],
)
@pytest.mark.parametrize("cached", ["blocks", "flash"])
def test_chunk_joined_with_its_cache_matches_the_reference(B, T, K, G, P, start, valid_len, window, sinks, cached, monkeypatch):
    monkeypatch.setattr(kv_cache, "ATTN_BLOCK", 4 * PAGE)
    rng = np.random.default_rng(B * 100 + T + np.sum(start) + 7)
    q, k_pool, v_pool, view = _case(rng, B, T, K, G, P, start, valid_len)
    sinks_H = jnp.asarray(rng.standard_normal(K * G), jnp.float32) if sinks else None
    mask = view.mask(window)
    k_all, v_all = gather_pages(k_pool, view), gather_pages(v_pool, view)
    want = attend(q, k_all, v_all, mask, 0.3, sinks_H)
    own = [jnp.take_along_axis(a, view.positions_BT[:, :, None, None], axis=1) for a in (k_all, v_all)]  # the chunk's entries
    f = jax.jit(lambda q, k, v, kn, vn: attend_chunk(q, kn, vn, (k, v), view, 0.3, lambda kv: kv, sinks_H, window, cached))
    got = f(q, k_pool, v_pool, *own)
    real = np.asarray(view.positions_BT < view.positions_BT[:, :1] + valid_len)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-6, rtol=2e-6)


def test_blocks_after_the_last_position_read_are_not_read(monkeypatch):
    """NaN in every page after the block holding the chunk's last position: the reference reads
    them (0 × NaN in its weighted sum), the blocked attention stops before them."""
    monkeypatch.setattr(kv_cache, "ATTN_BLOCK", 4 * PAGE)
    rng = np.random.default_rng(3)
    q, k_pool, v_pool, view = _case(rng, 1, 6, 2, 2, 16, 2, 6)  # positions 2..7: block 0 only
    later = view.page_table_BP[0, 4:]
    k_bad, v_bad = k_pool.at[later].set(jnp.nan), v_pool.at[later].set(jnp.nan)
    clean = attend(q, gather_pages(k_pool, view), gather_pages(v_pool, view), view.mask_BTS, 0.3)
    assert np.isnan(np.asarray(attend(q, gather_pages(k_bad, view), gather_pages(v_bad, view), view.mask_BTS, 0.3))).all()
    got = attend_paged(q, (k_bad, v_bad), view, 0.3, lambda kv: kv)
    np.testing.assert_allclose(np.asarray(got), np.asarray(clean), atol=2e-6, rtol=2e-6)


def test_one_token_steps_and_short_tables_take_the_reference_path(monkeypatch):
    monkeypatch.setattr(kv_cache, "ATTN_BLOCK", 4 * PAGE)
    rng = np.random.default_rng(4)
    for T, P in ((1, 16), (6, 4)):
        q, k_pool, v_pool, view = _case(rng, 1, T, 2, 2, P, 3, T)
        want = attend(q, gather_pages(k_pool, view), gather_pages(v_pool, view), view.mask_BTS, 0.3)
        got = attend_paged(q, (k_pool, v_pool), view, 0.3, lambda kv: kv)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("how", ["blocked", "flash", "flash:flash"])
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral_swa"])
def test_long_prefill_in_blocks_matches_transformers(name, how, ckpt_root, monkeypatch):
    """Blocks of 8 positions (2 pages) over a 96-position table: a 45-token prompt's chunks of 16
    read 2, 4 and 6 of its 12 blocks (GQA, MLA, sinks with sliding windows), or (FREETOKEN_PREFILL_ATTENTION
    "flash") each chunk attends to itself and to the 0, 2 and 4 blocks before it, or ("flash:flash",
    FREETOKEN_PREFILL_CACHED "flash" too) to the prefix before it in the whole table gathered
    (GQA layers without a window)."""
    from hf_models import check_prompt_logits

    monkeypatch.setattr(kv_cache, "ATTN_BLOCK", 8)
    attention, _, cached = how.partition(":")
    monkeypatch.setenv("FREETOKEN_PREFILL_ATTENTION", attention)
    monkeypatch.setenv("FREETOKEN_PREFILL_CACHED", cached or "blocks")
    check_prompt_logits(name, ckpt_root, 45, 45, prefill_chunk=16)


@pytest.mark.parametrize("B, T, H, S, valid", [(1, 1, 4, 12, 12), (3, 1, 2, 20, 7), (2, 3, 3, 9, 9)])
def test_latent_attention_matches_the_expanded_keys_and_values(B, T, H, S, valid):
    """MLA with the up-projections taken into the query and the output equals attention over the
    keys [k_nope = W_uk · latent, shared rotated key] and values W_uv · latent of every cached
    entry (float64 products: only the summation order differs), entries past `valid` masked."""
    rng = np.random.default_rng(B * 10 + H + S)
    R, d, r, e = 16, 8, 4, 6
    lat = rng.standard_normal((B, S, R))
    rot = rng.standard_normal((B, S, r))
    w_uk, w_uv = rng.standard_normal((H, d, R)) / 4, rng.standard_normal((H, e, R)) / 4
    q_nope, q_rot = rng.standard_normal((B, T, H, d)), rng.standard_normal((B, T, H, r))
    mask = np.broadcast_to(np.arange(S) < valid, (B, T, S))
    k = np.concatenate([np.einsum("hdr,bsr->bshd", w_uk, lat), np.broadcast_to(rot[:, :, None], (B, S, H, r))], axis=-1)
    v = np.einsum("her,bsr->bshe", w_uv, lat)
    with jax.enable_x64():
        want = attend(jnp.asarray(np.concatenate([q_nope, q_rot], -1)), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), 0.3)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    got = attend_latent(f32(q_nope), f32(q_rot), f32(lat), f32(rot), f32(w_uk), f32(w_uv), jnp.asarray(mask), 0.3)
    assert got.shape == (B, T, H, e) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_mla_decode_latent_and_expanded_agree(ckpt_root, monkeypatch):
    """FREETOKEN_MLA_DECODE: DeepSeek-V3 (MLA) decodes the same greedy tokens attending in the
    latent space (the default) and over expanded keys and values (the numbers themselves:
    `test_latent_attention_matches_the_expanded_keys_and_values`); a bad value raises."""
    from hf_models import make_checkpoint

    from freetoken_jax import EngineConfig, FreeTokenEngine
    from freetoken_jax.models import attention

    path = make_checkpoint("deepseek_v3", ckpt_root)
    cfg = EngineConfig(dtype="float32", max_context=64, max_batch=2, page_size=4, prefill_chunk=16)
    prompts = [[3, 14, 15, 92, 65, 35, 8], [27, 18]]
    out = {}
    for how in ("latent", "expanded"):
        monkeypatch.setenv("FREETOKEN_MLA_DECODE", how)
        eng = FreeTokenEngine.from_pretrained(path, cfg)
        out[how] = eng.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)
    assert out["latent"] == out["expanded"] and all(len(o) == 12 for o in out["latent"])
    monkeypatch.setenv("FREETOKEN_MLA_DECODE", "absorbed")
    with pytest.raises(ValueError, match="FREETOKEN_MLA_DECODE"):
        attention.mla_decode()


def test_prefill_attention_switch(monkeypatch):
    """FREETOKEN_PREFILL_ATTENTION: flash on a GPU where cuDNN takes the heads (bf16; not
    float32; not in a jax without it), blocked elsewhere; the settings force either; a bad one
    raises. The same for FREETOKEN_PREFILL_CACHED (blocks unless set)."""
    from helpers import check_kernel_choice

    from freetoken_jax.config import MoEModelConfig
    from freetoken_jax.models.attention import prefill_attention, prefill_cached
    from pallas_kernels import chunk_attention

    cfg = MoEModelConfig(vocab_size=32, hidden_dim=64, intermediate_dim=32, num_layers=1, num_experts=4, top_k=2, num_heads=4,
                         num_kv_heads=2, head_dim=16)  # fmt: skip
    want = {("auto", "gpu"): "flash", ("auto", "cpu"): "blocked", ("blocked", "gpu"): "blocked", ("flash", "cpu"): "flash"}
    check_kernel_choice(monkeypatch, "FREETOKEN_PREFILL_ATTENTION", want, lambda: prefill_attention(cfg, jnp.bfloat16), "cudnn")
    check_kernel_choice(monkeypatch, "FREETOKEN_PREFILL_CACHED", {("blocks", "gpu"): "blocks", ("flash", "cpu"): "flash"},
                        prefill_cached, "all")  # fmt: skip
    monkeypatch.setenv("FREETOKEN_PREFILL_ATTENTION", "auto")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert prefill_attention(cfg, jnp.float32) == "blocked"
    assert prefill_attention(cfg, jnp.bfloat16) == "flash"
    monkeypatch.setattr(chunk_attention, "_cudnn", lambda: None)  # a jax without its cuDNN attention
    assert prefill_attention(cfg, jnp.bfloat16) == "blocked"
