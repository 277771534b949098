"""The layers' weights stacked (`models.stacked`, FREETOKEN_WEIGHTS=stacked): the stacks hold every
leaf as it was (the routed experts untouched), the kernels take a layer's weight as a `Stacked`
operand in place and compute what they compute from the weight itself, and engines of either
layout generate the same tokens through the kernels (norms and projections, the fused decode
attention's q/k norms, sinks and biases) on their CPU reference paths and the XLA ones."""

import gc
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import make_checkpoint

from freetoken_jax import EngineConfig, FreeTokenEngine
from freetoken_jax.models.stacked import kernel_operand, stack_layers, take, unstack
from freetoken_jax.runtime.steps import Weights
from pallas_kernels import Stacked, norm_matvec

EC = EngineConfig(dtype="float32", max_context=64, max_batch=2, page_size=4, prefill_chunk=8, prefix_cache=False)


def test_stacks_hold_every_leaf_as_it_was():
    """Every leaf comes back bit for bit; the layers' copies of a weight share one array, the
    routed experts' banks and the unlayered leaves are the arrays themselves."""
    eng = FreeTokenEngine.from_pretrained("demo", EC)
    params = eng.weights.params
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    arrays, plan = stack_layers(params)
    back = unstack(arrays, plan)
    assert len(back) == len(flat) and len(arrays) < len(flat)
    for (path, leaf), (k, j), got in zip(flat, plan, back):
        name = jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(leaf))
        if "['experts']" in name or "layers" not in name:
            assert j is None and arrays[k] is leaf, name
        elif "self_attn" in name:  # every layer has one: a stack of 4
            assert j is not None and arrays[k].shape[0] == eng.model_config.num_layers, name
    w = Weights.of(params, eng.weights.graphdef, stacked=True)
    assert jax.tree.structure(w.params) == jax.tree.structure(params)
    assert len(jax.tree.leaves(w)) == len(arrays)
    # consume: each stacked leaf deleted once its stack exists, the others (and one array two
    # leaves hold) kept; the stacks hold the values all the same
    own = jax.tree.map(jnp.copy, params)
    own["layers"][1]["post_attention_layernorm"]["weight"] = own["layers"][0]["post_attention_layernorm"]["weight"]
    twice = jax.tree.leaves(own["layers"][0]["post_attention_layernorm"]["weight"])[0]
    arrays2, plan2 = stack_layers(own, consume=True)
    assert plan2 == plan
    own_flat = jax.tree_util.tree_flatten_with_path(own)[0]
    for (_, was), (path, leaf), (_, j), got in zip(flat, own_flat, plan2, unstack(arrays2, plan2)):
        assert leaf.is_deleted() == (j is not None and leaf is not twice), jax.tree_util.keystr(path)
        if leaf is not twice:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(was))


def test_kernel_operand_finds_only_live_slices_of_stacks():
    stack = jnp.arange(12.0).reshape(3, 4)
    x = take(stack, 2)
    op = kernel_operand(x)
    assert isinstance(op, Stacked) and op.index == 2 and op.array is stack and op.shape == (4,)
    np.testing.assert_array_equal(np.asarray(op.get()), np.asarray(x))
    plain = stack[2]
    assert kernel_operand(plain) is plain and kernel_operand(None) is None
    del stack, op
    gc.collect()
    assert kernel_operand(x) is x  # its stack is gone: the slice is an array like any other


