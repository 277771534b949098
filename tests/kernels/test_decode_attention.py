"""Decode's attention kernel (interpret mode) against float64 and its jnp reference over shapes,
masks (prefixes, sliding windows, ring-ordered tables, rows with nothing to read) and spans; its
lowering to Triton for the GPU (checked here, without one); and the models' one-token steps
through it against transformers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_kernel_choice, jitted
from jax import export

from pallas_kernels import decode_attention
from pallas_kernels.decode_attention import Fresh, attention, attention_ref, fits, fresh_fits, limits


@pytest.fixture(params=[64, 16], ids=["block64", "block16"])
def block(request, monkeypatch):
    """The kernel's loop over blocks of 64 entries (the default), or of 16: spans of several blocks."""
    monkeypatch.setattr(decode_attention, "BLOCK", request.param)
    return request.param


def _case(rng, B, H, K, hd, dv, page, P, kind):
    N = B * P + 1
    k = rng.standard_normal((N, page, K, hd)).astype(np.float32)
    v = rng.standard_normal((N, page, K, dv)).astype(np.float32)
    q = rng.standard_normal((B, H, hd)).astype(np.float32)
    table = rng.permutation(np.arange(1, N))[: B * P].reshape(B, P).astype(np.int32)
    S = P * page
    s = np.arange(S)[None]
    pos = rng.integers(0, S, (B, 1))
    if kind == "prefix":  # positions 0..pos
        mask = s <= pos
    elif kind == "window":  # the last 7 positions up to pos
        mask = (s <= pos) & (s > pos - 7)
    elif kind == "scattered":  # a ring's order: any subset of entries
        mask = rng.random((B, S)) < 0.4
    else:  # "empty": row 0 reads nothing (a batch's idle row)
        mask = s <= pos
        mask[0] = False
    return q, k, v, table, mask


