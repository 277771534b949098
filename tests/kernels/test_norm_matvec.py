"""The norm-and-projections kernel (interpret mode on the CPU backend, Triton on a GPU) against
its jnp reference and float64 over shapes, dtypes, biases and row counts; its lowering to one
Triton call; the models' one-token steps through it against transformers; and the switch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_kernel_choice
from jax import export

from pallas_kernels.norm_matvec import fits, norm_matvec, norm_matvec_ref

INTERPRET = jax.default_backend() == "cpu"


def _float64(x, g, eps, weights, biases):
    xf = x.astype(np.float64)
    h = g.astype(np.float64) * (xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + eps))
    return [h @ w.astype(np.float64).T + (0 if b is None else b.astype(np.float64)) for w, b in zip(weights, biases)], h


@pytest.mark.parametrize(
    "B,D,F,dtype,bias",
    [
        (1, 64, (64, 16, 16), jnp.float32, False),  # q, k, v of a small GQA model
        (1, 256, (512, 64, 64), jnp.bfloat16, True),  # with biases (Qwen2), bf16
        (3, 128, (40, 8, 24), jnp.bfloat16, False),  # rows past one; F not powers of two (fewer rows a program)
        (8, 32, (7,), jnp.float32, True),  # the most rows; an odd F: one row a program
        (2, 8192, (6,), jnp.bfloat16, False),  # the widest row: one row a program
    ],
)
def test_matches_reference_and_float64(B, D, F, dtype, bias):
    rng = np.random.default_rng(B * D + len(F))
    x = (rng.standard_normal((B, D)) * 3).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    ws = [(rng.standard_normal((f, D)) / np.sqrt(D)).astype(np.float32) for f in F]
    bs = [(rng.standard_normal(f) * 0.1).astype(np.float32) if bias else None for f in F]
    args = (jnp.asarray(x, dtype), jnp.asarray(g, dtype), 1e-6, [jnp.asarray(w, dtype) for w in ws],
            [None if b is None else jnp.asarray(b, dtype) for b in bs])  # fmt: skip
    ys, h, s = jax.jit(lambda *a: norm_matvec(*a[:2], 1e-6, *a[3:], keep_h=True, interpret=INTERPRET))(*args)
    rys, rh, _ = norm_matvec_ref(*args, keep_h=True)
    assert s is None
    assert [y.shape for y in ys] == [(B, f) for f in F] and all(y.dtype == dtype for y in ys) and h.shape == (B, D) and h.dtype == dtype
    # The same products summed in another order, rounded to the output's dtype: within one ulp.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(rh, np.float32), **tol)
    for y, ry in zip(ys, rys):
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ry, np.float32), **tol)
    want, h64 = _float64(np.asarray(args[0], np.float32), np.asarray(args[1], np.float32), 1e-6,
                         [np.asarray(w, np.float32) for w in args[3]], [None if b is None else np.asarray(b, np.float32) for b in args[4]])  # fmt: skip
    far = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(np.asarray(h, np.float32), h64, **far)
    for y, w64 in zip(ys, want):
        np.testing.assert_allclose(np.asarray(y, np.float32), w64, **far)


@pytest.mark.parametrize(
    "B,D,F,dtype,bias,add",
    [
        (1, 256, (64,), jnp.float32, False, False),  # the attention's output projection of a small model
        (2, 512, (128,), jnp.bfloat16, True, False),  # with a bias (gpt-oss), two rows
        (8, 128, (40,), jnp.bfloat16, False, True),  # the most rows, F not a power of two, the add
    ],
)
def test_without_a_norm_is_a_plain_matvec(B, D, F, dtype, bias, add):
    """`norm_D=None`: h is the rows themselves (x, or x + add), and each output h · W_iᵀ (+ bias)
    as `layers.Linear` computes it — against the reference and float64."""
    rng = np.random.default_rng(B * D)
    x = jnp.asarray(rng.standard_normal((B, D)) * 3, dtype)
    a = jnp.asarray(rng.standard_normal((B, D)), dtype) if add else None
    ws = [jnp.asarray(rng.standard_normal((f, D)) / np.sqrt(D), dtype) for f in F]
    bs = [jnp.asarray(rng.standard_normal(f) * 0.1, dtype) if bias else None for f in F]
    ys, h, s = jax.jit(lambda x, ws, bs, a: norm_matvec(x, None, 0.0, ws, bs, keep_h=True, add_BD=a, interpret=INTERPRET))(x, ws, bs, a)
    rys, rh, rs = norm_matvec_ref(x, None, 0.0, ws, bs, keep_h=True, add_BD=a)
    rows = x if a is None else x + a
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(rows, np.float32))
    np.testing.assert_array_equal(np.asarray(rh, np.float32), np.asarray(rows, np.float32))
    assert (s is None) == (not add) and [y.shape for y in ys] == [(B, f) for f in F] and all(y.dtype == dtype for y in ys)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
    for y, ry, w, b in zip(ys, rys, ws, bs):
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ry, np.float32), **tol)
        want = np.asarray(rows, np.float64) @ np.asarray(w, np.float64).T + (0 if b is None else np.asarray(b, np.float64))
        np.testing.assert_allclose(np.asarray(y, np.float32), want, **(tol if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2)))


def test_float32_outputs_of_bf16_rows():
    """The router's case: bf16 rows, a float32 weight and float32 logits at full precision."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 128)), jnp.bfloat16)
    g = jnp.asarray(1 + 0.1 * rng.standard_normal(128), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)
    (y,), h, _ = norm_matvec(x, g, 1e-5, [w], out_dtypes=[jnp.float32], keep_h=True, interpret=INTERPRET)
    (ry,), rh, _ = norm_matvec_ref(x, g, 1e-5, [w], out_dtypes=[jnp.float32], keep_h=True)
    assert y.dtype == jnp.float32 and h.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(rh, np.float32))
    np.testing.assert_allclose(np.asarray(y), np.asarray(ry), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(y), np.asarray(h, np.float64) @ np.asarray(w, np.float64).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,keep_h", [(jnp.bfloat16, True), (jnp.bfloat16, False), (jnp.float32, True)])
def test_the_residual_add_goes_with_the_norm(dtype, keep_h):
    """`add_BD`: the kernel normalises x + add and returns that sum, rounded as the model's add
    rounds it (equal to the reference's), with h and the projections of the sum; without the add
    its outputs are those of x alone."""
    rng = np.random.default_rng(7)
    B, D = 3, 256
    x, a = (jnp.asarray(rng.standard_normal((B, D)) * 3, dtype) for _ in range(2))
    g = jnp.asarray(1 + 0.1 * rng.standard_normal(D), dtype)
    ws = [jnp.asarray(rng.standard_normal((f, D)) / 16, dtype) for f in (64, 16)]
    ys, h, s = jax.jit(lambda *z: norm_matvec(z[0], z[1], 1e-6, z[2:4], keep_h=keep_h, add_BD=z[4], interpret=INTERPRET))(x, g, *ws, a)
    rys, rh, rs = norm_matvec_ref(x, g, 1e-6, ws, keep_h=keep_h, add_BD=a)
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(x + a, np.float32))
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(rs, np.float32))
    assert (h is None) == (not keep_h) and s.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
    plain, _, _ = norm_matvec_ref(x + a, g, 1e-6, ws)  # the sum's projections, the add done apart
    for y, ry, py in zip(ys, rys, plain):
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ry, np.float32), **tol)
        np.testing.assert_array_equal(np.asarray(ry, np.float32), np.asarray(py, np.float32))
    if keep_h:
        np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(rh, np.float32), **tol)
    far = np.abs(np.asarray(ys[0], np.float32) - np.asarray(norm_matvec_ref(x, g, 1e-6, ws)[0][0], np.float32)).max()
    assert far > 0.1  # the add matters to the outputs


