"""jte.compat: TF1's feature columns, optimization parameters and EmbeddingConfigSpec, with
TF's names, defaults and errors, turned into working jte specs."""

import jax
import numpy as np
import pytest

import jax_tpu_embed as jte
from conftest import make_mesh
from jax_tpu_embed import compat
from jax_tpu_embed.compat import (
    AdagradParameters,
    AdamParameters,
    EmbeddingConfigSpec,
    FtrlParameters,
    MomentumParameters,
    ProximalAdagradParameters,
    RMSPropParameters,
    StochasticGradientDescentParameters,
    categorical_column_with_identity,
    embedding_column,
    shared_embedding_columns,
)

B = 8


def _docstring_example(**spec_kw):
    # TF's EmbeddingConfigSpec docstring example, with the "..." filled in.
    column_a = categorical_column_with_identity(key="a", num_buckets=20)
    column_b = categorical_column_with_identity(key="b", num_buckets=20)
    column_c = categorical_column_with_identity(key="c", num_buckets=15)
    tpu_shared_columns = shared_embedding_columns([column_a, column_b], 10)
    tpu_non_shared_column = embedding_column(column_c, 10)
    return EmbeddingConfigSpec(
        feature_columns=tpu_shared_columns + [tpu_non_shared_column],
        optimization_parameters=AdagradParameters(0.1),
        **spec_kw,
    )


def _mean_lookup(table, ids):
    ids = ids.reshape(len(ids), -1)
    out = np.zeros((len(ids), table.shape[1]))
    for b, row in enumerate(ids):
        kept = row[row >= 0]
        if kept.size:
            out[b] = table[kept].mean(0)
    return out


def _row_grads(vocab, dim, contributions):
    """Sum over (ids (B, L), act grads (B, D)) of mean-combined features."""
    g = np.zeros((vocab, dim))
    for ids, grad in contributions:
        ids = ids.reshape(len(ids), -1)
        for b, row in enumerate(ids):
            kept = row[row >= 0]
            for i in kept:
                g[i] += grad[b] / kept.size
    return g