@pytest.mark.parametrize("L,index,biases,keep", [(2, 1, False, False), (5, 0, True, True), (3, 2, True, False)])
def test_norm_matvec_reads_stacked_operands_in_place(L, index, biases, keep):
    """The norm, the weights and the biases given as entries of stacks: the outputs of the
    entries given alone, bit for bit, and the reference's."""
    rng = np.random.default_rng(L * 10 + index)
    B, D, F = 2, 64, (32, 16)
    x = jnp.asarray(rng.standard_normal((B, D)), jnp.float32)
    norms = jnp.asarray(rng.standard_normal((L, D)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal((L, f, D)), jnp.float32) for f in F]
    bs = [jnp.asarray(rng.standard_normal((L, f)), jnp.float32) for f in F] if biases else None
    stacked = norm_matvec.norm_matvec(x, Stacked(norms, index), 1e-6, [Stacked(w, index) for w in ws],
                                      None if bs is None else [Stacked(b, index) for b in bs], keep_h=keep, interpret=True)  # fmt: skip
    alone = norm_matvec.norm_matvec(x, norms[index], 1e-6, [w[index] for w in ws], None if bs is None else [b[index] for b in bs], keep_h=keep,
                                    interpret=True)  # fmt: skip
    ref = norm_matvec.norm_matvec_ref(x, Stacked(norms, index), 1e-6, [Stacked(w, index) for w in ws],
                                      None if bs is None else [Stacked(b, index) for b in bs], keep_h=keep)  # fmt: skip
    for got, want, r in zip(jax.tree.leaves(stacked), jax.tree.leaves(alone), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_allclose(np.asarray(got), np.asarray(r), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "name,kernels,strategy",
    [("gpt_oss", True, "fused"), ("deepseek_v2", False, "fused"), ("qwen2_moe_swa", False, "fused"), ("qwen3_moe_k", True, "hybrid")],
)  # fmt: skip
def test_layouts_generate_the_same_tokens(name, kernels, strategy, ckpt_root, monkeypatch):
    """Stacked and per-layer weights give the same tokens for a batch of prompts: through the
    kernels (norms with the q/k/v, router and output projections, the fused decode attention's
    q/k norms, gpt-oss's sinks and biases), whose every weight operand is then a `Stacked` one, and
    through XLA's paths (MLA, sliding windows); under hybrid, beside experts in host banks."""
    if kernels:
        monkeypatch.setenv("FREETOKEN_NORM_MATVEC", "kernel")
        monkeypatch.setenv("FREETOKEN_DECODE_ATTENTION", "fused")
    path = make_checkpoint(name, ckpt_root)
    prompts = [[int(t) for t in np.random.default_rng(s).integers(1, 90, n)] for s, n in ((0, 9), (1, 5))]
    seen = []
    real = norm_matvec.norm_matvec
    monkeypatch.setattr(
        norm_matvec, "norm_matvec", lambda x, n, eps, ws, bs=None, *a, **k: seen.append((n, ws, bs)) or real(x, n, eps, ws, bs, *a, **k)
    )
    got = {}
    for layout in ("stacked", "layers"):
        monkeypatch.setenv("FREETOKEN_WEIGHTS", layout)
        ec = EC if strategy == "fused" else EC.replace(moe_strategy=strategy, expert_slots=8, hybrid_q=0.5)
        eng = FreeTokenEngine.from_pretrained(path, ec)
        got[layout] = [list(eng.generate(p, max_new_tokens=6, ignore_eos=True)) for p in prompts]
        ops = [o for n, ws, bs in seen for o in (n, *ws, *(bs or ())) if o is not None]
        assert (not kernels) or (ops and all(isinstance(o, Stacked) == (layout == "stacked") for o in ops)), layout
        seen.clear()
    assert got["stacked"] == got["layers"]


def test_resident_expert_banks_stack_and_decode_gathers_from_the_stacks(monkeypatch):
    """Under "fused" the routed experts' banks are stacked too, and decode's gather reads its
    experts' rows from the stacks (`ExpertLayout.gather` given `Stacked` q4_0 banks), with the
    tokens of per-layer banks; host banks (hybrid) stay one array a layer."""
    from freetoken_jax.config import MoEModelConfig
    from freetoken_jax.quant.layout import ExpertLayout

    seen = []
    real = ExpertLayout.gather
    monkeypatch.setattr(ExpertLayout, "gather", lambda self, k, bank, ids: seen.append(type(bank)) or real(self, k, bank, ids))
    for fmt in ("q4_0",):
        cfg = MoEModelConfig(vocab_size=64, hidden_dim=64, intermediate_dim=64, num_layers=3, num_experts=8, top_k=2, num_heads=4,
                             num_kv_heads=2, head_dim=32, expert_format=fmt)  # fmt: skip
        got = {}
        for layout in ("stacked", "layers"):
            monkeypatch.setenv("FREETOKEN_WEIGHTS", layout)
            eng = FreeTokenEngine(cfg, EC)
            seen.clear()
            got[layout] = list(eng.generate([5, 3, 8, 1], max_new_tokens=5, ignore_eos=True))
            assert seen and all((t is Stacked) == (layout == "stacked") for t in seen), seen
            paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(eng.weights.params)[0]]
            per_layer = {re.sub(r"^\['layers'\]\[\d+\]", "", p) for p in paths if p.startswith("['layers']")}
            want = sum(not p.startswith("['layers']") for p in paths) + len(per_layer) if layout == "stacked" else len(paths)
            assert len(jax.tree.leaves(eng.weights)) == want  # a stack per weight, the experts' banks included
        assert got["stacked"] == got["layers"], fmt
    monkeypatch.setenv("FREETOKEN_WEIGHTS", "stacked")
    eng = FreeTokenEngine(cfg, EC.replace(moe_strategy="hybrid", expert_slots=8))
    banks = [j for (k, j), (path, _) in zip(eng.weights.plan, jax.tree_util.tree_flatten_with_path(eng.weights.params)[0])
             if "['experts']" in jax.tree_util.keystr(path)]  # fmt: skip
    assert banks and all(j is None for j in banks)