def test_bad_shapes_raise():
    x, g = jnp.zeros((1, 64)), jnp.ones((64,))
    with pytest.raises(ValueError, match="do not match"):
        norm_matvec(x, jnp.ones((32,)), 1e-6, [jnp.zeros((8, 64))], interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        norm_matvec(x, g, 1e-6, [jnp.zeros((8, 32))], interpret=True)
    with pytest.raises(ValueError, match="do not fit"):
        norm_matvec(jnp.zeros((1, 48)), jnp.ones((48,)), 1e-6, [jnp.zeros((8, 48))], interpret=True)
    with pytest.raises(ValueError, match="bias"):
        norm_matvec(x, g, 1e-6, [jnp.zeros((8, 64))], [jnp.zeros((4,))], interpret=True)
    with pytest.raises(ValueError, match="add"):
        norm_matvec(x, g, 1e-6, [jnp.zeros((8, 64))], add_BD=jnp.zeros((2, 64)), interpret=True)
    assert fits(8, 4096, (4096, 512)) and not fits(9, 64, (8,)) and not fits(1, 2880, (8,)) and not fits(1, 16384, (8,))


def test_lowers_to_one_triton_call():
    exp = export.export(
        jax.jit(lambda x, g, q, k, v: norm_matvec(x, g, 1e-6, [q, k, v])[0]),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1, 2048), (2048,), (4096, 2048), (512, 2048), (512, 2048))))
    text = exp.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "norm_matvec" in text
    exp = export.export(  # the router's: logits, h and the residual's sum from one call
        jax.jit(lambda x, g, w, a: norm_matvec(x, g, 1e-6, [w], out_dtypes=[jnp.float32], keep_h=True, add_BD=a)),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(
        *(
            jax.ShapeDtypeStruct(s, t)
            for s, t in (((1, 2048), jnp.bfloat16), ((2048,), jnp.bfloat16), ((128, 2048), jnp.float32), ((1, 2048), jnp.bfloat16))
        )
    )
    text = exp.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "stablehlo.add" not in text


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe_norm", "gpt_oss", "deepseek_v3"])
def test_models_one_token_steps_match_transformers(name, ckpt_root, monkeypatch):
    """Every position of a prompt through one-token steps whose norms and projections go through
    the kernel (FREETOKEN_NORM_MATVEC=kernel): q/k/v biases and a shared expert (Qwen2-MoE), q/k
    norms (Qwen3), sinks and router biases (gpt-oss), and the router alone where the attention is
    latent (DeepSeek-V3's sigmoid router with its correction bias)."""
    from hf_models import check_prompt_logits

    from pallas_kernels import norm_matvec as module

    monkeypatch.setenv("FREETOKEN_NORM_MATVEC", "kernel")
    calls = []  # (normed, number of weights) of each call
    monkeypatch.setattr(
        module, "norm_matvec", lambda *a, f=module.norm_matvec, **kw: calls.append((a[1] is not None, len(a[3]))) or f(*a, **kw)
    )
    check_prompt_logits(name, ckpt_root, 23, 24, prefill_chunk=1)
    assert (True, 1) in calls and ((True, 3) in calls) == (name != "deepseek_v3")  # the router's, and q, k, v where the model has them
    # the attention's output projection where its input width is a power of two (DeepSeek's here: 4 heads × 12)
    assert ((False, 1) in calls) == (name != "deepseek_v3")


def test_how_a_step_normalises(monkeypatch):
    """FREETOKEN_NORM_MATVEC: "auto" takes the kernel on a GPU; steps of more than one token a row
    and rows the kernel does not fit stay with XLA's; "normed" takes it for the normed projections
    alone (not for the output projection); bad names raise."""
    from freetoken_jax.models import layers

    want = {  # (setting, backend): one token a row, two tokens a row, a width that is not a power of two; a projection without a norm
        ("auto", "gpu"): (True, False, False, True),
        ("auto", "cpu"): (False, False, False, False),
        ("xla", "gpu"): (False, False, False, False),
        ("normed", "gpu"): (True, False, False, False),
        ("kernel", "cpu"): (True, False, False, True),
        ("kernel", "gpu"): (True, False, False, True),
    }
    choose = lambda: (  # noqa: E731
        layers.use_norm_matvec(2, 1, 64, [8]),
        layers.use_norm_matvec(2, 2, 64, [8]),
        layers.use_norm_matvec(2, 1, 48, [8]),
        layers.use_norm_matvec(2, 1, 64, [8], normed=False),
    )
    check_kernel_choice(monkeypatch, "FREETOKEN_NORM_MATVEC", want, choose, "fused")
