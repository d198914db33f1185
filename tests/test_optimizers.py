"""One battery: every optimizer (with and without the extras) against the float64 reference
of tests/reference.py, factored into the math and the paths.

- The math (`test_every_optimizer_matches_reference`): every optimizer on one configuration,
  the XLA backend on one device, one table per optimizer in one Embedding (the per-row
  function is one on the XLA and Pallas paths, `_backend.row_step`); and the optimizers the
  C++ kernels update with math of their own (SGD, Adagrad, RowwiseAdagrad, each with and
  without the extras) on the `cpu` backend.
- The paths (`test_optimizer_on_backend_matches_reference`, `..._routed_to_owners_...`):
  every backend (the XLA passes, the Pallas kernels, the C++ kernels), "div" and "mod", on
  the all-gather path and routed to owners, with Adagrad (a slot riding in the table's rows)
  and a CustomOptimizer (a rank-2 and a rank-1 slot), and the extras routed.
- The slow tier (`-m slow`) adds the earlier full rotation: each optimizer alone on one of
  the paths in turn (`_in_turn`), Adagrad on every one.

Each case runs two steps (slots written by the first are read by the second) over a table
shared by a pooled and a sequence feature, with padding and duplicate ids, and checks
lookups, updated rows and slots, and that untouched rows and slots keep their bits
(tests/test_core.py covers every input form and combiner). So the backends'
optimizer math (the XLA form, the Pallas kernels and the C++ kernels) cannot drift from
`_optimizers` or from each other.
"""

from typing import Any

import chex
import jax
import numpy as np
import optax
import pytest

import jax_tpu_embed as jte
import reference
from conftest import make_mesh
from jax_tpu_embed import _cpu_kernels
from test_core import _features_and_spec, _grads, _inputs

# The extras, in TF's order: multiplier -> clipping_limit -> clipvalue -> optimizer ->
# decay -> weight clipping. Values chosen so that each one changes some rows.
_EXTRAS: dict[str, Any] = dict(
    clipvalue=(-0.5, 0.4),
    weight_decay_factor=0.05,
    multiply_weight_decay_factor_by_learning_rate=True,
    clip_weight_min=-0.3,
    clip_weight_max=0.25,
)
_REF_EXTRAS: dict[str, Any] = dict(
    multiplier=1.5,
    clipping_limit=0.7,
    clipvalue=(-0.5, 0.4),
    weight_decay=0.05,
    decay_by_lr=True,
    clip_min=-0.3,
    clip_max=0.25,
)
_SPEC_EXTRAS: dict[str, Any] = dict(clipping_limit=0.7, gradient_multiplier_fn=lambda step: 1.5)


def _momentum(gradient, row, slots, learning_rate, hyperparameters):
    velocity, count = slots
    (beta,) = hyperparameters
    velocity = beta * velocity + gradient
    return row - learning_rate * velocity, velocity, count + 1.0


