"""The ways of computing routed experts agree with a float64 numpy reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import jitted

from freetoken_jax.bench.expert_impls import named
from freetoken_jax.models.routed import routed_experts
from freetoken_jax.quant.layout import ExpertLayout

pytestmark = pytest.mark.usefixtures("full_float32_products")  # (conftest: references compared to 1e-5)


def reference(x, ids, w, gate, up, down, bias=None):
    """float64; `bias`: per-expert (gate [E, F], up [E, F], down [E, D]) or None."""
    x, gate, up, down = (a.astype(np.float64) for a in (x, gate, up, down))
    bg, bu, bd = (np.zeros(a.shape[:2]) for a in (gate, up, down)) if bias is None else bias
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            g, u = gate[e] @ x[t] + bg[e], up[e] @ x[t] + bu[e]
            out[t] += w[t, k] * (down[e] @ ((g / (1 + np.exp(-g))) * u) + bd[e])
    return out


@pytest.mark.parametrize("impl", ["auto", "gather", "slices", "ragged", "dense", "grouped"])
@pytest.mark.parametrize("T,K,E,D,F", [(1, 2, 4, 16, 8), (3, 3, 8, 24, 40), (5, 1, 3, 8, 8), (2, 4, 4, 32, 16)])
def test_impls_match_reference(impl, T, K, E, D, F):
    rng = np.random.default_rng(T * 100 + K * 10 + E)
    x = rng.standard_normal((T, D)).astype(np.float32)
    gate, up = (rng.standard_normal((E, F, D)).astype(np.float32) * 0.3 for _ in range(2))
    down = rng.standard_normal((E, D, F)).astype(np.float32) * 0.3
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.random((T, K)).astype(np.float32)
    layout = ExpertLayout(("bf16",) * 3, F, D, "silu")
    compute = named(impl) or routed_experts
    got = jitted(compute, jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), (jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down)), layout)
    ref = reference(x, ids, w, gate, up, down)
    assert np.linalg.norm(np.asarray(got) - ref) / np.linalg.norm(ref) < 1e-5


def test_dense_in_token_slices_matches_one_piece(monkeypatch):
    from freetoken_jax.models import routed

    rng = np.random.default_rng(7)
    T, K, E, D, F = 11, 2, 4, 16, 8
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    gate, up = (jnp.asarray(rng.standard_normal((E, F, D)) * 0.3, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((E, D, F)) * 0.3, jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
    w = jnp.asarray(rng.random((T, K)), jnp.float32)
    layout = ExpertLayout(("bf16",) * 3, F, D, "silu")
    whole = jitted(routed_experts, x, ids, w, (gate, up, down), layout, impl="dense")
    monkeypatch.setattr(routed, "DENSE_SLICE_BYTES", 2 * 4 * E * F * 3)  # 3 tokens per slice: 4 slices, the last short
    sliced = jitted(routed_experts, x, ids, w, (gate, up, down), layout, impl="dense")
    np.testing.assert_allclose(np.asarray(sliced), np.asarray(whole), rtol=1e-6, atol=1e-6)
    ref = reference(np.asarray(x), np.asarray(ids), np.asarray(w), np.asarray(gate), np.asarray(up), np.asarray(down))
    assert np.linalg.norm(np.asarray(sliced) - ref) / np.linalg.norm(ref) < 1e-5


def skewed_ids(rng, T, K, E, hot: int, share: float) -> np.ndarray:
    """Top-K of E for T tokens, expert `hot` chosen by about `share` of the tokens."""
    ids = []
    for _ in range(T):
        first = [hot] if rng.random() < share else []
        rest = rng.choice([e for e in range(E) if e not in first], K - len(first), replace=False)
        ids.append(first + list(rest))
    return np.asarray(ids, np.int32)


@pytest.mark.parametrize("impl", ["grouped", "tiles", "ragged"])
@pytest.mark.parametrize("T,K,E", [(96, 2, 12), (128, 2, 32)])
@pytest.mark.parametrize("routing", range(7))  # `routings`: each plan of `group_plans`, and dense
def test_many_pairs_match_reference_in_every_plan(impl, T, K, E, routing, monkeypatch):
    """ "grouped" (in each of its plans), "tiles" and "ragged" over T·K ≫ E pairs, spread and
    skewed, with per-expert biases, unrouted pairs (weight 0), and experts in slices (within
    each tier of a ranked plan)."""
    from freetoken_jax.models import routed

    D, F = 16, 16
    rng = np.random.default_rng(routing)
    x = rng.standard_normal((T, D)).astype(np.float32)
    gate, up = (rng.standard_normal((E, F, D)).astype(np.float32) * 0.3 for _ in range(2))
    down = rng.standard_normal((E, D, F)).astype(np.float32) * 0.3
    bias = (rng.standard_normal((E, F)) * 0.1, rng.standard_normal((E, F)) * 0.1, rng.standard_normal((E, D)) * 0.1)
    ids = routings(np.random.default_rng(1), T, K, E)[routing]  # the draws of test_grouped_takes_the_first_plan_that_holds
    w = rng.random((T, K)).astype(np.float32)
    w[::7, 1] = 0.0  # pairs another strategy computes
    layout = ExpertLayout(("bf16",) * 3, F, D, "silu")
    monkeypatch.setattr(routed, "DENSE_SLICE_BYTES", 2 * 4 * 32 * F * 5)  # five experts per slice of 32 rows, one of 128
    args = (jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), (jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down)), layout)
    pair = routed.pair_biases(tuple(jnp.asarray(b, jnp.float32) for b in bias), jnp.asarray(ids))
    got = jitted(routed_experts, *args, impl=impl, bias=pair)
    ref = reference(x, ids, w, gate, up, down, bias)
    assert np.linalg.norm(np.asarray(got) - ref) / np.linalg.norm(ref) < 1e-5
    dense = jitted(routed_experts, *args, impl="dense", bias=pair)
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense), rtol=1e-5, atol=1e-5)


def crowded_ids(rng, T, K, E, hot: int) -> np.ndarray:
    """Top-K of E for T tokens, each token's experts drawn from the first `hot` (≥ K) alone."""
    return np.stack([rng.choice(hot, K, replace=False) for _ in range(T)]).astype(np.int32)


