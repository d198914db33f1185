"""Bad input never corrupts state silently: it is a clear error, or a documented, counted skip.

Issue 13, items 1-7 and 12: non-finite values in a bare `apply_gradients`, learning-rate and
hyperparameter functions, id and gradient dtypes, initializer and custom-optimizer shapes,
vague errors (scalar ids, B = 0, a batch the mesh does not divide), valid configs accepted.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_tpu_embed as jte
import reference
from conftest import make_mesh

B, LR = 8, 0.5


def _emb(opt_t=None, backend="auto", num_shards=4, init_t=None, global_opt=None, routing="auto"):
    """Table "t" (10 x 4, sum) for feature "a", table "s" (6 x 2, mean) for feature "b"."""
    t = jte.TableConfig(10, 4, combiner="sum", name="t", optimizer=opt_t, initializer=init_t)
    s = jte.TableConfig(6, 2, combiner="mean", name="s")
    spec = jte.EmbeddingSpec(
        {"a": jte.FeatureConfig(t), "b": jte.FeatureConfig(s)}, global_opt or jte.Adagrad(LR)
    )
    return jte.Embedding(spec, make_mesh(num_shards), backend=backend, routing=routing)


def _batch(rng):
    """Ids with duplicates and -1 padding, positive weights, random gradients (all NumPy)."""
    ids_a = rng.integers(0, 10, (B, 3)).astype(np.int32)
    ids_a[1, 2] = ids_a[5, 0] = -1
    weights_a = rng.uniform(0.5, 2.0, (B, 3)).astype(np.float32)
    ids_b = rng.integers(0, 6, (B, 2)).astype(np.int32)
    ids_b[3, 1] = -1
    grads = {
        "a": rng.normal(size=(B, 4)).astype(np.float32),
        "b": rng.normal(size=(B, 2)).astype(np.float32),
    }
    return ids_a, weights_a, ids_b, grads


def _features(ids_a, weights_a, ids_b):
    # jax.Arrays: what a jitted caller passes, so nothing is checked on the host.
    return {"a": jte.Weighted(jnp.asarray(ids_a), jnp.asarray(weights_a)), "b": jnp.asarray(ids_b)}


def _adagrad_reference(emb, state, ids_b, grad_b):
    """Table "s" (mean combiner, Adagrad) after one step, in float64."""
    rows = reference.row_gradients(6, [(ids_b, None, "mean", 0, grad_b)])
    return reference.apply(
        "adagrad",
        {},
        emb.export(state)["s"],
        emb.export_slots(state)["s"],
        rows,
        LR,
    )


@pytest.fixture(scope="module")
def emb_state():
    """For errors raised while tracing, which never change the state."""
    emb = _emb()
    return emb, emb.init(jax.random.key(5))


# ------------------------------------------------------------------ 1: non-finite inputs


@pytest.mark.parametrize(
    "poison,backend,routing",
    [
        ("nan_grad", "xla", "gather"),
        ("inf_weight", "xla", "gather"),
        ("inf_grad", "cpu", "gather"),
        ("nan_grad", "xla", "owner"),
        pytest.param("inf_grad", "pallas_interpret", "owner", marks=pytest.mark.slow),
    ],
)
def test_nonfinite_inputs_skip_only_their_table_and_are_counted(backend, poison, routing, rng):
    emb = _emb(backend=backend, routing=routing)
    state = emb.init(jax.random.key(0))
    before_tables, before_slots = emb.export(state), emb.export_slots(state)
    ids_a, weights_a, ids_b, grads = _batch(rng)
    if poison == "nan_grad":
        grads["a"][2, 1] = np.nan
    elif poison == "inf_grad":
        grads["a"][6, 3] = -np.inf
    else:
        weights_a[4, 1] = np.inf  # ids_a[4, 1] is a valid id.
    # Before the update: it consumes (donates) the state it is given.
    want_table, want_slots = _adagrad_reference(emb, state, ids_b, grads["b"])
    new = emb.apply_gradients(state, _features(ids_a, weights_a, ids_b), grads)

    tables, slots = emb.export(new), emb.export_slots(new)
    # Table "t" is skipped: bit-identical, every row and slot.
    np.testing.assert_array_equal(tables["t"], before_tables["t"])
    np.testing.assert_array_equal(slots["t"]["accumulators"], before_slots["t"]["accumulators"])
    # Table "s" had finite inputs: updated as usual.
    np.testing.assert_allclose(tables["s"], want_table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(slots["s"]["accumulators"], want_slots["accumulators"], rtol=1e-5)
    assert emb.skipped_updates == {"t": 1, "s": 0}
    assert int(new.step) == 1  # One table was updated.

    # Every table poisoned: nothing changes, the step does not advance, both are counted.
    grads["b"][0, 0] = np.nan
    newer = emb.apply_gradients(new, _features(ids_a, weights_a, ids_b), grads)
    for name in ("t", "s"):
        np.testing.assert_array_equal(emb.export(newer)[name], tables[name])
    assert int(newer.step) == 1
    assert emb.skipped_updates == {"t": 2, "s": 1}


def test_nonfinite_skip_inside_jit_returns_the_counts(rng):
    emb = _emb(opt_t=jte.Adam(0.1, lazy_adam=False))  # Updates every row, even untouched.
    state = emb.init(jax.random.key(1))
    before = emb.export(state)["t"], emb.export_slots(state)["t"]
    ids_a, weights_a, ids_b, grads = _batch(rng)
    grads["a"][0, 0] = np.nan

    @jax.jit
    def step(state, features, grads):
        return emb.apply_gradients(state, features, grads, return_skipped=True)

    new, skipped = step(state, _features(ids_a, weights_a, ids_b), grads)
    assert {k: int(v) for k, v in skipped.items()} == {"t": 1, "s": 0}
    np.testing.assert_array_equal(emb.export(new)["t"], before[0])
    for name, value in emb.export_slots(new)["t"].items():
        np.testing.assert_array_equal(value, before[1][name])
    # Calls traced inside another jit are counted only in what they return.
    assert emb.skipped_updates == {"t": 0, "s": 0}

    # Finite again: not skipped, and the dense Adam table moves.
    grads["a"][0, 0] = 1.0
    new, skipped = step(new, _features(ids_a, weights_a, ids_b), grads)
    assert {k: int(v) for k, v in skipped.items()} == {"t": 0, "s": 0}
    assert not np.array_equal(emb.export(new)["t"], before[0])
    assert np.all(np.isfinite(emb.export(new)["t"]))


# ---------------------------------------------------- 2 and 7: learning-rate functions


@pytest.mark.parametrize(
    "opt",
    [
        jte.SGD(learning_rate=lambda step: jnp.float32(jnp.nan)),
        jte.SGD(learning_rate=lambda step: -0.1 + 0.0 * step),
        jte.Adagrad(learning_rate=lambda step: jnp.float32(jnp.inf)),
        jte.FTRL(learning_rate=lambda step: 0.0 * step),  # FTRL divides by it.
        jte.CustomOptimizer(
            lambda g, w, slots, lr, hps: w - lr * hps[0] * g,
            learning_rate=0.1,
            hyperparameters=[lambda step: jnp.float32(jnp.nan)],
        ),
    ],
    ids=["sgd_nan", "sgd_negative", "adagrad_inf", "ftrl_zero", "custom_nan_hyperparameter"],
)
def test_bad_schedule_values_skip_and_count(opt, rng):
    emb = _emb(opt_t=opt)
    state = emb.init(jax.random.key(2))
    before = emb.export(state)["t"]
    ids_a, weights_a, ids_b, grads = _batch(rng)
    new, skipped = emb.apply_gradients(
        state, _features(ids_a, weights_a, ids_b), grads, return_skipped=True
    )
    assert {k: int(v) for k, v in skipped.items()} == {"t": 1, "s": 0}
    np.testing.assert_array_equal(emb.export(new)["t"], before)
    for value in emb.export_slots(new)["t"].values():
        assert np.all(np.isfinite(value))


def test_zero_learning_rate_from_a_schedule_is_used(rng):
    # optax warmup schedules start at 0: the step runs (Adagrad's accumulators still grow).
    emb = _emb(opt_t=jte.Adagrad(optax.linear_schedule(0.0, 0.1, 10)))
    state = emb.init(jax.random.key(3))
    before, before_slots = emb.export(state)["t"], emb.export_slots(state)["t"]
    ids_a, weights_a, ids_b, grads = _batch(rng)
    new, skipped = emb.apply_gradients(
        state, _features(ids_a, weights_a, ids_b), grads, return_skipped=True
    )
    assert int(skipped["t"]) == 0
    np.testing.assert_array_equal(emb.export(new)["t"], before)
    grown = emb.export_slots(new)["t"]["accumulators"] > before_slots["accumulators"]
    assert grown.any()


@pytest.mark.parametrize("backend", ["xla", "cpu"])
def test_non_scalar_schedule_is_an_error_naming_the_table(backend, rng):
    ids_a, weights_a, ids_b, grads = _batch(rng)
    features = _features(ids_a, weights_a, ids_b)
    emb = _emb(opt_t=jte.Adagrad(lambda step: jnp.full((4,), 0.1)), backend=backend)
    # Raised while tracing (on the C++ kernels, too): shapes alone show it.
    check = lambda emb, f, g: jax.eval_shape(emb.apply_gradients, emb.abstract_state(), f, g)
    with pytest.raises(
        ValueError,
        match=r"Table 't': Adagrad learning_rate\(step\) returned a float32 array of shape "
        r"\(4,\); it must return a real scalar",
    ):
        check(emb, features, grads)
    custom = jte.CustomOptimizer(
        lambda g, w, slots, lr, hps: w - lr * hps[0] * g,
        hyperparameters=[0.5, lambda step: jnp.ones((2,))],
    )
    emb = _emb(opt_t=custom, backend=backend)
    with pytest.raises(
        ValueError, match=r"Table 't': CustomOptimizer hyperparameters\[1\]\(step\)"
    ):
        check(emb, features, grads)
    spec = jte.EmbeddingSpec(
        {"a": jte.FeatureConfig(jte.TableConfig(10, 4, name="t"))},
        jte.SGD(0.1),
        gradient_multiplier_fn=lambda step: jnp.ones((4,)),
    )
    emb = jte.Embedding(spec, make_mesh(4), backend=backend)
    with pytest.raises(ValueError, match=r"gradient_multiplier_fn\(step\) returned"):
        check(emb, {"a": jnp.asarray(ids_a)}, {"a": grads["a"]})


# ------------------------------------------------------------------- 3: dtypes


@pytest.mark.parametrize("dtype", [np.float32, np.bool_, np.uint32, np.uint8, np.complex64])
def test_ids_of_a_wrong_dtype_are_rejected_at_trace_time(dtype, emb_state, rng):
    emb, state = emb_state
    ids_a, _, ids_b, grads = _batch(rng)
    features = {"a": jnp.asarray(np.maximum(ids_a, 0).astype(dtype)), "b": jnp.asarray(ids_b)}
    match = r"Feature 'a': ids have dtype \w+; they must have a signed integer dtype"
    with pytest.raises(ValueError, match=match):
        jax.jit(emb.lookup)(state, features)
    with pytest.raises(ValueError, match=match):
        jax.jit(emb.apply_gradients)(state, features, grads)
    with pytest.raises(ValueError, match=match):
        emb.lookup(state, {"a": np.maximum(ids_a, 0).astype(dtype), "b": ids_b})


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda g: g.astype(np.complex64), r"act_grads\['a'\] has dtype complex64"),
        (lambda g: g.astype(str), r"act_grads\['a'\] has dtype <U\d+"),
        (lambda g: g > 0, r"act_grads\['a'\] has dtype bool"),
    ],
)
def test_gradients_of_a_wrong_dtype_are_rejected(bad, match, emb_state, rng):
    emb, state = emb_state
    ids_a, weights_a, ids_b, grads = _batch(rng)
    grads["a"] = bad(grads["a"])
    with pytest.raises(ValueError, match=match + r"; gradients must be real numbers"):
        emb.apply_gradients(state, {"a": jte.Weighted(ids_a, weights_a), "b": ids_b}, grads)


# ---------------------------------------------------------------- 4: initializer shape


def test_initializer_of_the_wrong_shape_is_an_error_naming_the_table():
    def wide(key, shape, dtype):
        return jnp.zeros((shape[0], shape[1] + 1), dtype)

    emb = _emb(init_t=wide)
    with pytest.raises(
        ValueError,
        match=r"Table 't': its initializer returned shape \(10, 5\); expected "
        r"\(vocabulary_size, dim\) = \(10, 4\)",
    ):
        emb.init(jax.random.key(7))


# ------------------------------------------------------------------ 5: vague errors


def test_scalar_ids_inside_jit_and_empty_batch(emb_state, rng):
    emb, state = emb_state
    _, _, ids_b, _ = _batch(rng)
    with pytest.raises(
        ValueError, match=r"Feature 'a': ids must be \(B,\) or \(B, L\), got shape \(\)"
    ):
        jax.jit(emb.lookup)(state, {"a": jnp.int32(3), "b": jnp.asarray(ids_b)})
    empty = {"a": np.zeros((0, 3), np.int32), "b": np.zeros((0, 2), np.int32)}
    with pytest.raises(ValueError, match=r"the batch is empty \(B=0\)"):
        emb.lookup(state, empty)
    with pytest.raises(ValueError, match=r"the batch is empty \(B=0\)"):
        jax.jit(emb.lookup)(state, jax.tree.map(jnp.asarray, empty))


def test_train_step_batch_the_mesh_does_not_divide(rng):
    emb = _emb()

    def loss_fn(params, acts, batch):
        return jnp.mean((acts["a"] @ params["w"] - batch["labels"]) ** 2)

    step = jte.make_train_step(emb, loss_fn, optax.sgd(0.1))
    state = step.init(jax.random.key(9), {"w": jnp.ones((4,))})
    ids_a, _, ids_b, _ = _batch(rng)
    batch = {
        "features": {"a": ids_a[:6], "b": ids_b[:6]},
        "labels": np.zeros(6, np.float32),
    }
    with pytest.raises(
        ValueError,
        match=r"B=6 examples, which mesh axis 'shard' of size 4 does not divide; B must be "
        r"a positive multiple of 4",
    ):
        step(state, batch)


# ------------------------------------------------------------ 6: custom optimizer shapes


def _momentum(g, w, slots, lr, hps):
    (v,) = slots
    v = 0.9 * v + g
    return w - lr * v, v


@pytest.mark.parametrize(
    "fn,slot_dims,match",
    [
        (
            lambda g, w, s, lr, h: (w[:-1], s[0]),
            [2],
            r"the new row has shape \(3,\), expected \(4,\)",
        ),
        (
            lambda g, w, s, lr, h: (jnp.sum(w), s[0]),
            [2],
            r"the new row has shape \(\), expected \(4,\)",
        ),
        (
            lambda g, w, s, lr, h: (w, s[0], s[0]),
            [2],
            r"returned 3 values; expected .* \(2: \['new_row', 'v'\]\)",
        ),
        (
            lambda g, w, s, lr, h: (w - lr * g, s[0] + g),
            [1],
            r"slot 'v' has shape \(4,\), expected \(\) \(slot_dims 1\)",
        ),
        (
            lambda g, w, s, lr, h: (w - lr * g, jnp.sum(s[0])),
            [2],
            r"slot 'v' has shape \(\), expected \(4,\) \(slot_dims 2\)",
        ),
    ],
    ids=[
        "row_too_short",
        "scalar_row",
        "too_many_slots",
        "slot_rank_2_for_dims_1",
        "slot_rank_1_for_dims_2",
    ],
)
def test_custom_optimizer_wrong_shapes_name_custom_computation(fn, slot_dims, match, rng):
    opt = jte.CustomOptimizer(
        fn, learning_rate=0.1, slot_names=["v"], slot_initializers=[0.0], slot_dims=slot_dims
    )
    emb = _emb(opt_t=opt)  # Every backend runs a custom optimizer's rows through XLA.
    ids_a, weights_a, ids_b, grads = _batch(rng)
    features = _features(ids_a, weights_a, ids_b)
    with pytest.raises(ValueError, match=r"CustomOptimizer: custom_computation.*" + match):
        # Raised while tracing: shapes alone show it, nothing is compiled.
        jax.eval_shape(emb.apply_gradients, emb.abstract_state(), features, grads)


def test_custom_slot_initializer_of_the_wrong_shape():
    opt = jte.CustomOptimizer(
        _momentum,
        slot_names=["v"],
        slot_initializers=[lambda key, shape, dtype: jnp.zeros(shape[:1], dtype)],
    )
    emb = _emb(opt_t=opt)
    with pytest.raises(
        ValueError,
        match=r"Table 't': the initializer of slot 'v' \(slot_dims 2\) returned shape \(10,\); "
        r"expected \(10, 4\)",
    ):
        emb.init(jax.random.key(11))


# --------------------------------------------------------------- 12: valid configs


def test_rowwise_adagrad_without_epsilon_but_with_an_initial_accumulator(rng):
    opt = jte.RowwiseAdagrad(0.1, epsilon=0.0, initial_accumulator_value=0.5)
    emb = _emb(opt_t=opt)
    state = emb.init(jax.random.key(12))
    ids_a, weights_a, ids_b, grads = _batch(rng)
    grads["a"][:4] = 0.0  # Rows touched only with zero gradients must stay finite.
    rows = reference.row_gradients(10, [(ids_a, weights_a, "sum", 0, grads["a"])])
    want, want_slots = reference.apply(
        "rowwise_adagrad",
        {"epsilon": 0.0},
        emb.export(state)["t"],
        emb.export_slots(state)["t"],
        rows,
        0.1,
    )
    new = emb.apply_gradients(state, {"a": jte.Weighted(ids_a, weights_a), "b": ids_b}, grads)
    np.testing.assert_allclose(emb.export(new)["t"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        emb.export_slots(new)["t"]["accumulators"], want_slots["accumulators"], rtol=1e-5
    )


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda: jte.RowwiseAdagrad(epsilon=0.0, initial_accumulator_value=0.0),
            "RowwiseAdagrad: epsilon and initial_accumulator_value are both 0",
        ),
        (lambda: jte.RowwiseAdagrad(epsilon=-1e-8), r"epsilon must be >= 0"),
        (lambda: jte.AdagradMomentum(epsilon=0.0), r"AdagradMomentum: epsilon must be > 0"),
        (lambda: jte.Adagrad(initial_accumulator_value=0.0), "must be > 0"),
    ],
)
def test_configs_that_divide_by_zero_are_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_custom_optimizer_hyperparameters_is_the_given_attribute():
    schedule = optax.constant_schedule(0.9)
    opt = jte.CustomOptimizer(
        _momentum, slot_names=["v"], slot_initializers=[0.0], hyperparameters=[0.5, schedule]
    )
    assert opt.hyperparameters == (0.5, schedule)
    assert (
        jte.CustomOptimizer(_momentum, slot_names=["v"], slot_initializers=[0.0]).hyperparameters
        == ()
    )