# name: (optimizer, reference name, reference hyperparameters, extras on)
OPTIMIZERS = {
    "sgd": (jte.SGD(0.3), "sgd", {}, False),
    "sgd+extras": (jte.SGD(0.3, **_EXTRAS), "sgd", {}, True),
    "adagrad": (jte.Adagrad(0.2, initial_accumulator_value=0.5), "adagrad", {}, False),
    "adagrad+extras": (
        jte.Adagrad(0.2, initial_accumulator_value=0.5, **_EXTRAS),
        "adagrad",
        {},
        True,
    ),
    "adagrad_momentum": (
        jte.AdagradMomentum(
            0.1, momentum=0.9, use_nesterov=True, exponent=3.0, beta2=0.9, epsilon=1e-6
        ),
        "adagrad_momentum",
        dict(momentum=0.9, use_nesterov=True, exponent=3.0, beta2=0.9, epsilon=1e-6),
        False,
    ),
    "adam": (
        jte.Adam(0.05),
        "adam",
        dict(beta_1=0.9, beta_2=0.999, epsilon=1e-7, sum_inside_sqrt=True),
        False,
    ),
    "adam+extras": (
        jte.Adam(0.05, beta_1=0.5, beta_2=0.7, epsilon=1e-3, sum_inside_sqrt=False, **_EXTRAS),
        "adam",
        dict(beta_1=0.5, beta_2=0.7, epsilon=1e-3, sum_inside_sqrt=False),
        True,
    ),
    "ftrl": (
        jte.FTRL(0.2, l1_regularization_strength=0.01, l2_regularization_strength=0.1, beta=0.5),
        "ftrl",
        dict(
            learning_rate_power=-0.5,
            l1=0.01,
            l2=0.1,
            beta=0.5,
            multiply_linear_by_learning_rate=False,
        ),
        False,
    ),
    "rowwise_adagrad": (
        jte.RowwiseAdagrad(0.2, initial_accumulator_value=0.1),
        "rowwise_adagrad",
        dict(epsilon=1e-8),
        False,
    ),
    "rowwise_adagrad+extras": (
        jte.RowwiseAdagrad(0.2, initial_accumulator_value=0.1, **_EXTRAS),
        "rowwise_adagrad",
        dict(epsilon=1e-8),
        True,
    ),
    "momentum": (
        jte.Momentum(0.1, momentum=0.8),
        "momentum",
        dict(momentum=0.8, use_nesterov=False),
        False,
    ),
    "momentum_nesterov+extras": (
        jte.Momentum(0.1, momentum=0.8, use_nesterov=True, **_EXTRAS),
        "momentum",
        dict(momentum=0.8, use_nesterov=True),
        True,
    ),
    "rmsprop": (
        jte.RMSProp(0.05, rho=0.8, momentum=0.5, epsilon=1e-3),
        "rmsprop",
        dict(rho=0.8, momentum=0.5, epsilon=1e-3, centered=False),
        False,
    ),
    "rmsprop_centered+extras": (
        jte.RMSProp(0.05, rho=0.8, momentum=0.5, epsilon=1e-3, centered=True, **_EXTRAS),
        "rmsprop",
        dict(rho=0.8, momentum=0.5, epsilon=1e-3, centered=True),
        True,
    ),
    "proximal_adagrad": (
        jte.ProximalAdagrad(
            0.2,
            initial_accumulator_value=0.5,
            l1_regularization_strength=0.05,
            l2_regularization_strength=0.3,
        ),
        "proximal_adagrad",
        dict(l1=0.05, l2=0.3),
        False,
    ),
    # The reference's learning rate is the transform's (FromOptax's own is unused).
    "optax_adam": (
        jte.FromOptax(optax.adam(0.05, b1=0.8, b2=0.9, eps=1e-3)),
        "optax_adam",
        dict(b1=0.8, b2=0.9, eps=1e-3, lr=0.05),
        False,
    ),
    "custom": (
        jte.CustomOptimizer(
            _momentum,
            learning_rate=0.1,
            slot_names=["velocity", "count"],
            slot_initializers=[0.5, 0.0],
            hyperparameters=[0.9],
            slot_dims=[2, 1],
        ),
        "momentum_custom",
        dict(beta=0.9),
        False,
    ),
    # FBGEMM's EXACT_ADAGRAD: accumulators from 0, a large epsilon so that it matters here.
    "adagrad_epsilon": (
        jte.Adagrad(0.2, initial_accumulator_value=0.0, epsilon=0.3),
        "adagrad",
        dict(epsilon=0.3),
        False,
    ),
}
BACKENDS = ["xla", "pallas_interpret", "cpu"]
MESHES = [("div", 1), ("mod", 1), ("div", 8), ("mod", 8)]


def _skip_unavailable(backend):
    if backend == "cpu" and not _cpu_kernels.available():
        pytest.skip("the C++ CPU kernels do not compile here")


# One table of 300 rows of D=12 (packed 8 to a 128-lane row on the Pallas backend, with
# Adagrad's accumulator riding in its rows) shared by a pooled multi-hot feature and a
# sequence feature, with padding and many duplicate ids.
_B, _V, _D, _L, _SEQ = 16, 300, 12, 5, 3


def _spec(optimizer, strategy, extras):
    table = jte.TableConfig(_V, _D, combiner="sqrtn", name="t")
    return jte.EmbeddingSpec(
        {
            "multi": jte.FeatureConfig(table),
            "seq": jte.FeatureConfig(table, max_sequence_length=_SEQ),
        },
        optimizer,
        partition_strategy=strategy,
        **(_SPEC_EXTRAS if extras else {}),
    )


def _batch(rng):
    hot = rng.integers(0, 40, (_B, _L)) * 7 % _V  # Duplicates, spread over the shards.
    hot[rng.random((_B, _L)) < 0.3] = -1
    hot[2] = -1  # An example with no ids.
    seq = rng.integers(0, _V, (_B, _SEQ))
    seq[rng.random((_B, _SEQ)) < 0.3] = -1
    return {"multi": hot.astype(np.int32), "seq": seq.astype(np.int32)}


