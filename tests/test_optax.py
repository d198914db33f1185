"""jte.FromOptax: optax transforms as lazy per-row table optimizers (the battery in
tests/test_optimizers.py runs optax.adam on every backend; these check the rest)."""

from typing import Any

import jax
import numpy as np
import optax
import pytest

import jax_tpu_embed as jte
import reference
from conftest import make_mesh
from jax_tpu_embed import checkpoint
from test_optimizers import _V, _batch, _reference, _spec


def _run(emb, state, rng, steps):
    """`steps` updates from random batches; returns the state and the batches."""
    batches = []
    for _ in range(steps):
        features = _batch(rng)
        acts = emb.lookup(state, features)
        grads = jax.tree.map(
            lambda a: rng.normal(size=a.shape).astype(np.float32), jax.tree.map(np.asarray, acts)
        )
        state = emb.apply_gradients(state, features, grads)
        batches.append((features, grads))
    return state, batches


# Not "cpu": there jte.SGD runs the C++ update, whose duplicate sums may differ from the XLA
# form's in the last bit, while FromOptax takes the XLA row form.
@pytest.mark.parametrize(
    "backend", ["xla", pytest.param("pallas_interpret", marks=pytest.mark.slow)]
)
def test_optax_sgd_equals_jte_sgd_bit_for_bit(backend):
    mesh = make_mesh(8)
    ours = jte.Embedding(_spec(jte.SGD(0.3), "mod", False), mesh, backend=backend)
    theirs = jte.Embedding(
        _spec(jte.FromOptax(optax.sgd(0.3)), "mod", False), mesh, backend=backend
    )
    a, _ = _run(ours, ours.init(jax.random.key(3)), np.random.default_rng(5), 3)
    b, _ = _run(theirs, theirs.init(jax.random.key(3)), np.random.default_rng(5), 3)
    np.testing.assert_array_equal(ours.export(a)["t"], theirs.export(b)["t"])
    assert theirs.export_slots(b) == {"t": {}}


def _chain_reference(w, slots, g, lr0=0.1, b1=0.5, b2=0.999, eps=1e-8, clip=0.4):
    """float64: clip -> scale_by_adam (bias-corrected by the row's count) -> schedule of the
    row's count, one row."""
    g = np.clip(g, -clip, clip)
    c = slots["1_count"] + 1
    m = b1 * slots["1_mu"] + (1 - b1) * g
    v = b2 * slots["1_nu"] + (1 - b2) * g * g
    upd = (m / (1 - b1**c)) / (np.sqrt(v / (1 - b2**c)) + eps)
    step = -lr0 / (1.0 + slots["2_count"])
    return w + step * upd, {"1_count": c, "1_mu": m, "1_nu": v, "2_count": slots["2_count"] + 1}


def test_chain_with_schedule_counts_each_rows_updates(rng):
    tx = optax.chain(
        optax.clip(0.4),
        optax.scale_by_adam(b1=0.5),
        optax.scale_by_schedule(lambda count: -0.1 / (1.0 + count)),
    )
    emb = jte.Embedding(_spec(jte.FromOptax(tx), "div", False), make_mesh(8), backend="xla")
    state = emb.init(jax.random.key(0))
    table, slots = emb.export(state)["t"], emb.export_slots(state)["t"]
    assert sorted(slots) == ["1_count", "1_mu", "1_nu", "2_count"]
    table = np.asarray(table, np.float64)
    slots = {k: np.asarray(v, np.float64) for k, v in slots.items()}
    for _ in range(3):
        features = _batch(rng)
        acts = jax.tree.map(np.asarray, emb.lookup(state, features))
        grads = {k: rng.normal(size=a.shape).astype(np.float32) for k, a in acts.items()}
        state = emb.apply_gradients(state, features, grads)
        row_grads: dict[Any, Any] = _reference(table, features, grads)
        for r, g in row_grads.items():
            table[r], new = _chain_reference(table[r], {k: v[r] for k, v in slots.items()}, g)
            for k, v in new.items():
                slots[k][r] = v
    # Adam divides by √v + 1e-8: float32 rounding of tiny gradients shows at ~1e-6.
    np.testing.assert_allclose(emb.export(state)["t"], table, rtol=1e-5, atol=1e-5)
    got = emb.export_slots(state)["t"]
    for k in slots:
        np.testing.assert_allclose(got[k], slots[k], rtol=1e-5, atol=1e-7, err_msg=k)
    # Rows differ in how often they were updated: the counts are per row.
    assert len(np.unique(got["1_count"])) > 2


@pytest.mark.slow
def test_slots_go_through_checkpoints_and_restore_tables(tmp_path, rng):
    opt = jte.FromOptax(optax.adam(0.05))
    emb = jte.Embedding(_spec(opt, "div", False), make_mesh(8), backend="xla")
    state, _ = _run(emb, emb.init(jax.random.key(1)), rng, 2)
    checkpoint.save(tmp_path, emb, state)
    other = jte.Embedding(_spec(opt, "mod", False), make_mesh(2), backend="xla")
    restored, _ = checkpoint.restore(tmp_path, other)
    from_tables = other.restore_tables(emb.export(state), emb.export_slots(state), step=2)
    want = emb.export_slots(state)["t"]
    assert sorted(want) == ["0_count", "0_mu", "0_nu"]
    assert want["0_count"].shape == (_V,) and want["0_mu"].shape == (_V, 12)
    for s in (restored, from_tables):
        got = other.export_slots(s)["t"]
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    # And training goes on identically from either.
    a, _ = _run(emb, state, np.random.default_rng(9), 1)
    b, _ = _run(other, restored, np.random.default_rng(9), 1)
    np.testing.assert_allclose(emb.export(a)["t"], other.export(b)["t"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: jte.FromOptax(optax.clip_by_global_norm(1.0)), ValueError, "clip_by_global_norm"),
        (
            lambda: jte.FromOptax(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))),
            ValueError,
            "clip_by_global_norm is not elementwise",
        ),
        (lambda: jte.FromOptax("adam"), TypeError, "must be an optax.GradientTransformation"),
        (lambda: jte.FromOptax(optax.adam), TypeError, "got function"),
    ],
)
def test_bad_transforms(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_reference_is_independent_of_the_engine():
    """The battery's optax_adam reference matches optax itself on one dense row."""
    tx = optax.adam(0.05, b1=0.8, b2=0.9, eps=1e-3)
    w = np.linspace(-1, 1, 5).astype(np.float32)
    state = tx.init(w)
    slots = {"0_count": 0.0, "0_mu": np.zeros(5), "0_nu": np.zeros(5)}
    ref = np.float64(w)
    for i in range(3):
        g = np.cos(np.arange(5) + i).astype(np.float32)
        upd, state = tx.update(g, state, w)
        w = np.asarray(optax.apply_updates(w, upd))
        ref, slots = reference.optimizer_step(
            "optax_adam", dict(b1=0.8, b2=0.9, eps=1e-3), ref, slots, np.float64(g), 0.05
        )
    np.testing.assert_allclose(w, ref, rtol=1e-5)
