"""`Adagrad(epsilon=...)`: 0 is TensorFlow's lr·g/√a, > 0 FBGEMM's EXACT_ADAGRAD and
torch.optim.Adagrad's lr·g/(√a + ε) (issue 26, item 5).

With DLRM-sized gradients (1e-7..1e-5, TorchRec's default init) ε = 1e-8 changes each step
by 1-10%, so the tests use such gradients: gradients of order 1 would hide the difference.
"""

import jax
import numpy as np
import pytest

import jax_tpu_embed as jte
from conftest import make_mesh
from jax_tpu_embed import _cpu_kernels

V, D, B, L = 40, 8, 16, 3
LR, EPS, STEPS = 0.05, 1e-8, 5


def _fbgemm_adagrad(w, a, row_grads, lr, eps):
    """FBGEMM's EXACT_ADAGRAD in float64: a += g²; w -= lr·g/(√a + ε), per touched row."""
    w, a = w.astype(np.float64), a.astype(np.float64)
    for r, g in row_grads.items():
        a[r] = a[r] + g * g
        w[r] = w[r] - lr * g / (np.sqrt(a[r]) + eps)
    return w, a


def _row_grads(ids, grads):
    out = {}
    for b in range(ids.shape[0]):
        for i in ids[b]:
            if i >= 0:
                out[int(i)] = out.get(int(i), 0.0) + grads[b].astype(np.float64)
    return out


def _run(backend, num_shards, epsilon, rng):
    table = jte.TableConfig(V, D, combiner="sum", name="t")
    opt = jte.Adagrad(LR, initial_accumulator_value=0.0, epsilon=epsilon)
    emb = jte.Embedding(
        jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, opt),
        make_mesh(num_shards),
        backend=backend,
    )
    assert emb.backends == {"t": backend}
    state = emb.init(jax.random.key(0))
    w, a = emb.export(state)["t"], emb.export_slots(state)["t"]["accumulators"]
    tf_w, tf_a = w, a
    for _ in range(STEPS):
        ids = rng.integers(0, V, (B, L)).astype(np.int32)
        ids[rng.random((B, L)) < 0.2] = -1
        # 1e-7..1e-5 in magnitude, either sign.
        mags = 10.0 ** rng.uniform(-7, -5, (B, D))
        grads = (mags * rng.choice([-1.0, 1.0], (B, D))).astype(np.float32)
        state = emb.apply_gradients(state, {"f": ids}, {"f": grads})
        w, a = _fbgemm_adagrad(w, a, _row_grads(ids, grads), LR, epsilon)
        tf_w, tf_a = _fbgemm_adagrad(tf_w, tf_a, _row_grads(ids, grads), LR, 0.0)
    got_w, got_a = emb.export(state)["t"], emb.export_slots(state)["t"]["accumulators"]
    return got_w, got_a, w, a, tf_w


@pytest.mark.parametrize(
    "backend,num_shards", [("xla", 1), ("xla", 4), ("cpu", 4), ("cpu", 1), ("pallas_interpret", 2)]
)
def test_adagrad_epsilon_is_fbgemms_formula(backend, num_shards):
    if backend == "cpu" and not _cpu_kernels.available():
        pytest.skip("the C++ CPU kernels do not compile here")
    got_w, got_a, want_w, want_a, tf_w = _run(backend, num_shards, EPS, np.random.default_rng(1))
    np.testing.assert_allclose(got_a, want_a, rtol=1e-5, atol=1e-20)
    # The step is lr·g/(√a + ε) ~ lr: its float32 error is far below ε's 1-10% effect.
    np.testing.assert_allclose(got_w, want_w, rtol=0, atol=2e-7)
    # TensorFlow's formula (ε = 0) on the same gradients is far from FBGEMM's: the
    # tolerance above tells the two apart.
    assert np.abs(tf_w - want_w).max() > 50 * 2e-7


def test_default_is_tensorflows_formula():
    assert jte.Adagrad().epsilon == 0.0
    opt = jte.Adagrad(0.1)
    w, a = opt.update_row(
        np.full((2,), 1e-6, np.float32), np.zeros(2, np.float32), (np.full(2, 1e-12),), 0.1, ()
    )
    np.testing.assert_allclose(np.asarray(w), -0.1 * 1e-6 / np.sqrt(2e-12), rtol=1e-6)


def test_epsilon_is_checked_and_allows_zero_accumulators():
    with pytest.raises(ValueError, match="Adagrad: epsilon must be >= 0"):
        jte.Adagrad(epsilon=-1e-8)
    with pytest.raises(ValueError, match="Adagrad: epsilon must be a finite float"):
        jte.Adagrad(epsilon=float("nan"))
    with pytest.raises(ValueError, match="initial_accumulator_value must be > 0"):
        jte.Adagrad(initial_accumulator_value=0.0)  # TF's formula divides by √0.
    jte.Adagrad(initial_accumulator_value=0.0, epsilon=1e-8)  # FBGEMM's and PyTorch's default.


def test_epsilon_in_config_files_and_compat(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "optimizer: {name: adagrad, learning_rate: 0.1, initial_accumulator_value: 0.0,"
        " epsilon: 1.0e-8}\n"
        "tables: {t: {vocabulary_size: 10, dim: 4}}\n"
        "features: {f: t}\n"
    )
    opt = jte.load_spec(path).optimizer
    assert isinstance(opt, jte.Adagrad) and opt.epsilon == 1e-8
    params = jte.compat.AdagradParameters(0.1, epsilon=1e-8)
    assert params.to_optimizer().epsilon == 1e-8
    assert jte.compat.AdagradParameters(0.1).to_optimizer().epsilon == 0.0
