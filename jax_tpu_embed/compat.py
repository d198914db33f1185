"""TensorFlow 1 TPU-embedding front end: feature columns, optimization parameters and
`EmbeddingConfigSpec`, with TF1's names, arguments, defaults and errors, turned into a
`jte.EmbeddingSpec` by `EmbeddingConfigSpec.to_spec()`.

    column_a = categorical_column_with_identity("a", num_buckets=100)
    column_b = categorical_column_with_identity("b", num_buckets=100)
    column_c = categorical_column_with_identity("c", num_buckets=50)
    tpu_shared_columns = shared_embedding_columns([column_a, column_b], 10)
    tpu_non_shared_column = embedding_column(column_c, 10)
    config = EmbeddingConfigSpec(
        feature_columns=tpu_shared_columns + [tpu_non_shared_column],
        optimization_parameters=AdagradParameters(0.1))
    emb = jte.Embedding(config.to_spec())     # features {"a", "b", "c"}

Names follow TensorFlow: a column's feature is its categorical column's key; an embedding
column's table is "tbl_<key>", shared columns' table "tbl_<shared_embedding_collection_name>"
(default: the sorted keys joined by "_" + "_shared_embedding").

Differences from TF, each raising a clear error rather than changing results silently:
initializers are JAX-style fn(key, shape, dtype); `use_gradient_accumulation=False` is
rejected (jte always sums a row's gradients before one update); `default_value` of identity
columns is rejected (ids outside [0, num_buckets) are ignored like -1 padding, see API.md).
Unlike TF, "mod" works for evaluation and export.
"""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import _config, _optimizers

__all__ = [
    "categorical_column_with_identity",
    "embedding_column",
    "shared_embedding_columns",
    "AdagradParameters",
    "AdamParameters",
    "StochasticGradientDescentParameters",
    "FtrlParameters",
    "MomentumParameters",
    "RMSPropParameters",
    "ProximalAdagradParameters",
    "EmbeddingConfigSpec",
]

_TABLE_NAME_PREFIX = "tbl_"  # TF's _tpu_estimator_embedding._TABLE_NAME_PREFIX.


# ------------------------------------------------------------------------------ columns


@dataclasses.dataclass(frozen=True, eq=False)
class IdentityCategoricalColumn:
    """Integer ids in [0, num_buckets) read from feature `key`."""

    key: str
    num_buckets: int

    @property
    def name(self) -> str:
        return self.key