def _reference(table, features, grads=None):
    """Lookups, or with `grads` the summed gradient of each touched row."""
    parts = [(features["multi"], None, "sqrtn", 0), (features["seq"], None, "sqrtn", _SEQ)]
    if grads is None:
        return {
            "multi": reference.lookup(table, *parts[0][:3]),
            "seq": reference.lookup(table, *parts[1][:3], _SEQ),
        }
    return reference.row_gradients(_V, [p + (grads[k],) for p, k in zip(parts, ["multi", "seq"])])


def _case_id(key, *config) -> str:
    return f"{key}-" + "-".join(map(str, config))


def _in_turn(configs: list, *always: str) -> list:
    """Each optimizer with one of `configs`, taken in turn, and the `always` ones with every
    config: every config meets several optimizers (the per-row math is one function on every
    path), and every optimizer meets every path of the battery."""
    cases = []
    for i, key in enumerate(OPTIMIZERS):
        picked = configs if key in always else [configs[i % len(configs)]]
        cases += [(key, *c) for c in picked]
    return cases


def _tiered(fast: list, rotation: list) -> list:
    """The `fast` cases, then those of the full `rotation` not among them, marked slow
    (each once)."""
    ids = {_case_id(*c) for c in fast}
    slow = []
    for c in rotation:
        if _case_id(*c) not in ids:
            ids.add(_case_id(*c))
            slow.append(c)
    return [pytest.param(*c, id=_case_id(*c)) for c in fast] + [
        pytest.param(*c, id=_case_id(*c), marks=pytest.mark.slow) for c in slow
    ]


# ------------------------------------------------------------------------------- the math

# The optimizers whose update the C++ kernels compute themselves (the others sum duplicates
# there and update with the XLA form, as on the XLA backend).
CPU_MATH = (
    "sgd",
    "sgd+extras",
    "adagrad",
    "adagrad+extras",
    "rowwise_adagrad",
    "rowwise_adagrad+extras",
)


def _table_name(key: str) -> str:
    return key.replace("+", "_")


def _math_spec(keys, strategy, extras):
    """One table per optimizer of `keys` (each its table's optimizer), each shared by a pooled
    and a sequence feature as in `_spec`; the extras are the spec's own (all or none)."""
    features = {}
    for key in keys:
        table = jte.TableConfig(
            _V, _D, combiner="sqrtn", name=_table_name(key), optimizer=OPTIMIZERS[key][0]
        )
        features[_table_name(key)] = {
            "multi": jte.FeatureConfig(table),
            "seq": jte.FeatureConfig(table, max_sequence_length=_SEQ),
        }
    return jte.EmbeddingSpec(
        features,
        jte.SGD(0.1),  # Unused: every table has its own.
        partition_strategy=strategy,
        **(_SPEC_EXTRAS if extras else {}),
    )


@pytest.mark.parametrize("extras", [False, True], ids=["plain", "extras"])
@pytest.mark.parametrize(
    "backend,strategy,num_shards", [("xla", "div", 1), ("cpu", "mod", 8)], ids=["xla", "cpu"]
)
def test_every_optimizer_matches_reference(backend, strategy, num_shards, extras, rng):
    """Every optimizer of OPTIMIZERS with (or without) the extras, each on a table of its own
    in one Embedding: on the XLA backend all of them, on the `cpu` backend those whose
    update the C++ kernels compute (CPU_MATH). Every failing optimizer is named."""
    _skip_unavailable(backend)
    keys = [
        k
        for k, (_, _, _, has_extras) in OPTIMIZERS.items()
        if has_extras == extras and (backend != "cpu" or k in CPU_MATH)
    ]
    assert len(keys) == {"xla": 6 if extras else 12, "cpu": 3}[backend]
    emb = jte.Embedding(_math_spec(keys, strategy, extras), make_mesh(num_shards), backend=backend)
    names = {_table_name(k): k for k in keys}
    assert emb.backends == dict.fromkeys(names, backend)
    _check_two_steps(emb, names, rng)


# ------------------------------------------------------------------------------ the paths

# The all-gather path: every backend, "div" and "mod", with Adagrad (its accumulator rides in
# the table's rows on the Pallas backend) and a custom optimizer (rank-2 and rank-1 slots; on
# the XLA backend it is the math case's). The slow tier adds the earlier rotation: every
# backend on 1 and 8 devices, "div" and "mod", each optimizer in turn, Adagrad on all.
PATH_OPTIMIZERS = ("adagrad", "custom")
GATHERED = [(b, s, n) for b in BACKENDS for s, n in MESHES]
GATHERED_EIGHT = [("adagrad", b, s, 8) for b in BACKENDS for s in ("div", "mod")]
GATHERED_EIGHT += [("custom", b, s, 8) for b in BACKENDS[1:] for s in ("div", "mod")]
# The fast tier: Adagrad on the XLA ops and the C++ kernels, the custom optimizer on the C++
# kernels, "div" and "mod" in turn (other fast tests run the interpreted kernels' lines).
GATHERED_FAST = [("adagrad", "xla", "div", 8), ("adagrad", "cpu", "mod", 8)]
GATHERED_FAST += [("custom", "cpu", "div", 8)]