def test_tf_docstring_example_end_to_end():
    config = _docstring_example()
    spec = config.to_spec()
    assert spec is config.to_spec()
    assert set(spec.tables()) == {"tbl_a_b_shared_embedding", "tbl_c"}
    assert [p for p, _ in spec.flat_features] == ["a", "b", "c"]
    assert spec.features["a"].table is spec.features["b"].table  # One shared table.
    assert isinstance(spec.optimizer, jte.Adagrad)
    assert spec.optimizer.initial_accumulator_value == 0.1

    emb = jte.Embedding(spec, make_mesh(2))
    state = emb.init(jax.random.key(0))
    before = {n: t.astype(np.float64) for n, t in emb.export(state).items()}
    rng = np.random.default_rng(0)
    a = rng.integers(0, 6, (B, 3))  # Duplicates within and across a and b (shared table).
    a[rng.random((B, 3)) < 0.3] = -1
    features = {"a": a, "b": rng.integers(0, 6, (B,)), "c": rng.integers(-1, 15, (B, 2))}
    acts = emb.lookup(state, features)
    shared, own = before["tbl_a_b_shared_embedding"], before["tbl_c"]
    for name, table in (("a", shared), ("b", shared), ("c", own)):
        np.testing.assert_allclose(
            acts[name], _mean_lookup(table, features[name]), rtol=1e-5, atol=1e-6
        )

    grads = {k: rng.standard_normal((B, 10)).astype(np.float32) for k in features}
    state = emb.apply_gradients(state, features, grads)
    after = emb.export(state)
    for name, table, parts in (
        ("tbl_a_b_shared_embedding", shared, [("a", "a"), ("b", "b")]),
        ("tbl_c", own, [("c", "c")]),
    ):
        g = _row_grads(
            20 if name != "tbl_c" else 15, 10, [(features[f], grads[k]) for f, k in parts]
        )
        touched = np.any(g != 0, axis=1)
        acc = 0.1 + g * g
        want = table - 0.1 * g / np.sqrt(acc)  # Adagrad, TF's initial_accumulator=0.1.
        np.testing.assert_allclose(after[name][touched], want[touched], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(after[name][~touched], table[~touched].astype(np.float32))
        assert touched.any() and (~touched).any()


def test_tf_docstring_column_keyword_and_spec_options():
    column_c = categorical_column_with_identity("c", 15)
    tpu_columns = [embedding_column(column_c, 10)] + shared_embedding_columns(
        [categorical_column_with_identity("b", 20), categorical_column_with_identity("a", 20)],
        10,
        shared_embedding_collection_name="ab",
    )
    fn = lambda step: 0.5  # noqa: E731
    spec = EmbeddingConfigSpec(
        column=tpu_columns,
        optimization_parameters=AdagradParameters(0.1),
        clipping_limit=2.0,
        pipeline_execution_with_tensor_core=True,
        experimental_gradient_multiplier_fn=fn,
        partition_strategy="mod",
    ).to_spec()
    assert set(spec.tables()) == {"tbl_c", "tbl_ab"}
    assert (
        spec.clipping_limit,
        spec.pipeline_execution,
        spec.gradient_multiplier_fn,
        spec.partition_strategy,
    ) == (2.0, True, fn, "mod")


def test_column_options_map_to_tables_and_features():
    init = lambda key, shape, dtype: np.zeros(shape, dtype)  # noqa: E731
    lr = lambda step: 0.01  # noqa: E731
    seq = embedding_column(
        categorical_column_with_identity("s", 7),
        3,
        combiner="sqrtn",
        initializer=init,
        max_sequence_length=5,
        learning_rate_fn=lr,
    )
    shared = shared_embedding_columns(
        [categorical_column_with_identity("y", 9), categorical_column_with_identity("x", 9)],
        2,
        combiner="sum",
        max_sequence_lengths=[0, 4],
    )
    spec = EmbeddingConfigSpec(
        feature_columns=[seq] + shared, optimization_parameters=AdamParameters(0.2)
    ).to_spec()
    tables = spec.tables()
    assert set(tables) == {"tbl_s", "tbl_x_y_shared_embedding"}  # Sorted names, as TF.
    s = tables["tbl_s"]
    assert (s.vocabulary_size, s.dim, s.combiner, s.initializer) == (7, 3, "sqrtn", init)
    assert isinstance(s.optimizer, jte.Adam) and s.optimizer.learning_rate is lr
    assert s.optimizer.epsilon == 1e-8  # TF1's AdamParameters default.
    assert tables["tbl_x_y_shared_embedding"].optimizer is None
    assert spec.features["s"].max_sequence_length == 5
    assert (spec.features["y"].max_sequence_length, spec.features["x"].max_sequence_length) == (
        0,
        4,
    )
    assert spec.optimizer is not None and spec.optimizer.learning_rate == 0.2


def test_dict_form_resolves_table_names():
    t = jte.TableConfig(10, 4, combiner="sum")
    u = jte.TableConfig(6, 2, name="u", optimizer=jte.SGD(0.5))
    config = EmbeddingConfigSpec(
        feature_to_config_dict={
            "x": jte.FeatureConfig("t"),
            "y": jte.FeatureConfig("t", max_sequence_length=2),
            "z": jte.FeatureConfig(u),
        },
        table_to_config_dict={"t": t, "u": u},
        optimization_parameters=StochasticGradientDescentParameters(0.1),
    )
    spec = config.to_spec()
    tables = spec.tables()
    assert set(tables) == {"t", "u"}
    assert spec.features["x"].table is spec.features["y"].table is tables["t"]
    assert (tables["t"].vocabulary_size, tables["t"].dim, tables["t"].combiner) == (10, 4, "sum")
    assert tables["u"] is u and spec.features["y"].max_sequence_length == 2
    assert isinstance(spec.optimizer, jte.SGD) and spec.optimizer.learning_rate == 0.1
    emb = jte.Embedding(spec, make_mesh(1))  # Builds and looks up.
    acts = emb.lookup(
        emb.init(jax.random.key(0)),
        {"x": np.array([1, 2]), "y": np.array([[3, -1], [4, 5]]), "z": np.array([0, 5])},
    )
    assert acts["y"].shape == (2, 2, 4) and acts["z"].shape == (2, 2)


def test_dict_form_without_optimizer_needs_table_optimizers():
    ok = EmbeddingConfigSpec(
        feature_to_config_dict={"x": jte.FeatureConfig("t")},
        table_to_config_dict={"t": jte.TableConfig(3, 2, optimizer=jte.SGD(0.1))},
    )
    assert ok.to_spec().optimizer is None
    with pytest.raises(ValueError, match="optimizer is None"):
        EmbeddingConfigSpec(
            feature_to_config_dict={"x": jte.FeatureConfig("t")},
            table_to_config_dict={"t": jte.TableConfig(3, 2)},
        )


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({}, ValueError, "Exactly one of `feature_columns` and the pair"),
        (dict(feature_to_config_dict={"x": jte.FeatureConfig("t")}), ValueError, "Exactly one of"),
        (
            dict(
                feature_columns="COLUMNS",
                feature_to_config_dict={"x": 1},
                table_to_config_dict={"t": 1},
            ),
            ValueError,
            "Exactly one of",
        ),
        (
            dict(
                feature_columns=[categorical_column_with_identity("a", 3)],
                optimization_parameters=AdagradParameters(0.1),
            ),
            TypeError,
            "All feature columns must be supported types",
        ),
        (
            dict(feature_columns=["a"], optimization_parameters=AdagradParameters(0.1)),
            TypeError,
            "All feature columns must be supported types",
        ),
        (
            dict(feature_columns="EMB", optimization_parameters=None),
            ValueError,
            "optimization_parameters must be an instance of type",
        ),
        (
            dict(feature_columns="EMB", optimization_parameters=jte.Adagrad(0.1)),
            ValueError,
            "optimization_parameters must be an instance of type",
        ),
        (
            dict(
                feature_columns="EMB",
                optimization_parameters=AdagradParameters(0.1),
                partition_strategy="hash",
            ),
            ValueError,
            "Invalid partition_strategy 'hash'",
        ),
        (
            dict(feature_columns="TWICE", optimization_parameters=AdagradParameters(0.1)),
            ValueError,
            "Feature column a is used with multiple embeddings",
        ),
        (
            dict(
                feature_to_config_dict={"x": jte.FeatureConfig("nope")},
                table_to_config_dict={"t": jte.TableConfig(3, 2)},
            ),
            ValueError,
            "Feature x refers to table nope which is not in the table_to_config_dict",
        ),
        (
            dict(
                feature_to_config_dict={"x": "t"}, table_to_config_dict={"t": jte.TableConfig(3, 2)}
            ),
            TypeError,
            "Config for feature x must be of type `FeatureConfig`",
        ),
        (
            dict(
                feature_to_config_dict={"x": jte.FeatureConfig("t")}, table_to_config_dict={"t": 3}
            ),
            TypeError,
            "Config for table t must be of type `TableConfig`",
        ),
        (
            dict(
                feature_to_config_dict={"x": jte.FeatureConfig("t")},
                table_to_config_dict={"t": jte.TableConfig(3, 2, name="other")},
            ),
            ValueError,
            "named 'other'",
        ),
    ],
)
def test_config_spec_errors_are_tfs(kwargs, error, match):
    column = embedding_column(categorical_column_with_identity("a", 3), 2)
    if kwargs.get("feature_columns") == "EMB":
        kwargs = dict(kwargs, feature_columns=[column])
    elif kwargs.get("feature_columns") == "TWICE":
        kwargs = dict(
            kwargs,
            feature_columns=[column, embedding_column(categorical_column_with_identity("a", 3), 4)],
        )
    elif kwargs.get("feature_columns") == "COLUMNS":
        kwargs = dict(kwargs, feature_columns=[column])
    with pytest.raises(error, match=match):
        EmbeddingConfigSpec(**kwargs)  # pyright: ignore[reportArgumentType]  (deliberately wrong)


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: categorical_column_with_identity("a", 0), ValueError, "num_buckets 0 < 1"),
        (
            lambda: categorical_column_with_identity("a", 3, default_value=0),
            ValueError,
            "default_value=0 is not supported",
        ),
        (
            lambda: embedding_column("a", 2),  # pyright: ignore[reportArgumentType]  (deliberately wrong)
            TypeError,
            "categorical_column for tpu",
        ),
        (
            lambda: embedding_column(categorical_column_with_identity("a", 3), 0),
            ValueError,
            "Invalid dimension 0",
        ),
        (
            lambda: embedding_column(categorical_column_with_identity("a", 3), 2, combiner="max"),
            ValueError,
            "Invalid combiner 'max'",
        ),
        (
            lambda: embedding_column(categorical_column_with_identity("a", 3), 2, initializer=1.0),  # pyright: ignore[reportArgumentType]  (deliberately wrong)
            ValueError,
            "initializer must be callable if specified",
        ),
        (
            lambda: embedding_column(
                categorical_column_with_identity("a", 3), 2, max_sequence_length=-1
            ),
            ValueError,
            "Invalid max_sequence_length -1",
        ),
        (
            lambda: shared_embedding_columns(
                [
                    categorical_column_with_identity("a", 3),
                    categorical_column_with_identity("b", 4),
                ],
                2,
            ),
            ValueError,
            "all categorical_columns must have the same number of buckets",
        ),
        (
            lambda: shared_embedding_columns(
                [categorical_column_with_identity("a", 3)], 2, max_sequence_lengths=[1, 2]
            ),
            ValueError,
            "max_sequence_lengths and categorical_columns must be of the same length",
        ),
        (
            lambda: shared_embedding_columns(
                [
                    compat.embedding_column(  # pyright: ignore[reportArgumentType]
                        categorical_column_with_identity("a", 3), 2
                    )
                ],
                2,
            ),
            TypeError,
            "categorical_column for tpu",
        ),
    ],
)
def test_column_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_optimization_parameters_map_to_jte_optimizers():
    p = AdagradParameters(
        0.1,
        initial_accumulator=0.5,
        clip_weight_min=-1.0,
        clip_weight_max=2.0,
        weight_decay_factor=0.01,
        multiply_weight_decay_factor_by_learning_rate=True,
        clip_gradient_max=3.0,
    )
    assert p.use_gradient_accumulation is True
    opt = p.to_optimizer()
    assert isinstance(opt, jte.Adagrad)
    assert (
        opt.learning_rate,
        opt.initial_accumulator_value,
        opt.clip_weight_min,
        opt.clip_weight_max,
        opt.weight_decay_factor,
        opt.multiply_weight_decay_factor_by_learning_rate,
        opt.clipvalue,
    ) == (0.1, 0.5, -1.0, 2.0, 0.01, True, (float("-inf"), 3.0))
    adam = AdamParameters(0.2).to_optimizer()
    assert (
        adam.learning_rate,
        adam.beta_1,
        adam.beta_2,
        adam.epsilon,
        adam.lazy_adam,
        adam.sum_inside_sqrt,
        adam.weight_decay_factor,
    ) == (0.2, 0.9, 0.999, 1e-8, True, True, None)
    assert AdamParameters(0.2, lazy_adam=False, sum_inside_sqrt=False).to_optimizer().dense_update
    sgd = StochasticGradientDescentParameters(0.3, clip_weight_min=0.0).to_optimizer()
    assert isinstance(sgd, jte.SGD) and (sgd.learning_rate, sgd.clip_weight_min) == (0.3, 0.0)
    assert AdagradParameters(0.1).initial_accumulator == 0.1  # TF1's default.
    ftrl = FtrlParameters(0.2, l1_regularization_strength=0.1, beta=0.5).to_optimizer()
    assert isinstance(ftrl, jte.FTRL) and (
        ftrl.learning_rate_power,
        ftrl.initial_accumulator_value,
        ftrl.l1_regularization_strength,
        ftrl.beta,
    ) == (-0.5, 0.1, 0.1, 0.5)
    mom = MomentumParameters(0.1, 0.7, use_nesterov=True, clip_gradient_min=-1.0).to_optimizer()
    assert isinstance(mom, jte.Momentum)
    assert (mom.momentum, mom.use_nesterov, mom.clipvalue) == (0.7, True, (-1.0, float("inf")))
    rms = RMSPropParameters(0.1, 0.8, 0.5, 1e-6).to_optimizer()
    assert isinstance(rms, jte.RMSProp)
    assert (rms.rho, rms.momentum, rms.epsilon, rms.centered) == (0.8, 0.5, 1e-6, False)
    prox = ProximalAdagradParameters(0.1, l2_regularization_strength=0.2).to_optimizer()
    assert isinstance(prox, jte.ProximalAdagrad)
    assert (prox.initial_accumulator_value, prox.l1_regularization_strength) == (0.1, 0.0)
    assert prox.l2_regularization_strength == 0.2
    # The new parameters are accepted by EmbeddingConfigSpec.
    spec = EmbeddingConfigSpec(
        feature_columns=[embedding_column(categorical_column_with_identity("a", 10), 4)],
        optimization_parameters=MomentumParameters(0.1, 0.9),
    ).to_spec()
    assert isinstance(spec.optimizer, jte.Momentum)