def _float64(q, k, v, table, mask, scale, sinks):
    B, H, hd = q.shape
    K = k.shape[2]
    kg = k[table].reshape(B, -1, K, k.shape[3]).astype(np.float64)
    vg = v[table].reshape(B, -1, K, v.shape[3]).astype(np.float64)
    out = np.zeros((B, H, v.shape[3]))
    for b in range(B):
        for h in range(H):
            sc = kg[b, :, h // (H // K)] @ q[b, h].astype(np.float64) * scale
            sc = sc[mask[b]]
            extra = [] if sinks is None else [float(sinks[h])]
            top = max(list(sc) + extra) if len(sc) or extra else 0.0
            e = np.exp(sc - top)
            den = e.sum() + sum(np.exp(x - top) for x in extra)
            if len(sc):
                out[b, h] = e @ vg[b, mask[b], h // (H // K)] / den
    return out


CASES = [  # B, H, K, hd, dv, page, P, mask kind, sinks
    (1, 8, 2, 64, 64, 16, 4, "prefix", False),  # one span, G = 4
    (2, 32, 4, 128, 128, 16, 6, "window", True),  # Qwen3-30B-A3B's heads, gpt-oss's sinks
    (3, 4, 4, 32, 16, 8, 5, "scattered", False),  # G = 1, values narrower than keys
    (2, 16, 2, 32, 32, 4, 50, "prefix", True),  # 200 entries: four spans of 64 (SPAN patched below)
    (2, 8, 1, 16, 16, 4, 40, "scattered", False),  # several spans, G = 8 on one kv head
    (2, 8, 2, 32, 32, 8, 3, "empty", True),  # a row with nothing to read: zeros
]


@pytest.mark.parametrize("B,H,K,hd,dv,page,P,kind,sinks", CASES)
def test_kernel_matches_float64_and_reference(B, H, K, hd, dv, page, P, kind, sinks, monkeypatch, block):
    monkeypatch.setattr(decode_attention, "SPAN", 64)  # tables over 64 entries run the spans' combine
    rng = np.random.default_rng(B * 1000 + H * 10 + P)
    q, k, v, table, mask = _case(rng, B, H, K, hd, dv, page, P, kind)
    sk = rng.standard_normal(H).astype(np.float32) if sinks else None
    scale = hd**-0.5
    args = [jnp.asarray(a) for a in (q, k, v, table, mask)]
    sk_j = None if sk is None else jnp.asarray(sk)
    got = np.asarray(jitted(attention, *args, scale=scale, sinks_H=sk_j, interpret=True))
    want = _float64(q, k, v, table, mask, scale, sk)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    ref = np.asarray(jitted(attention_ref, *args, scale=scale, sinks_H=sk_j))
    reads = mask.any(axis=1)  # the reference averages a row that reads nothing; the kernel gives 0
    np.testing.assert_allclose(got[reads], ref[reads], atol=2e-5, rtol=2e-5)
    assert (got[~reads] == 0).all()


@pytest.mark.parametrize(
    "B, H, R, r, page, P, kind, span",
    [
        (2, 16, 64, 16, 4, 6, "prefix", 512),  # DeepSeek-V2-Lite's 16 heads (one program a row)
        (1, 128, 32, 16, 4, 20, "scattered", 32),  # DeepSeek-V3's 128 heads: four programs share the kv head; spans
        (2, 64, 16, 16, 8, 3, "empty", 512),  # a row with nothing to read
        (1, 48, 16, 16, 4, 5, "prefix", 512),  # heads that 32 does not divide: two programs of 24
    ],
)
def test_key_in_pools_of_its_own_mla(B, H, R, r, page, P, kind, span, monkeypatch, block):
    """MLA decode in the latent space: one kv head whose key is the cached latent [R] beside the
    rotated shared key [r], each in a pool of its own, and whose value is the latent itself —
    against float64 and the reference, query heads shared by `head_splits` programs."""
    monkeypatch.setattr(decode_attention, "SPAN", span)
    rng = np.random.default_rng(H + R + P)
    q, lat, _, table, mask = _case(rng, B, H, 1, R + r, R, page, P, kind)
    lat, rot = lat[..., :R], lat[..., R:]
    args = [jnp.asarray(q), (jnp.asarray(lat), jnp.asarray(rot)), jnp.asarray(lat), jnp.asarray(table), jnp.asarray(mask)]
    got = np.asarray(jitted(attention, *args, scale=0.1, interpret=True))
    assert got.shape == (B, H, R)
    want = _float64(q, np.concatenate([lat, rot], axis=-1), lat, table, mask, 0.1, None)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    reads = mask.any(axis=1)
    ref = np.asarray(jitted(attention_ref, *args, scale=0.1))
    np.testing.assert_allclose(got[reads], ref[reads], atol=2e-5, rtol=2e-5)
    n = decode_attention.head_splits(H)
    assert H % n == 0 and H // n <= decode_attention.MAX_HEADS and (n == 1 or H // (n - 1) > decode_attention.MAX_HEADS or H % (n - 1))
    # heads shared equally where 32 does not divide them: 48 -> 2 x 24, 100 -> 4 x 25, 7 -> 1 x 7
    assert [decode_attention.head_splits(G) for G in (48, 100, 7)] == [2, 4, 1]


FRESH = [  # B, H, K, hd, page, P, sinks, interleave, norms, span, dtype
    (2, 8, 2, 32, 4, 6, False, False, True, 512, "float32"),  # one span, q/k norms
    (1, 32, 4, 128, 16, 40, True, True, False, 512, "float32"),  # Qwen3-30B-A3B's heads, interleaved pairs, two spans
    (3, 16, 4, 64, 8, 12, True, False, True, 32, "float32"),  # three spans: the entry lands in any of them
    (2, 16, 2, 64, 8, 6, False, False, True, 512, "bfloat16"),
]


@pytest.mark.parametrize("B,H,K,hd,page,P,sinks,interleave,norms,span,dtype", FRESH)
def test_fresh_token_normed_rotated_stored_and_attended(B, H, K, hd, page, P, sinks, interleave, norms, span, dtype, monkeypatch, block):
    """`fresh`: the kernel norms and rotates q and this step's key, stores key and value, and
    attends to them from registers — against the reference (norms, rotation and page writes in
    jnp first). Row 1 (of several) writes nothing (page 0, and a mask without its own entry)."""
    monkeypatch.setattr(decode_attention, "SPAN", span)
    rng = np.random.default_rng(B * 7 + hd + P)
    dt = jnp.dtype(dtype)
    q, k, v, table, mask = _case(rng, B, H, K, hd, hd, page, P, "prefix")
    pos = mask.sum(axis=1) - 1
    wp, wo = table[np.arange(B), pos // page], pos % page
    if B > 1:
        wp[1] = 0
        mask[1, pos[1]] = False
    ang = rng.standard_normal((B, hd // 2))
    fresh = Fresh(jnp.asarray(rng.standard_normal((B, K, hd)), dt), jnp.asarray(rng.standard_normal((B, K, hd)), dt), jnp.asarray(wp),
                  jnp.asarray(wo), jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32),
                  jnp.asarray(rng.standard_normal(hd), dt) if norms else None, jnp.asarray(rng.standard_normal(hd), dt) if norms else None,
                  1e-5, interleave)  # fmt: skip
    sk = jnp.asarray(rng.standard_normal(H), jnp.float32) if sinks else None
    args = [jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt), jnp.asarray(table), jnp.asarray(mask)]
    got = jitted(attention, *args, scale=hd**-0.5, sinks_H=sk, fresh=fresh, interpret=True)
    want = jitted(attention_ref, *args, scale=hd**-0.5, sinks_H=sk, fresh=fresh)
    tol = 2e-5 if dtype == "float32" else 3e-2  # bfloat16: a rounding of the norm's product may differ by one unit
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=tol, rtol=tol)
    assert not np.array_equal(np.asarray(got[1]), np.asarray(args[1]))  # the key was stored


@pytest.mark.parametrize("L,layer,fresh_token", [(3, 1, False), (4, 3, True), (2, 0, True), (1, 0, False)])
def test_stacked_pools_read_and_write_their_layer(L, layer, fresh_token, monkeypatch, block):
    """Pools stacked `[L, N, page, K, d]` (the cache's groups): the kernel reads pool `layer`, as
    it reads that pool alone (bit for bit) and as the reference does; with `fresh`, it writes that
    pool's entry and leaves every other layer's pool as it was."""
    monkeypatch.setattr(decode_attention, "SPAN", 32)  # 48 entries: two spans and their combine
    rng = np.random.default_rng(L * 10 + layer)
    B, H, K, hd, page, P = 2, 8, 2, 32, 4, 12
    cases = [_case(rng, B, H, K, hd, hd, page, P, "prefix") for _ in range(L)]
    q, _, _, table, mask = cases[layer]
    k, v = (jnp.asarray(np.stack([c[i] for c in cases])) for i in (1, 2))
    args = (jnp.asarray(q), k, v, jnp.asarray(table), jnp.asarray(mask))
    fresh = None
    if fresh_token:
        pos = mask.sum(axis=1) - 1
        ang = rng.standard_normal((B, hd // 2))
        fresh = Fresh(jnp.asarray(rng.standard_normal((B, K, hd)), jnp.float32), jnp.asarray(rng.standard_normal((B, K, hd)), jnp.float32),
                      jnp.asarray(table[np.arange(B), pos // page]), jnp.asarray(pos % page), jnp.asarray(np.cos(ang), jnp.float32),
                      jnp.asarray(np.sin(ang), jnp.float32), None, None, 1e-6, False)  # fmt: skip
    got = jitted(attention, *args, scale=0.2, fresh=fresh, layer=layer, interpret=True)
    alone = jitted(attention, args[0], k[layer], v[layer], *args[3:], scale=0.2, fresh=fresh, interpret=True)
    want = jitted(attention_ref, *args, scale=0.2, fresh=fresh, layer=layer)
    if not fresh_token:
        got, alone, want = (got,), (alone,), (want,)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(alone[0]))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5)
    if fresh_token:
        for new, old, one in zip(got[1:], (k, v), alone[1:]):
            others = [i for i in range(L) if i != layer]
            np.testing.assert_array_equal(np.asarray(new)[others], np.asarray(old)[others])
            np.testing.assert_array_equal(np.asarray(new)[layer], np.asarray(one))
            assert not np.array_equal(np.asarray(new)[layer], np.asarray(old)[layer])
    with pytest.raises(ValueError, match="layer"):
        attention(*args, scale=0.2, layer=L, interpret=True)


def test_stacked_latent_pools_mla():
    """MLA's latent and rotated-key pools stacked over layers: layer 2's as the pools alone."""
    rng = np.random.default_rng(5)
    B, H, R, r, page, P, L = 2, 16, 32, 16, 4, 6, 3
    cases = [_case(rng, B, H, 1, R + r, R, page, P, "prefix") for _ in range(L)]
    q, _, _, table, mask = cases[2]
    lat = np.stack([c[1][..., :R] for c in cases])
    rot = np.stack([c[1][..., R:] for c in cases])
    lat_j, rot_j = jnp.asarray(lat), jnp.asarray(rot)
    got = jitted(
        attention, jnp.asarray(q), (lat_j, rot_j), lat_j, jnp.asarray(table), jnp.asarray(mask), scale=0.1, layer=2, interpret=True
    )
    alone = jitted(
        attention, jnp.asarray(q), (lat_j[2], rot_j[2]), lat_j[2], jnp.asarray(table), jnp.asarray(mask), scale=0.1, interpret=True
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(alone))
    want = _float64(q, np.concatenate([lat[2], rot[2]], axis=-1), lat[2], table, mask, 0.1, None)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


def test_bfloat16_within_its_rounding():
    rng = np.random.default_rng(7)
    q, k, v, table, mask = _case(rng, 2, 32, 4, 128, 128, 16, 40, "prefix")  # 640 entries: two spans of 512
    args = [jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)] + [jnp.asarray(table), jnp.asarray(mask)]
    got = np.asarray(jitted(attention, *args, scale=0.088, interpret=True), np.float32)
    want = _float64(*(np.asarray(a, np.float32) for a in args[:3]), table, mask, 0.088, None)
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)  # probabilities and output in bfloat16


def test_masked_entries_add_nothing():
    """NaN in every entry after each row's last position (in the block the loop reads last, and
    past it): they add nothing, whatever their pages hold."""
    rng = np.random.default_rng(9)
    q, k, v, table, mask = _case(rng, 2, 8, 2, 32, 32, 4, 12, "prefix")
    kb, vb = k.copy(), v.copy()
    for b in range(2):
        last = int(np.flatnonzero(mask[b]).max())
        for s in range(last + 1, 48):
            kb[table[b, s // 4], s % 4], vb[table[b, s // 4], s % 4] = np.nan, np.nan
    clean = np.asarray(jitted(attention, *map(jnp.asarray, (q, k, v, table, mask)), scale=0.2, interpret=True))
    got = np.asarray(jitted(attention, *map(jnp.asarray, (q, kb, vb, table, mask)), scale=0.2, interpret=True))
    np.testing.assert_array_equal(got, clean)
    np.testing.assert_array_equal(np.asarray(limits(jnp.asarray(mask))), mask.shape[1] - np.argmax(mask[:, ::-1], axis=1))


@pytest.mark.parametrize("S,sinks", [(256, False), (2048, True)])
def test_lowers_to_triton(S, sinks):
    """The kernel lowers to one Triton call for CUDA (one span, and four with their combine)."""
    B, H, K, hd, page = 1, 32, 4, 128, 16
    P, N = S // page, S // page + 1
    args = [jax.ShapeDtypeStruct((B, H, hd), jnp.bfloat16), jax.ShapeDtypeStruct((N, page, K, hd), jnp.bfloat16),
            jax.ShapeDtypeStruct((N, page, K, hd), jnp.bfloat16), jax.ShapeDtypeStruct((B, P), jnp.int32),
            jax.ShapeDtypeStruct((B, S), jnp.bool_)]  # fmt: skip
    if sinks:
        args.append(jax.ShapeDtypeStruct((H,), jnp.float32))
    exp = export.export(jax.jit(lambda q, k, v, t, m, *s: attention(q, k, v, t, m, scale=0.1, sinks_H=s[0] if s else None)), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)  # fmt: skip
    text = exp.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "decode_attention" in text


def test_mla_lowers_to_triton():
    """DeepSeek-V3's latent decode (128 heads, latent 512, rotated key 64) in one Triton call."""
    B, H, R, r, page, S = 1, 128, 512, 64, 16, 2048
    P, N = S // page, S // page + 1
    sd = jax.ShapeDtypeStruct
    args = [sd((B, H, R + r), jnp.bfloat16), sd((N, page, 1, R), jnp.bfloat16), sd((N, page, 1, r), jnp.bfloat16), sd((B, P), jnp.int32),
            sd((B, S), jnp.bool_)]  # fmt: skip
    exp = export.export(jax.jit(lambda q, lat, rot, t, m: attention(q, (lat, rot), lat, t, m, scale=0.1)), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)  # fmt: skip
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("layers", [None, 48])
def test_fresh_lowers_to_triton(layers):
    """The fused kernel in one Triton call, over one layer's pools or pools stacked over 48 layers."""
    B, H, K, hd, page, S = 2, 32, 4, 128, 16, 1024
    P, N = S // page, 2 * S // page + 1
    sd = jax.ShapeDtypeStruct
    pool = (N, page, K, hd) if layers is None else (layers, N, page, K, hd)
    args = [sd((B, H, hd), jnp.bfloat16), sd(pool, jnp.bfloat16), sd(pool, jnp.bfloat16), sd((B, P), jnp.int32),
            sd((B, S), jnp.bool_), sd((B, K, hd), jnp.bfloat16), sd((B, K, hd), jnp.bfloat16), sd((B,), jnp.int32), sd((B,), jnp.int32),
            sd((B, hd // 2), jnp.float32), sd((B, hd // 2), jnp.float32), sd((hd,), jnp.bfloat16), sd((hd,), jnp.bfloat16)]  # fmt: skip

    def f(q, k, v, t, m, *rest):
        return attention(q, k, v, t, m, scale=0.1, fresh=Fresh(*rest, 1e-6, False), layer=None if layers is None else layers - 1)

    exp = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        *args
    )
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 1


def test_bad_shapes_raise():
    q = jnp.zeros((1, 8, 48))
    pages = jnp.zeros((3, 4, 2, 48))
    with pytest.raises(ValueError, match="no decode attention kernel"):
        attention(q, pages, pages, jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 8), bool), scale=1.0, interpret=True)
    q, pages = jnp.zeros((1, 8, 32)), jnp.zeros((3, 4, 2, 32))
    with pytest.raises(ValueError, match="mask"):
        attention(q, pages, pages, jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 9), bool), scale=1.0, interpret=True)
    assert fits(32, 4, 128, 128) and not fits(32, 3, 128, 128) and not fits(8, 2, 96, 96)
    assert fresh_fits(128, 128) and not fresh_fits(128, 64) and not fresh_fits(16, 16)


@pytest.mark.parametrize(
    "name,how",
    [
        ("qwen3_moe_norm", "kernel"),
        ("gpt_oss", "kernel"),
        ("glm4_moe", "fused"),
        ("qwen3_moe_k", "fused"),
        ("deepseek_v2_rope16", "kernel"),
    ],
)
def test_models_one_token_steps_match_transformers(name, how, ckpt_root, monkeypatch):
    """Every position of a prompt through one-token steps whose attention is the kernel (spans of
    32 entries over a 96-entry table: the combine too): GQA with q/k norms, sinks with sliding
    windows, partial rotary with biases (which "fused" leaves to XLA's norms and rotation),
    "fused" norms, rotation and page writes (heads of 32), and MLA in the latent space."""
    from hf_models import check_prompt_logits

    monkeypatch.setenv("FREETOKEN_DECODE_ATTENTION", how)
    monkeypatch.setattr(decode_attention, "SPAN", 32)
    calls = []
    monkeypatch.setattr(
        decode_attention, "attention", lambda *a, f=decode_attention.attention, **kw: calls.append(kw.get("fresh")) or f(*a, **kw)
    )
    check_prompt_logits(name, ckpt_root, 21, 40, prefill_chunk=1)
    assert calls and all((c is not None) == (name == "qwen3_moe_k") for c in calls)  # traced through the kernel, fused where it fits


def test_how_one_token_steps_attend(monkeypatch):
    """FREETOKEN_DECODE_ATTENTION: "auto" takes the fused kernel on a GPU where the whole head is
    rotated and XLA's attention elsewhere; "kernel" / "fused" where the kernel fits; bad names raise."""
    from freetoken_jax.config import MoEModelConfig
    from freetoken_jax.models import attention

    base = dict(vocab_size=64, hidden_dim=256, intermediate_dim=128, num_layers=2, num_experts=4, top_k=2, num_heads=8, num_kv_heads=2)
    mla = dict(attention="mla", qk_nope_head_dim=32, v_head_dim=32)
    full, partial, odd, latent, odd_latent = (
        MoEModelConfig(**base, head_dim=64),
        MoEModelConfig(**base, head_dim=64, rotary_dim=16),
        MoEModelConfig(**base, head_dim=24),
        MoEModelConfig(**base, **mla, kv_lora_rank=64, qk_rope_head_dim=16),
        MoEModelConfig(**base, **mla, kv_lora_rank=48, qk_rope_head_dim=16),
    )
    want = {  # (setting, backend): full, partial rotary, a head the kernel does not take, MLA, an MLA latent it does not take
        ("auto", "gpu"): ("fused", "xla", "xla", "xla", "xla"),
        ("auto", "cpu"): ("xla", "xla", "xla", "xla", "xla"),
        ("xla", "gpu"): ("xla", "xla", "xla", "xla", "xla"),
        ("kernel", "cpu"): ("kernel", "kernel", "xla", "kernel", "xla"),
        ("fused", "cpu"): ("fused", "kernel", "xla", "kernel", "xla"),
    }
    check_kernel_choice(
        monkeypatch,
        "FREETOKEN_DECODE_ATTENTION",
        want,
        lambda: tuple(attention.decode_attention_kernel(c) for c in (full, partial, odd, latent, odd_latent)),
        "flash",
    )