@pytest.mark.parametrize("words", [True, False])
def test_a_stacked_bank_gathers_the_rows_of_its_entry(words):
    """`ExpertLayout.gather` of a `Stacked` q4_0 bank, as 16-bit words (the GPU's way) or as
    stored: the rows of the entry's own bank."""
    import dataclasses

    from freetoken_jax.config import MoEModelConfig
    from freetoken_jax.quant.layout import ExpertLayout

    cfg = MoEModelConfig(vocab_size=64, hidden_dim=64, intermediate_dim=64, num_layers=3, num_experts=8, top_k=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, expert_format="q4_0")  # fmt: skip
    layout = dataclasses.replace(ExpertLayout.of(cfg, 0), words=words)
    stack = jnp.asarray(np.random.default_rng(0).integers(0, 256, (3, 8, 72)), jnp.uint8)
    ids = jnp.asarray([[1, 7], [0, 3]], jnp.int32)
    for k in range(3):
        got = layout.gather(k, Stacked(stack, 2), ids)
        want = layout.gather(k, stack[2], ids)
        assert got.dtype == (jnp.uint16 if words else jnp.uint8)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_default_stacks_on_a_gpu_only(monkeypatch):
    """FREETOKEN_WEIGHTS=auto (the default): stacked on a GPU, per layer on the CPU backend;
    the explicit values as given, others refused."""
    from freetoken_jax.models import stacked

    monkeypatch.delenv("FREETOKEN_WEIGHTS", raising=False)
    assert jax.default_backend() != "cpu" or stacked.weights_layout() == "layers"
    for backend, want in (("cpu", "layers"), ("gpu", "stacked"), ("cuda", "stacked")):
        monkeypatch.setattr(stacked.jax, "default_backend", lambda b=backend: b)
        assert stacked.weights_layout() == want
        for layout in ("layers", "stacked"):
            monkeypatch.setenv("FREETOKEN_WEIGHTS", layout)
            assert stacked.weights_layout() == layout
        monkeypatch.delenv("FREETOKEN_WEIGHTS")
    monkeypatch.setenv("FREETOKEN_WEIGHTS", "flat")
    with pytest.raises(ValueError, match="FREETOKEN_WEIGHTS='flat'"):
        stacked.weights_layout()


def test_own_params_give_the_host_banks_without_slicing_a_stack(monkeypatch):
    """`Weights.own_params`: the host banks (never stacked) as the arrays themselves, None where a
    leaf is a stack's entry, so reading the banks copies nothing; per layer, every leaf as is."""
    from freetoken_jax.runtime.offload import moe_experts

    for layout in ("stacked", "layers"):
        monkeypatch.setenv("FREETOKEN_WEIGHTS", layout)
        eng = FreeTokenEngine.from_pretrained("demo", EC.replace(moe_strategy="offload", expert_slots=8))
        w = eng.weights
        own, full = jax.tree_util.tree_flatten_with_path(w.own_params, is_leaf=lambda x: x is None)[0], w.params
        banks = [e[k].get_value() for e in moe_experts(w.own_params) for k in ("gate", "up", "down")]
        assert banks and all(any(b is leaf for leaf in w.leaves) for b in banks)
        assert [b.shape for b in banks] == [e[k].get_value().shape for e in moe_experts(full) for k in ("gate", "up", "down")]
        stacked = sum(leaf is None for _, leaf in own)
        assert stacked == (0 if layout == "layers" else sum(j is not None for _, j in w.plan)) and len(own) == len(jax.tree.leaves(full))
        assert (stacked > 0) == (layout == "stacked")