def categorical_column_with_identity(
    key: str, num_buckets: int, default_value: int | None = None
) -> IdentityCategoricalColumn:
    """TF's `categorical_column_with_identity`: ids used as they are, in [0, num_buckets).

    Raises:
        ValueError: num_buckets < 1, or a default_value (jte ignores ids outside
            [0, num_buckets) like -1 padding instead of replacing them).
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty string, got {key!r}.")
    if not _config.is_int(num_buckets) or num_buckets < 1:
        raise ValueError(f"num_buckets {num_buckets!r} < 1, column_name {key}")
    if default_value is not None:
        raise ValueError(
            f"categorical_column_with_identity({key!r}): default_value={default_value!r} is "
            f"not supported: jax_tpu_embed ignores ids outside [0, {num_buckets}) like -1 "
            f"padding (count them with Embedding.invalid_id_counts). Map them on the host "
            f"if they should hit a row."
        )
    return IdentityCategoricalColumn(key, int(num_buckets))


@dataclasses.dataclass(frozen=True, eq=False)
class _TPUEmbeddingColumnBase:
    categorical_column: IdentityCategoricalColumn
    dimension: int
    combiner: str
    initializer: Callable | None
    max_sequence_length: int
    learning_rate_fn: Callable | None

    def get_feature_key_name(self) -> str:
        return self.categorical_column.name

    def get_max_sequence_length(self) -> int:
        return self.max_sequence_length

    def get_embedding_table_size(self) -> tuple[int, int]:
        return self.categorical_column.num_buckets, self.dimension


@dataclasses.dataclass(frozen=True, eq=False)
class TPUEmbeddingColumn(_TPUEmbeddingColumnBase):
    """An embedding column with its own table; made by `embedding_column`."""

    def get_embedding_var_name(self) -> str:
        return self.categorical_column.name


@dataclasses.dataclass(frozen=True, eq=False)
class TPUSharedEmbeddingColumn(_TPUEmbeddingColumnBase):
    """One of several columns sharing a table; made by `shared_embedding_columns`."""

    shared_embedding_collection_name: str = ""

    def get_embedding_var_name(self) -> str:
        return self.shared_embedding_collection_name


def _check_categorical(column, fn: str) -> None:
    if not isinstance(column, IdentityCategoricalColumn):
        raise TypeError(
            f"categorical_column for tpu {fn} must be type "
            f"IdentityCategoricalColumn (from "
            f"jte.compat.categorical_column_with_identity), got {type(column)}."
        )


def _check_common(dimension, combiner, initializer, learning_rate_fn, what: str) -> None:
    if not _config.is_int(dimension) or dimension < 1:
        raise ValueError(f"Invalid dimension {dimension}.")
    if combiner not in _config.COMBINERS:
        raise ValueError(
            f"Invalid combiner {combiner!r} for {what}; must be one of {list(_config.COMBINERS)}."
        )
    if initializer is not None and not callable(initializer):
        raise ValueError(
            f"initializer must be callable if specified. Embedding of column_name: {what}"
        )
    if learning_rate_fn is not None and not callable(learning_rate_fn):
        raise ValueError(
            f"learning_rate_fn must be callable fn(global_step) if specified, "
            f"got {learning_rate_fn!r} for {what}."
        )


def _check_sequence_length(value, what: str) -> None:
    if not _config.is_int(value) or value < 0:
        raise ValueError(
            f"Invalid max_sequence_length {value!r} for {what}; must be an int "
            f">= 0 (0: not a sequence feature)."
        )


def embedding_column(
    categorical_column: IdentityCategoricalColumn,
    dimension: int,
    combiner: str = "mean",
    initializer: Callable | None = None,
    max_sequence_length: int = 0,
    learning_rate_fn: Callable | None = None,
) -> TPUEmbeddingColumn:
    """TF1's `tf.tpu.experimental.embedding_column`: one table of num_buckets x dimension.

    Args:
        categorical_column: From `categorical_column_with_identity`.
        dimension: D, > 0.
        combiner: "mean", "sum" or "sqrtn" (ignored for sequence features).
        initializer: JAX-style fn(key, shape, dtype); default truncated normal with stddev
            1/sqrt(dimension), as TF.
        max_sequence_length: > 0 makes a sequence feature with output (B, L, D).
        learning_rate_fn: fn(step) -> this table's learning rate (overrides the spec's).

    Raises:
        TypeError: categorical_column is not an identity column.
        ValueError: dimension < 1, unknown combiner, non-callable initializer, negative
            max_sequence_length.
    """
    _check_categorical(categorical_column, "embedding_column")
    what = categorical_column.name
    _check_common(dimension, combiner, initializer, learning_rate_fn, what)
    _check_sequence_length(max_sequence_length, what)
    return TPUEmbeddingColumn(
        categorical_column,
        int(dimension),
        combiner,
        initializer,
        int(max_sequence_length),
        learning_rate_fn,
    )


def shared_embedding_columns(
    categorical_columns: Sequence[IdentityCategoricalColumn],
    dimension: int,
    combiner: str = "mean",
    initializer: Callable | None = None,
    max_sequence_length: int = 0,
    *,
    shared_embedding_collection_name: str | None = None,
    max_sequence_lengths: Sequence[int] | None = None,
    learning_rate_fn: Callable | None = None,
) -> list[TPUSharedEmbeddingColumn]:
    """TF1's `tf.tpu.experimental.shared_embedding_columns`: columns sharing one table.

    Args:
        categorical_columns: Identity columns, all with the same num_buckets.
        dimension, combiner, initializer, learning_rate_fn: As `embedding_column`.
        max_sequence_length: Applied to every column (API.md's form).
        shared_embedding_collection_name: The table's name without "tbl_"; default the
            sorted column names joined by "_" plus "_shared_embedding" (TF's default).
        max_sequence_lengths: TF's per-column form: one int per column; give this or
            max_sequence_length, not both.

    Returns:
        One column per categorical column, in the given order.

    Raises:
        TypeError: a column is not an identity column.
        ValueError: as `embedding_column`; num_buckets differ; max_sequence_lengths has the
            wrong length.
    """
    columns = list(categorical_columns)
    if not columns:
        raise ValueError("shared_embedding_columns: categorical_columns is empty.")
    for c in columns:
        _check_categorical(c, "shared_embedding_columns")
    if max_sequence_lengths:
        if max_sequence_length:
            raise ValueError(
                "shared_embedding_columns: give max_sequence_length or "
                "max_sequence_lengths, not both."
            )
        lengths = list(max_sequence_lengths)
        if len(lengths) != len(columns):
            raise ValueError(
                f"max_sequence_lengths and categorical_columns must be of the "
                f"same length. len(max_sequence_lengths)={len(lengths)} "
                f"len(categorical_columns)={len(columns)}."
            )
    else:
        lengths = [max_sequence_length] * len(columns)
    what = ", ".join(c.name for c in columns)
    _check_common(dimension, combiner, initializer, learning_rate_fn, what)
    for c, n in zip(columns, lengths):
        _check_sequence_length(n, c.name)
    ordered = sorted(columns, key=lambda c: c.name)
    first = ordered[0]
    for c in ordered[1:]:
        if c.num_buckets != first.num_buckets:
            raise ValueError(
                f"To use shared_embedding_column, all categorical_columns must have the same "
                f"number of buckets. Given column: {first.name!r} with buckets: "
                f"{first.num_buckets} does not match column: {c.name!r} with buckets: "
                f"{c.num_buckets}"
            )
    name = shared_embedding_collection_name or (
        "_".join(c.name for c in ordered) + "_shared_embedding"
    )
    return [
        TPUSharedEmbeddingColumn(
            c, int(dimension), combiner, initializer, int(n), learning_rate_fn, name
        )
        for c, n in zip(columns, lengths)
    ]


# ---------------------------------------------------------------- optimization parameters


class _OptimizationParameters:
    """Parameters every TF1 TPU-embedding optimizer takes."""

    def __init__(
        self,
        learning_rate,
        use_gradient_accumulation,
        clip_weight_min,
        clip_weight_max,
        weight_decay_factor,
        multiply_weight_decay_factor_by_learning_rate,
        clip_gradient_min=None,
        clip_gradient_max=None,
    ):
        self.learning_rate = learning_rate
        self.use_gradient_accumulation = use_gradient_accumulation
        self.clip_weight_min = clip_weight_min
        self.clip_weight_max = clip_weight_max
        self.weight_decay_factor = weight_decay_factor
        self.multiply_weight_decay_factor_by_learning_rate = (
            multiply_weight_decay_factor_by_learning_rate
        )
        self.clip_gradient_min = clip_gradient_min
        self.clip_gradient_max = clip_gradient_max
        name = type(self).__name__
        if not use_gradient_accumulation:
            raise ValueError(
                f"{name}: use_gradient_accumulation=False is not supported: jax_tpu_embed "
                f"always sums the gradients of a row's occurrences before one update (TF's "
                f"use_gradient_accumulation=True). Leave it at True."
            )

    def _extras(self) -> dict:
        clipvalue = None
        low, high = self.clip_gradient_min, self.clip_gradient_max
        if low is not None or high is not None:
            clipvalue = (
                float("-inf") if low is None else low,
                float("inf") if high is None else high,
            )
        return dict(
            clip_weight_min=self.clip_weight_min,
            clip_weight_max=self.clip_weight_max,
            weight_decay_factor=self.weight_decay_factor,
            multiply_weight_decay_factor_by_learning_rate=bool(
                self.multiply_weight_decay_factor_by_learning_rate
            ),
            clipvalue=clipvalue,
        )

    def to_optimizer(self, learning_rate=None) -> _optimizers.Optimizer:
        """The jte optimizer with these parameters (learning_rate overrides, e.g. a table's
        learning_rate_fn)."""
        raise NotImplementedError

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class AdagradParameters(_OptimizationParameters):
    """TF1's `tf.tpu.experimental.AdagradParameters`; becomes `jte.Adagrad`.

    `epsilon` is not TF's: 0 (the default) is TF's formula lr·g/√a, > 0 FBGEMM's and
    PyTorch's lr·g/(√a + ε)."""

    def __init__(
        self,
        learning_rate: float,
        initial_accumulator: float = 0.1,
        use_gradient_accumulation: bool = True,
        clip_weight_min: float | None = None,
        clip_weight_max: float | None = None,
        weight_decay_factor: float | None = None,
        multiply_weight_decay_factor_by_learning_rate: bool | None = None,
        clip_gradient_min: float | None = None,
        clip_gradient_max: float | None = None,
        epsilon: float = 0.0,
    ):
        super().__init__(
            learning_rate,
            use_gradient_accumulation,
            clip_weight_min,
            clip_weight_max,
            weight_decay_factor,
            multiply_weight_decay_factor_by_learning_rate,
            clip_gradient_min,
            clip_gradient_max,
        )
        self.epsilon = epsilon  # Not TF's: jte.Adagrad's epsilon (0: TF's formula).
        if not isinstance(initial_accumulator, numbers.Real) or initial_accumulator <= 0:
            raise ValueError(
                f"Adagrad initial_accumulator must be greater than zero. "
                f"Received: {initial_accumulator}."
            )
        self.initial_accumulator = initial_accumulator
        self.to_optimizer()  # Checks every value now, as TF does on construction.

    def to_optimizer(self, learning_rate=None):
        return _optimizers.Adagrad(
            learning_rate=self.learning_rate if learning_rate is None else learning_rate,
            initial_accumulator_value=self.initial_accumulator,
            epsilon=self.epsilon,
            **self._extras(),
        )


class AdamParameters(_OptimizationParameters):
    """TF1's `tf.tpu.experimental.AdamParameters` (epsilon default 1e-8, TF1's); becomes
    `jte.Adam` (no bias correction, as on TPU)."""

    def __init__(
        self,
        learning_rate: float,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-08,
        lazy_adam: bool = True,
        sum_inside_sqrt: bool = True,
        use_gradient_accumulation: bool = True,
        clip_weight_min: float | None = None,
        clip_weight_max: float | None = None,
        weight_decay_factor: float | None = None,
        multiply_weight_decay_factor_by_learning_rate: bool | None = None,
        clip_gradient_min: float | None = None,
        clip_gradient_max: float | None = None,
    ):
        if not use_gradient_accumulation and not lazy_adam:
            raise ValueError("When disabling Lazy Adam, gradient accumulation must be used.")
        super().__init__(
            learning_rate,
            use_gradient_accumulation,
            clip_weight_min,
            clip_weight_max,
            weight_decay_factor,
            multiply_weight_decay_factor_by_learning_rate,
            clip_gradient_min,
            clip_gradient_max,
        )
        if beta1 < 0.0 or beta1 >= 1.0:
            raise ValueError(f"beta1 must be in the range [0, 1), but received {beta1}.")
        if beta2 < 0.0 or beta2 >= 1.0:
            raise ValueError(f"beta2 must be in the range [0, 1), but received {beta2}.")
        if epsilon <= 0.0:
            raise ValueError(f"epsilon must be positive; received {epsilon}.")
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon
        self.lazy_adam, self.sum_inside_sqrt = lazy_adam, sum_inside_sqrt
        self.to_optimizer()

    def to_optimizer(self, learning_rate=None):
        return _optimizers.Adam(
            learning_rate=self.learning_rate if learning_rate is None else learning_rate,
            beta_1=self.beta1,
            beta_2=self.beta2,
            epsilon=self.epsilon,
            lazy_adam=bool(self.lazy_adam),
            sum_inside_sqrt=bool(self.sum_inside_sqrt),
            **self._extras(),
        )


class StochasticGradientDescentParameters(_OptimizationParameters):
    """TF1's `tf.tpu.experimental.StochasticGradientDescentParameters`; becomes `jte.SGD`."""

    def __init__(
        self,
        learning_rate: float,
        clip_weight_min: float | None = None,
        clip_weight_max: float | None = None,
        weight_decay_factor: float | None = None,
        multiply_weight_decay_factor_by_learning_rate: bool | None = None,
        clip_gradient_min: float | None = None,
        clip_gradient_max: float | None = None,
    ):
        super().__init__(
            learning_rate,
            True,
            clip_weight_min,
            clip_weight_max,
            weight_decay_factor,
            multiply_weight_decay_factor_by_learning_rate,
            clip_gradient_min,
            clip_gradient_max,
        )
        self.to_optimizer()

    def to_optimizer(self, learning_rate=None):
        return _optimizers.SGD(
            learning_rate=self.learning_rate if learning_rate is None else learning_rate,
            **self._extras(),
        )


class FtrlParameters(_OptimizationParameters):
    """TF1's `tf.tpu.experimental.FtrlParameters`; becomes `jte.FTRL`."""

    def __init__(
        self,
        learning_rate: float,
        learning_rate_power: float = -0.5,
        initial_accumulator_value: float = 0.1,
        l1_regularization_strength: float = 0.0,
        l2_regularization_strength: float = 0.0,
        use_gradient_accumulation: bool = True,
        clip_weight_min: float | None = None,
        clip_weight_max: float | None = None,
        weight_decay_factor: float | None = None,
        multiply_weight_decay_factor_by_learning_rate: bool | None = None,
        multiply_linear_by_learning_rate: bool = False,
        beta: float = 0,
        allow_zero_accumulator: bool = False,
        clip_gradient_min: float | None = None,
        clip_gradient_max: float | None = None,
    ):
        super().__init__(
            learning_rate,
            use_gradient_accumulation,
            clip_weight_min,
            clip_weight_max,
            weight_decay_factor,
            multiply_weight_decay_factor_by_learning_rate,
            clip_gradient_min,
            clip_gradient_max,
        )
        self.learning_rate_power = learning_rate_power
        self.initial_accumulator_value = initial_accumulator_value
        self.initial_linear_value = 0.0
        self.l1_regularization_strength = l1_regularization_strength
        self.l2_regularization_strength = l2_regularization_strength
        self.multiply_linear_by_learning_rate = multiply_linear_by_learning_rate
        self.beta = beta
        self.allow_zero_accumulator = allow_zero_accumulator
        self.to_optimizer()  # Checks every value now, naming the field and its range.

    def to_optimizer(self, learning_rate=None):
        return _optimizers.FTRL(
            learning_rate=self.learning_rate if learning_rate is None else learning_rate,
            learning_rate_power=self.learning_rate_power,
            l1_regularization_strength=self.l1_regularization_strength,
            l2_regularization_strength=self.l2_regularization_strength,
            beta=self.beta,
            initial_accumulator_value=self.initial_accumulator_value,
            multiply_linear_by_learning_rate=bool(self.multiply_linear_by_learning_rate),
            allow_zero_accumulator=bool(self.allow_zero_accumulator),
            **self._extras(),
        )


class MomentumParameters(_OptimizationParameters):
    """TF1's `tf.tpu.experimental.MomentumParameters`; becomes `jte.Momentum`."""

    def __init__(
        self,
        learning_rate: float,
        momentum: float,
        use_nesterov: bool = False,
        use_gradient_accumulation: bool = True,
        clip_weight_min: float | None = None,
        clip_weight_max: float | None = None,
        weight_decay_factor: float | None = None,
        multiply_weight_decay_factor_by_learning_rate: bool | None = None,
        clip_gradient_min: float | None = None,
        clip_gradient_max: float | None = None,
    ):
        super().__init__(
            learning_rate,
            use_gradient_accumulation,
            clip_weight_min,
            clip_weight_max,
            weight_decay_factor,
            multiply_weight_decay_factor_by_learning_rate,
            clip_gradient_min,
            clip_gradient_max,
        )
        self.momentum = momentum
        self.use_nesterov = use_nesterov
        self.to_optimizer()

    def to_optimizer(self, learning_rate=None):
        return _optimizers.Momentum(
            learning_rate=self.learning_rate if learning_rate is None else learning_rate,
            momentum=self.momentum,
            use_nesterov=bool(self.use_nesterov),
            **self._extras(),
        )


class RMSPropParameters(_OptimizationParameters):
    """TF1's `tf.tpu.experimental.RMSPropParameters`; becomes `jte.RMSProp` (not centered:
    TF1's has no `centered`; use `jte.RMSProp(centered=True)` for it)."""

    def __init__(
        self,
        learning_rate: float,
        rho: float,
        momentum: float,
        epsilon: float,
        use_gradient_accumulation: bool = True,
        clip_weight_min: float | None = None,
        clip_weight_max: float | None = None,
        weight_decay_factor: float | None = None,
        multiply_weight_decay_factor_by_learning_rate: bool | None = None,
        clip_gradient_min: float | None = None,
        clip_gradient_max: float | None = None,
    ):
        super().__init__(
            learning_rate,
            use_gradient_accumulation,
            clip_weight_min,
            clip_weight_max,
            weight_decay_factor,
            multiply_weight_decay_factor_by_learning_rate,
            clip_gradient_min,
            clip_gradient_max,
        )
        self.rho = rho
        self.momentum = momentum
        self.epsilon = epsilon
        self.to_optimizer()

    def to_optimizer(self, learning_rate=None):
        return _optimizers.RMSProp(
            learning_rate=self.learning_rate if learning_rate is None else learning_rate,
            rho=self.rho,
            momentum=self.momentum,
            epsilon=self.epsilon,
            **self._extras(),
        )


class ProximalAdagradParameters(_OptimizationParameters):
    """TF1's `tf.tpu.experimental.ProximalAdagradParameters`; becomes `jte.ProximalAdagrad`."""

    def __init__(
        self,
        learning_rate: float,
        initial_accumulator: float = 0.1,
        l1_regularization_strength: float = 0.0,
        l2_regularization_strength: float = 0.0,
        use_gradient_accumulation: bool = True,
        clip_weight_min: float | None = None,
        clip_weight_max: float | None = None,
        weight_decay_factor: float | None = None,
        multiply_weight_decay_factor_by_learning_rate: bool | None = None,
        clip_gradient_min: float | None = None,
        clip_gradient_max: float | None = None,
    ):
        super().__init__(
            learning_rate,
            use_gradient_accumulation,
            clip_weight_min,
            clip_weight_max,
            weight_decay_factor,
            multiply_weight_decay_factor_by_learning_rate,
            clip_gradient_min,
            clip_gradient_max,
        )
        self.initial_accumulator = initial_accumulator
        self.l1_regularization_strength = l1_regularization_strength
        self.l2_regularization_strength = l2_regularization_strength
        self.to_optimizer()

    def to_optimizer(self, learning_rate=None):
        return _optimizers.ProximalAdagrad(
            learning_rate=self.learning_rate if learning_rate is None else learning_rate,
            initial_accumulator_value=self.initial_accumulator,
            l1_regularization_strength=self.l1_regularization_strength,
            l2_regularization_strength=self.l2_regularization_strength,
            **self._extras(),
        )


_SUPPORTED_OPTIMIZERS = (
    AdagradParameters,
    AdamParameters,
    StochasticGradientDescentParameters,
    FtrlParameters,
    MomentumParameters,
    RMSPropParameters,
    ProximalAdagradParameters,
)


# ------------------------------------------------------------------------ the config spec


_COLUMN_CLASSES = (TPUEmbeddingColumn, TPUSharedEmbeddingColumn)


class EmbeddingConfigSpec:
    """TF1's `tf.estimator.tpu.experimental.EmbeddingConfigSpec`.

    Give either `feature_columns` (from `embedding_column` / `shared_embedding_columns`)
    with `optimization_parameters`, or the pair `feature_to_config_dict` ({feature name:
    jte.FeatureConfig whose `table` is a table name}) and `table_to_config_dict` ({table
    name: jte.TableConfig}; an unnamed table takes its key as name).

    Attributes mirror the arguments. `to_spec()` gives the jte.EmbeddingSpec (the same
    object on every call): `clipping_limit`, `pipeline_execution_with_tensor_core` and
    `experimental_gradient_multiplier_fn` become the spec's `clipping_limit`,
    `pipeline_execution` and `gradient_multiplier_fn`.

    Raises:
        ValueError: neither (or both) of feature_columns and the two dicts; an unsupported
            optimization_parameters; an unknown partition_strategy; a feature naming a table
            not in table_to_config_dict; a feature used by two columns.
        TypeError: a column that is not a TPU embedding column, a dict value of the wrong
            type.
    """

    def __init__(
        self,
        feature_columns: Sequence[Any] | None = None,
        optimization_parameters: _OptimizationParameters | None = None,
        clipping_limit: float | None = None,
        pipeline_execution_with_tensor_core: bool = False,
        experimental_gradient_multiplier_fn: Callable | None = None,
        feature_to_config_dict: Mapping[str, _config.FeatureConfig] | None = None,
        table_to_config_dict: Mapping[str, _config.TableConfig] | None = None,
        partition_strategy: str = "div",
        profile_data_directory: str | None = None,
        *,
        column: Sequence[Any] | None = None,
    ):
        if column is not None:
            # TF's own docstring example writes `column=`; accept it as feature_columns.
            if feature_columns is not None:
                raise ValueError(
                    "EmbeddingConfigSpec: give feature_columns or column (its alias), not both."
                )
            feature_columns = column
        if (not feature_columns and not (feature_to_config_dict and table_to_config_dict)) or (
            feature_columns and (feature_to_config_dict or table_to_config_dict)
        ):
            raise ValueError(
                "Exactly one of `feature_columns` and the pair "
                "`feature_to_config_dict` and `table_to_config_dict` must be "
                "specified."
            )
        if partition_strategy not in _config.PARTITION_STRATEGIES:
            raise ValueError(
                f'Invalid partition_strategy {partition_strategy!r}. Must be one of "mod" or "div".'
            )
        if optimization_parameters is not None or feature_columns:
            if not isinstance(optimization_parameters, _SUPPORTED_OPTIMIZERS):
                raise ValueError(
                    f"optimization_parameters must be an instance of type "
                    f"{[c.__name__ for c in _SUPPORTED_OPTIMIZERS]} (from jte.compat). Got "
                    f"{type(optimization_parameters)}. Other optimizers: use jte optimizers "
                    f"with jte.EmbeddingSpec directly."
                )
        self.feature_columns = list(feature_columns) if feature_columns else None
        self.optimization_parameters = optimization_parameters
        self.clipping_limit = clipping_limit
        self.pipeline_execution_with_tensor_core = pipeline_execution_with_tensor_core
        self.experimental_gradient_multiplier_fn = experimental_gradient_multiplier_fn
        self.partition_strategy = partition_strategy
        self.profile_data_directory = profile_data_directory  # Accepted; jte needs no profile.
        if self.feature_columns:
            table_to_config_dict, feature_to_config_dict = self._from_columns()
        else:
            feature_to_config_dict, table_to_config_dict = self._resolve_dicts(
                feature_to_config_dict, table_to_config_dict
            )
        self.feature_to_config_dict = feature_to_config_dict
        self.table_to_config_dict = table_to_config_dict
        self._spec = _config.EmbeddingSpec(
            features=dict(feature_to_config_dict),
            optimizer=(
                None if optimization_parameters is None else optimization_parameters.to_optimizer()
            ),
            partition_strategy=partition_strategy,
            clipping_limit=clipping_limit,
            gradient_multiplier_fn=experimental_gradient_multiplier_fn,
            pipeline_execution=pipeline_execution_with_tensor_core,
        )

    def to_spec(self) -> _config.EmbeddingSpec:
        """The equivalent jte.EmbeddingSpec (built and checked at construction)."""
        return self._spec

    def _from_columns(self):
        columns, parameters = self.feature_columns, self.optimization_parameters
        assert columns and parameters is not None  # __init__ requires both with columns.
        tables: dict[str, _config.TableConfig] = {}
        features: dict[str, _config.FeatureConfig] = {}
        for c in columns:
            if not isinstance(c, _COLUMN_CLASSES):
                raise TypeError(
                    f"All feature columns must be supported types in "
                    f"{[k.__name__ for k in _COLUMN_CLASSES]} (from jte.compat.embedding_column"
                    f" or shared_embedding_columns). Got {type(c)}"
                )
        for c in columns:
            feature = c.get_feature_key_name()
            if feature in features:
                raise ValueError(
                    f"Feature column {feature} is used with multiple embeddings "
                    f"and this is not supported."
                )
            table_name = _TABLE_NAME_PREFIX + c.get_embedding_var_name()
            if table_name not in tables:
                optimizer = None
                if c.learning_rate_fn is not None:
                    optimizer = parameters.to_optimizer(c.learning_rate_fn)
                vocab, dim = c.get_embedding_table_size()
                tables[table_name] = _config.TableConfig(
                    vocabulary_size=vocab,
                    dim=dim,
                    initializer=c.initializer,
                    optimizer=optimizer,
                    combiner=c.combiner,
                    name=table_name,
                )
            else:
                _check_same_table(tables[table_name], c, table_name)
            features[feature] = _config.FeatureConfig(
                tables[table_name], max_sequence_length=c.get_max_sequence_length(), name=feature
            )
        return tables, features

    @staticmethod
    def _resolve_dicts(feature_to_config_dict, table_to_config_dict):
        tables: dict[str, _config.TableConfig] = {}
        for key, table in table_to_config_dict.items():
            if not isinstance(table, _config.TableConfig):
                raise TypeError(
                    f"Config for table {key} must be of type `TableConfig`. Got {type(table)}"
                )
            if table.name is None:
                table = dataclasses.replace(table, name=key)
            elif table.name != key:
                raise ValueError(
                    f"table_to_config_dict[{key!r}] is a TableConfig named "
                    f"{table.name!r}; name it {key!r} or leave its name unset."
                )
            tables[key] = table
        by_identity = {id(t): tables[k] for k, t in table_to_config_dict.items()}
        features: dict[str, _config.FeatureConfig] = {}
        used = set()
        for key, feature in feature_to_config_dict.items():
            if not isinstance(feature, _config.FeatureConfig):
                raise TypeError(
                    f"Config for feature {key} must be of type `FeatureConfig`. Got {type(feature)}"
                )
            ref = feature.table
            if isinstance(ref, str):
                if ref not in tables:
                    raise ValueError(
                        f"Feature {key} refers to table {ref} which is not in "
                        f"the table_to_config_dict."
                    )
                table = tables[ref]
            elif id(ref) in by_identity:
                table = by_identity[id(ref)]
            else:
                raise ValueError(
                    f"Feature {key} refers to a TableConfig that is not in the "
                    f"table_to_config_dict; name its table by its key there."
                )
            used.add(id(table))
            features[key] = dataclasses.replace(feature, table=table)
        unused = [k for k, t in tables.items() if id(t) not in used]
        if unused:
            warnings.warn(
                f"EmbeddingConfigSpec: tables {unused} of table_to_config_dict are "
                f"used by no feature; they are left out of the spec.",
                stacklevel=3,
            )
        return features, tables


def _check_same_table(table: _config.TableConfig, column, table_name: str) -> None:
    vocab, dim = column.get_embedding_table_size()
    if (table.vocabulary_size, table.dim, table.combiner) != (vocab, dim, column.combiner):
        raise ValueError(
            f"Columns sharing table {table_name!r} disagree on (vocabulary_size, "
            f"dim, combiner): {(table.vocabulary_size, table.dim, table.combiner)}"
            f" vs {(vocab, dim, column.combiner)}."
        )