@pytest.mark.parametrize(
    "make,match",
    [
        (
            lambda: AdagradParameters(0.1, initial_accumulator=0.0),
            "Adagrad initial_accumulator must be greater than zero",
        ),
        (
            lambda: AdagradParameters(0.1, use_gradient_accumulation=False),
            "use_gradient_accumulation=False is not supported",
        ),
        (lambda: AdamParameters(0.1, beta1=1.0), "beta1 must be in the range"),
        (lambda: AdamParameters(0.1, beta2=-0.1), "beta2 must be in the range"),
        (lambda: AdamParameters(0.1, epsilon=0.0), "epsilon must be positive"),
        (
            lambda: AdamParameters(0.1, lazy_adam=False, use_gradient_accumulation=False),
            "When disabling Lazy Adam, gradient accumulation must be used",
        ),
        (lambda: StochasticGradientDescentParameters(-0.1), "learning_rate must be > 0"),
        (
            lambda: AdagradParameters(0.1, clip_weight_min=2.0, clip_weight_max=1.0),
            "clip_weight_min",
        ),
    ],
)
def test_optimization_parameter_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: FtrlParameters(0.1, learning_rate_power=0.5), r"FTRL: learning_rate_power .*<= 0"),
        (
            lambda: FtrlParameters(0.1, initial_accumulator_value=-1.0),
            r"FTRL: initial_accumulator_value must be > 0, got -1.0",
        ),
        (lambda: MomentumParameters(0.1, -0.5), r"Momentum: momentum must be >= 0, got -0.5"),
        (lambda: RMSPropParameters(0.1, 1.5, 0.0, 1e-6), r"RMSProp: rho must be <= 1, got 1.5"),
        (lambda: RMSPropParameters(0.1, 0.9, 0.0, 0.0), r"RMSProp: epsilon must be > 0, got 0.0"),
        (
            lambda: ProximalAdagradParameters(0.1, l1_regularization_strength=-0.1),
            r"ProximalAdagrad: l1_regularization_strength must be >= 0, got -0.1",
        ),
        (
            lambda: ProximalAdagradParameters(0.1, initial_accumulator=0.0),
            r"ProximalAdagrad: initial_accumulator_value must be > 0, got 0.0",
        ),
    ],
)
def test_new_optimization_parameter_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()