@pytest.mark.parametrize(
    "opt_key,backend,strategy,num_shards",
    _tiered(GATHERED_FAST, GATHERED_EIGHT + _in_turn(GATHERED, "adagrad")),
)
def test_optimizer_on_backend_matches_reference(opt_key, backend, strategy, num_shards, rng):
    _skip_unavailable(backend)
    optimizer = OPTIMIZERS[opt_key][0]
    emb = jte.Embedding(
        _spec(optimizer, strategy, OPTIMIZERS[opt_key][3]),
        make_mesh(num_shards),
        backend=_kernel(backend, block=8),
    )
    assert emb.backends == {"t": backend} and emb.routing == {"t": "gather"}
    _check_two_steps(emb, {"t": opt_key}, rng)


# Owner routing (ids sent to their rows' owners), on the XLA ops and the Pallas kernels: 16
# ids per owner and round, so that skewed devices run several rounds, or the default capacity.
# The fast tier: Adagrad on the XLA ops with the default capacity. The slow tier: the custom
# optimizer on the kernels, every optimizer in turn, and Adam with the extras on every one.
ROUTED = [("div", 8, 16, "xla"), ("mod", 4, None, "xla"), ("mod", 4, 16, "pallas_interpret")]
ROUTED_FAST = [("adagrad", *ROUTED[1])]
ROUTED_CUSTOM = [("custom", *ROUTED[2])]


@pytest.mark.parametrize(
    "opt_key,strategy,num_shards,max_ids,backend",
    _tiered(ROUTED_FAST, ROUTED_CUSTOM + _in_turn(ROUTED, "adagrad", "adam+extras")),
)
def test_optimizer_routed_to_owners_matches_reference(
    opt_key, strategy, num_shards, max_ids, backend, rng
):
    optimizer = OPTIMIZERS[opt_key][0]
    spec = _spec(optimizer, strategy, OPTIMIZERS[opt_key][3])
    emb = jte.Embedding(
        spec,
        make_mesh(num_shards),
        routing="owner",
        backend=_kernel(backend, block=8),
        max_ids_per_shard=max_ids,
    )
    assert emb.routing == {"t": "owner"} and emb.backends == {"t": backend}
    _check_two_steps(emb, {"t": opt_key}, rng)


def _kernel(backend: str, block: int):
    """`backend`, with small Pallas blocks for the Pallas kernels: rows carried from block
    to block, packed rows re-read."""
    if backend == "pallas_interpret":
        return jte.backends.Pallas(interpret=True, block=block)
    return backend


def _check_two_steps(emb, tables, rng):
    """Two steps of `emb`, whose tables are {table name: optimizer key} (`_spec`'s "t" or
    `_math_spec`'s), against the float64 reference: lookups, updated rows and slots, and
    untouched rows and slots keep their bits. Each table is checked on its own; the message
    names every table that failed."""
    nested = list(tables) != ["t"]
    (extras,) = {OPTIMIZERS[k][3] for k in tables.values()}  # The spec's: all or none.
    state = emb.init(jax.random.key(7))
    exported, exported_slots = emb.export(state), emb.export_slots(state)
    failures = {}
    for _ in range(2):  # Slots written by the first step are read by the second.
        per_table = {name: _batch(rng) for name in tables}
        features = per_table if nested else per_table["t"]
        acts = emb.lookup(state, features)
        grads = _grads(rng, acts)
        if extras:  # Large enough for every clipping to matter.
            grads = jax.tree.map(lambda g: 3 * g, grads)
        state = emb.apply_gradients(state, features, grads)
        got_tables, got_slots = emb.export(state), emb.export_slots(state)
        for name, opt_key in tables.items():
            optimizer, ref_name, hp, _ = OPTIMIZERS[opt_key]
            table, slots = exported[name], exported_slots[name]
            f = per_table[name]
            a, g = (acts[name], grads[name]) if nested else (acts, grads)
            try:
                chex.assert_trees_all_close(
                    jax.tree.map(np.asarray, a), _reference(table, f), rtol=1e-5, atol=1e-6
                )
                row_grads = _reference(table, f, g)
                want_t, want_s = reference.apply(
                    ref_name,
                    hp,
                    table,
                    slots,
                    row_grads,
                    hp.get("lr", optimizer.learning_rate),
                    **(_REF_EXTRAS if extras else {}),
                )
                got_t, got_s = got_tables[name], got_slots[name]
                chex.assert_trees_all_close((got_t, got_s), (want_t, want_s), rtol=5e-5, atol=5e-6)
                untouched = np.setdiff1d(np.arange(_V), list(row_grads))
                np.testing.assert_array_equal(got_t[untouched], table[untouched])
                for s in got_s:
                    np.testing.assert_array_equal(got_s[s][untouched], slots[s][untouched])
            except AssertionError as e:
                failures.setdefault(opt_key, str(e))
        exported, exported_slots = got_tables, got_slots  # The next step's "before".
    assert not failures, "\n".join(f"{k}: {e}" for k, e in failures.items())
    assert int(state.step) == 2