def hot_ids(rng, T, K, E, hot: int, share: float) -> np.ndarray:
    """Top-K of E for T tokens, each of the first `hot` experts chosen by about `share` of them."""
    ids = []
    for _ in range(T):
        first = [e for e in range(hot) if rng.random() < share][:K]
        ids.append(first + list(rng.choice([e for e in range(E) if e not in first], K - len(first), replace=False)))
    return np.asarray(ids, np.int32)


def routings(rng, T, K, E):
    """Spread, one expert chosen by 40 % of the tokens, by 90 %, every pair among 3E/8 experts,
    three experts chosen by 40 % each, K experts taking every pair, and every pair among 2E/3
    experts: at T, K, E = 96, 2, 12 the plans tight, steep, steep, 2C = 64, 2C, dense and C = 32;
    at 128, 2, 32 (no tight plan) C = 16, steep, steep, 2C = 32, broad, dense and steep
    (test_group_plans)."""
    return ([skewed_ids(rng, T, K, E, hot=3, share=s) for s in (0.0, 0.4, 0.9)] + [crowded_ids(rng, T, K, E, hot=3 * E // 8)]
            + [hot_ids(rng, T, K, E, hot=3, share=0.4), crowded_ids(rng, T, K, E, hot=K), crowded_ids(rng, T, K, E, hot=2 * E // 3)])  # fmt: skip


@pytest.mark.parametrize("T,K,E,want", [(96, 2, 12, [0, 2, 2, 3, 3, 4, 1]), (128, 2, 32, [0, 1, 1, 2, 3, 4, 1])])  # len(plans): dense
def test_grouped_takes_the_first_plan_that_holds(T, K, E, want, monkeypatch):
    """Each routing runs the first of `group_plans` whose groups hold its counts (marked here by
    a poisoned stand-in), else "dense"; "auto" groups many pairs the same way."""
    from freetoken_jax.models import grouping, routed

    D, F = 16, 8
    plans = grouping.group_plans(T, K, E)
    rng = np.random.default_rng(1)
    bank = (jnp.ones((E, F, D)), jnp.ones((E, F, D)), jnp.ones((E, D, F)))
    layout = ExpertLayout(("bf16",) * 3, F, D, "silu")
    monkeypatch.setattr(routed, "_grouped", lambda x, *a: jnp.full(x.shape, float(plans.index(a[-1])), x.dtype))  # a[-1]: the plan
    for ids, i in zip(routings(rng, T, K, E), want):
        for impl in ("grouped", "auto"):
            out = routed_experts(jnp.ones((T, D)), jnp.asarray(ids), jnp.ones((T, K)), bank, layout, impl=impl)
            got = float(out[0, 0])  # dense over ones: far from every plan's index
            assert got == i if i < len(plans) else got not in range(len(plans)), (impl, i, got)


@pytest.mark.parametrize("how,F,want", [(None, 16, "grouped"), ("tiles", 16, "tiles"), ("tiles", 24, "grouped"), ("ragged", 24, "ragged")])
def test_auto_computes_many_pairs_as_the_switch_says(how, F, want, monkeypatch):
    """FREETOKEN_PREFILL_EXPERTS picks how "auto" computes many pairs ("tiles" only where its
    kernels take F: 24 is not a multiple of 16); few pairs are gathered whatever it says; a
    value outside the choices is refused, naming them."""
    from freetoken_jax.models import routed

    if how:
        monkeypatch.setenv("FREETOKEN_PREFILL_EXPERTS", how)
    marks = {"grouped": 1.0, "tiled": 2.0, "ragged": 3.0, "gathered": 4.0}
    for name, mark in marks.items():
        monkeypatch.setattr(routed, f"_{name}", lambda x, *a, mark=mark: jnp.full(x.shape, mark, x.dtype))
    T, K, E, D = 64, 2, 8, 16
    bank = (jnp.ones((E, F, D)), jnp.ones((E, F, D)), jnp.ones((E, D, F)))
    layout = ExpertLayout(("bf16",) * 3, F, D, "silu")
    ids = jnp.asarray(np.arange(T * K).reshape(T, K) % E, jnp.int32)
    assert routed.many_pairs_impl(layout, E) == want
    assert float(routed_experts(jnp.ones((T, D)), ids, jnp.ones((T, K)), bank, layout)[0, 0]) == marks[want.replace("tiles", "tiled")]
    assert float(routed_experts(jnp.ones((2, D)), ids[:2], jnp.ones((2, K)), bank, layout)[0, 0]) == marks["gathered"]
    if how == "tiles" and want == "tiles":  # DeepSeek-V3's bank (256 experts of 7168 × 2048): past the kernels' offsets
        assert routed.many_pairs_impl(ExpertLayout(("bf16",) * 3, 2048, 7168, "silu"), 256) == "grouped"
    if F % 16:
        with pytest.raises(ValueError, match="'tiles' expert implementation takes F and D in multiples of 16"):
            routed_experts(jnp.ones((T, D)), ids, jnp.ones((T, K)), bank, layout, impl="tiles")
    monkeypatch.setenv("FREETOKEN_PREFILL_EXPERTS", "fast")
    with pytest.raises(ValueError, match="FREETOKEN_PREFILL_EXPERTS='fast': use grouped, tiles or ragged"):
        routed.many_pairs_impl(layout, E)


@pytest.mark.parametrize("how", ["grouped", "tiles", "ragged"])
def test_quantized_layers_gather_up_to_four_pairs_an_expert(how, monkeypatch):
    """A quantized layer's pairs are gathered up to GATHER_QUANTIZED · E of them (grouped and ragged
    would dequantize the whole bank first), unless the many pairs go through "tiles", which reads
    the blocks as stored; a bf16 layer's up to E."""
    from freetoken_jax.models import routed
    from freetoken_jax.quant.formats import get_format

    monkeypatch.setenv("FREETOKEN_PREFILL_EXPERTS", how)
    marks = {"grouped": 1.0, "tiled": 2.0, "ragged": 3.0, "gathered": 4.0}
    for name, mark in marks.items():
        monkeypatch.setattr(routed, f"_{name}", lambda x, *a, mark=mark: jnp.full(x.shape, mark, x.dtype))
    E, K, F, D = 8, 2, 32, 64
    q = tuple(jnp.zeros((E, get_format("q4_0").nbytes(o, i)), jnp.uint8) for o, i in ((F, D), (F, D), (D, F)))
    b = (jnp.zeros((E, F, D)), jnp.zeros((E, F, D)), jnp.zeros((E, D, F)))
    quantized, plain = ExpertLayout(("q4_0",) * 3, F, D, "silu"), ExpertLayout(("bf16",) * 3, F, D, "silu")
    assert quantized.quantized and routed.GATHER_QUANTIZED == 4
    many = marks["tiled" if how == "tiles" else how]
    for T, want_q, want_b in ((4, 4.0, 4.0), (16, 4.0 if how != "tiles" else many, many), (17, many, many)):  # 8, 32, 34 pairs
        ids = jnp.asarray(np.arange(T * K).reshape(T, K) % E, jnp.int32)
        for banks, layout, want in ((q, quantized, want_q), (b, plain, want_b)):
            got = float(routed_experts(jnp.ones((T, D)), ids, jnp.ones((T, K)), banks, layout)[0, 0])
            assert got == want, (how, T, layout.fmts[0], got)


def test_group_plans():
    """The plans' rows, and which plan holds which routing, restated."""
    from freetoken_jax.models.grouping import GroupPlan, group_plans

    # (96, 2, 12): broad has over half of dense's rows; (128, 2, 32): tight rounds up to C
    assert group_plans(96, 2, 12) == [GroupPlan(((1, 32), (11, 24)), True), GroupPlan(((12, 32),), False),
                                      GroupPlan(((1, 96), (1, 48), (10, 32)), True), GroupPlan(((12, 64),), False)]  # fmt: skip
    assert group_plans(128, 2, 32) == [GroupPlan(((32, 16),), False), GroupPlan(((1, 128), (1, 64), (2, 32), (28, 16)), True),
                                       GroupPlan(((32, 32),), False), GroupPlan(((1, 128), (2, 64), (29, 32)), True)]  # fmt: skip
    assert group_plans(2048, 8, 128)[:3] == [GroupPlan(((4, 256), (4, 192), (120, 160)), True), GroupPlan(((128, 256),), False),
                                             GroupPlan(((4, 2048), (4, 1024), (8, 512), (112, 256)), True)]  # fmt: skip
    assert group_plans(2048, 8, 128)[-1] == GroupPlan(((4, 2048), (8, 1024), (116, 512)), True)
    assert group_plans(16, 8, 128) == [GroupPlan(((128, 8),), False)] and group_plans(8, 8, 128) == []
    for (T, K, E), want in (((96, 2, 12), [0, 2, 2, 3, 3, None, 1]), ((128, 2, 32), [0, 1, 1, 2, 3, None, 1])):
        plans = group_plans(T, K, E)
        for ids, i in zip(routings(np.random.default_rng(1), T, K, E), want):  # the draws of the test above
            counts = np.bincount(ids.reshape(-1), minlength=E)
            ranked = np.sort(counts)[::-1]
            holds = [bool(((ranked if p.ranked else counts) <= p.caps()).all()) for p in plans]
            assert [bool(p.fits(jnp.asarray(counts))) for p in plans] == holds
            assert next((j for j, h in enumerate(holds) if h), None) == i, (T, K, E, holds)


def test_grouped_scatters_no_floats():
    """ "grouped" fills its rows and collects its results by gathers: the only scatters are of
    its int32 pair <-> row maps, so no result depends on the order of a GPU's atomic adds."""
    import re

    import jax

    from freetoken_jax.models import grouping, routed

    T, K, E, D, F = 64, 2, 8, 16, 8
    bank = (jnp.ones((E, F, D)), jnp.ones((E, F, D)), jnp.ones((E, D, F)))
    layout = ExpertLayout(("bf16",) * 3, F, D, "silu")
    counts = jnp.zeros((E,), jnp.int32)
    for plan, n in ((grouping.GroupPlan(((E, 32),), False), 2), (grouping.GroupPlan(((2, 64), (6, 32)), True), 3)):
        text = (
            jax.jit(lambda x, i, w, plan=plan: routed._grouped(x, i, w, bank, layout, None, counts, plan))
            .lower(jnp.ones((T, D)), jnp.zeros((T, K), jnp.int32), jnp.ones((T, K)))
            .as_text()
        )
        scatters = re.findall(r'"stablehlo.scatter".*?\}\) : \([^)]*\) -> tensor<([^>]*)>', text, re.S)  # the result types
        assert len(scatters) == n and all(s.endswith("xi32") for s in scatters), scatters


def test_grouped_plans_hold_zipf_routing():
    """At 128 experts, top-8, 512 and 2048 tokens: spread routing fits the first plan (tight;
    at 512 tokens tight or C), and synthetic Zipf routing of exponents 0.5-1 (at 2048 tokens up
    to 1.5; trained routers' skew is nearer 1) the steep ranked plan — the first that holds it,
    in fewer rows than broad's."""
    from freetoken_jax.models.grouping import group_plans
    from freetoken_jax.runtime.routing import synthetic_ids

    K, E = 8, 128
    for T in (512, 2048):
        plans = group_plans(T, K, E)
        steep = plans.index(next(p for p in plans if p.ranked and p.tiers[1][1] == T // 2))  # (T, T/2, T/4, C)
        assert plans[steep].rows < max(p.rows for p in plans if p.ranked)
        for skew in (0.0, 0.5, 1.0) + ((1.5,) if T == 2048 else ()):  # (at 512 tokens 1.5 can crowd past every plan)
            for layer in range(2):
                ids = synthetic_ids(jnp.zeros((T, K), jnp.int32), jnp.arange(T), layer, E, skew)
                counts = jnp.zeros((E,), jnp.int32).at[ids.reshape(-1)].add(1)
                fits = [bool(p.fits(counts)) for p in plans]
                want = ({0} if T == 2048 else {0, 1}) if skew == 0 else {steep}  # (at 512 tokens tight's 40 rows are a σ and a half)
                assert fits.index(True) in want, (T, skew, layer, fits)


@pytest.mark.parametrize("T,K,E", [(100, 3, 40), (257, 4, 64), (64, 1, 7), (130, 2, 96), (33, 8, 64)])
@pytest.mark.parametrize("skew", [0.0, 1.0, 3.0])
def test_grouped_matches_reference_on_odd_shapes(T, K, E, skew):
    """Chunk sizes and expert counts that are not powers of two, under Zipf routing of several
    skews (whichever plan, or dense, each one takes)."""
    from freetoken_jax.runtime.routing import synthetic_ids

    D, F = 8, 8
    rng = np.random.default_rng(T + E)
    x = rng.standard_normal((T, D)).astype(np.float32)
    gate, up = (rng.standard_normal((E, F, D)).astype(np.float32) * 0.3 for _ in range(2))
    down = rng.standard_normal((E, D, F)).astype(np.float32) * 0.3
    ids = np.asarray(synthetic_ids(jnp.zeros((T, K), jnp.int32), jnp.arange(T), 0, E, skew))
    w = rng.random((T, K)).astype(np.float32)
    layout = ExpertLayout(("bf16",) * 3, F, D, "silu")
    got = jitted(
        routed_experts, jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), (jnp.asarray(gate), jnp.asarray(up), jnp.asarray(down)), layout,
        impl="grouped",
    )  # fmt: skip
    ref = reference(x, ids, w, gate, up, down)
    assert np.linalg.norm(np.asarray(got) - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("fmt,words", [("q4_0", False), ("q4_0", True), ("q8_0", None), ("nvfp4", None), ("q4_k", None)])
def test_gather_masks_a_foreign_slot_with_weight_0(fmt, words):
    """In a model whose layers differ in format, a step may index a slot holding another layer's
    bytes with weight 0 (hybrid's pairs left to the CPU point at slot 0): read under this layer's
    format they can decode to inf or NaN. The pair's result is masked, so the output equals the
    same computation without it — q4_0 read as bytes and as 16-bit words (`ExpertLayout.words`,
    a GPU's default) alike."""
    from freetoken_jax.quant.formats import get_format

    f = get_format(fmt)
    rng = np.random.default_rng(7)
    E, D, F = 4, 256, 256
    layout = ExpertLayout((fmt,) * 3, F, D, "silu", mixed=True, words=words)
    banks = [
        np.stack([f.quantize_ref(rng.standard_normal(s).astype(np.float32) * 0.1) for _ in range(E)]) for s in ((F, D), (F, D), (D, F))
    ]
    for b in banks:
        b[0] = 0xFF  # expert 0: every byte 0xFF (f16 and f32 scales NaN, fp8 codes NaN)
    x = rng.standard_normal((2, D)).astype(np.float32)
    ids = np.asarray([[0, 1, 2], [3, 0, 1]], np.int32)
    w = np.asarray([[0.0, 0.5, 0.25], [0.7, 0.0, 0.3]], np.float32)
    got = jitted(routed_experts, jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w), [jnp.asarray(b) for b in banks], layout, impl="gather")
    # expert 0 never weighs in: zeros in the reference
    deq = [np.stack([np.zeros(s)] + [f.dequantize_ref(e, *s) for e in b[1:]]) for b, s in zip(banks, ((F, D), (F, D), (D, F)))]
    ref = reference(x, ids, w, *deq)
    assert np.all(np.isfinite(np.asarray(got)))
    assert np.linalg.norm(np.asarray(got) - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("how", ["tiles", "ragged"])
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_prefill_through_tiles_and_ragged_matches_transformers(name, how, ckpt_root, monkeypatch):
    """A 45-token prompt in chunks of 16 with FREETOKEN_PREFILL_EXPERTS set: every chunk's
    experts through that path (counted), the logits transformers' (softmax and sigmoid routing,
    shared experts, gpt-oss's expert biases and clamped activation)."""
    from hf_models import check_prompt_logits

    from freetoken_jax.models import routed

    fn = "_tiled" if how == "tiles" else "_ragged"
    real, calls = getattr(routed, fn), []
    monkeypatch.setattr(routed, fn, lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("FREETOKEN_PREFILL_EXPERTS", how)
    check_prompt_logits(name, ckpt_root, 45, 45, prefill_chunk=16)
    assert calls