@pytest.mark.parametrize("num_shards", [pytest.param(1, marks=pytest.mark.slow), 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_pair_counts_not_a_multiple_of_the_block(backend, num_shards, rng):
    """24 pairs with no padding, blocks of 16 pairs (the Pallas kernels) or passes of 16
    (the XLA passes): the last, partial block or pass is visited like the others (on two
    devices; the slow tier adds one)."""
    _skip_unavailable(backend)
    table = jte.TableConfig(50, 8, combiner="sum", name="t")
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.Adagrad(0.3))
    kw: dict[str, Any] = dict(max_ids_per_shard=16) if backend == "xla" else {}
    emb = jte.Embedding(spec, make_mesh(num_shards), backend=_kernel(backend, block=16), **kw)
    state = emb.init(jax.random.key(0))
    ids = rng.integers(0, 12, (8, 3)).astype(np.int32)  # 24 pairs, many duplicates.
    tables, slots = emb.export(state), emb.export_slots(state)
    acts = emb.lookup(state, {"f": ids})
    np.testing.assert_allclose(
        acts["f"], reference.lookup(tables["t"], ids, None, "sum"), rtol=1e-5, atol=1e-6
    )
    grads = {"f": rng.normal(size=(8, 8)).astype(np.float32)}
    state = emb.apply_gradients(state, {"f": ids}, grads)
    row_grads = reference.row_gradients(50, [(ids, None, "sum", 0, grads["f"])])
    want_t, want_s = reference.apply("adagrad", {}, tables["t"], slots["t"], row_grads, 0.3)
    np.testing.assert_allclose(emb.export(state)["t"], want_t, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(
        emb.export_slots(state)["t"]["accumulators"], want_s["accumulators"], rtol=2e-5, atol=2e-6
    )


def test_update_traces_once_per_input_structure(rng):
    """A jitted update retraces for nothing but a new input structure (schedules and
    multipliers are traced values)."""
    spec = _features_and_spec(OPTIMIZERS["adagrad+extras"][0], **_SPEC_EXTRAS)
    emb = jte.Embedding(spec, make_mesh(2))

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, features, grads):
        return emb.apply_gradients(state, features, grads)

    state = emb.init(jax.random.key(0))
    for _ in range(3):
        features = _inputs(rng)
        state = step(state, features, _grads(rng, emb.lookup(state, features)))
    assert int(state.step) == 3


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: jte.Momentum(0.1, momentum=-0.1), r"Momentum: momentum must be >= 0, got -0.1"),
        (lambda: jte.Momentum(0.0), r"Momentum: learning_rate must be > 0, got 0.0"),
        (lambda: jte.RMSProp(rho=1.5), r"RMSProp: rho must be <= 1, got 1.5"),
        (lambda: jte.RMSProp(momentum=-1.0), r"RMSProp: momentum must be >= 0, got -1.0"),
        (lambda: jte.RMSProp(epsilon=0.0), r"RMSProp: epsilon must be > 0, got 0.0"),
        (
            lambda: jte.ProximalAdagrad(l2_regularization_strength=-2.0),
            r"ProximalAdagrad: l2_regularization_strength must be >= 0, got -2.0",
        ),
        (
            lambda: jte.ProximalAdagrad(initial_accumulator_value=float("nan")),
            r"ProximalAdagrad: initial_accumulator_value must be a finite float, got nan",
        ),
    ],
)
def test_new_optimizers_name_field_value_and_range(make, match):
    with pytest.raises(ValueError, match=match):
        make()
