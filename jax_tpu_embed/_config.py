"""Configs: tables, features and the spec that binds them to an optimizer.

Configs are frozen values checked when built. Derived facts (table names, which features use
which table, rows per shard) are computed from them and never written back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from . import _optimizers, initializers

Initializer = Callable[..., Any]

COMBINERS = ("sum", "mean", "sqrtn")
PARTITION_STRATEGIES = ("div", "mod")
_DTYPES = (jnp.float32, jnp.bfloat16)


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


EVICTIONS = ("lru", "lfu", "none")
# Where a table's rows and slots live: in the devices' memory, or in the memory of the host
# each device is attached to (the step moves only the rows it touches).
PLACEMENTS = ("device", "host")


@dataclasses.dataclass(frozen=True)
class HostCached:
    """A table placement: rows and slots in host memory, with a cache of hot rows in the
    devices' memory.

    Each device caches rows of its own shard in a `ways`-way set-associative cache of
    `cache_rows / num_devices` rows (rounded up to whole sets), least recently updated
    first out. A lookup or update reads the rows it finds in the cache from HBM and fetches
    the others from host memory, `max_misses` rows per host call; an update writes every
    row it changes through to host memory and keeps the cache's copies current, so host
    memory always holds the table and checkpoints, export and serving read it there.

    Attributes:
        cache_rows: Rows cached over all devices; fewer than the table's vocabulary.
        ways: Rows per set (LRU within a set).
        max_misses: Rows one device fetches from host memory per host call (more calls run
            when a pass misses more). Default: an eighth of the rows a pass touches (at
            least 8).
        prefetch: Whether `Embedding.prefetch` (and a train step given `next_batch`)
            brings the next batch's rows of this table into the cache ahead of its step.
    """

    cache_rows: int
    ways: int = 16
    max_misses: int | None = None
    prefetch: bool = True

    def __post_init__(self):
        if not is_int(self.cache_rows) or self.cache_rows <= 0:
            raise ValueError(f"HostCached: cache_rows must be an int > 0, got {self.cache_rows!r}.")
        if not is_int(self.ways) or not 1 <= self.ways <= 256:
            raise ValueError(f"HostCached: ways must be an int in [1, 256], got {self.ways!r}.")
        m = self.max_misses
        if m is not None and (not is_int(m) or m <= 0):
            raise ValueError(f"HostCached: max_misses must be an int > 0 or None, got {m!r}.")
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"HostCached: prefetch must be True or False, got {self.prefetch!r}.")


@dataclasses.dataclass(frozen=True)
class DynamicTable:
    """A table without a vocabulary: ids are any int64 but -1, admitted when first trained.

    The table holds `capacity` rows in buckets of `bucket_size` slots; an id's bucket is a
    hash of it, and its full 64-bit key is stored and compared, so no id ever reads or
    writes another id's row. `lookup` is read-only: an id without a row gets its initial
    row, a hash of (table, id) drawn as the default initializer draws. `apply_gradients`
    admits new ids, evicts old ones and updates rows in one pass (see the README,
    "Dynamic tables").

    Attributes:
        capacity: Rows over all shards (rounded up to whole buckets on every shard; with
            buckets of 64, to an even number of them: the TPU kernels read two at a time).
        eviction: What a new id takes when its bucket is full: "lru" (the slot updated
            least recently), "lfu" (updated in fewest steps; ties: least recently) or
            "none" (nothing: the new id is refused and counted as `failed`).
        ttl_steps: A row not updated for this many steps is expired: lookups no longer
            find it and its slot is free. None: rows never expire.
        min_count: Admit an id at the update in which it is seen for the k-th time (one
            sighting per step), counted in a bounded filter (`filter_capacity`).
        admit_probability: Admit a new id with this probability per update that sees it,
            from a hash of (table, step, id): deterministic.
        bucket_size: Slots per bucket; eviction chooses among one bucket's slots.
        filter_capacity: Entries of min_count's counting filter (default: capacity);
            a full filter bucket forgets its lowest count (`filter_evicted`).
    """

    capacity: int
    eviction: str = "lru"
    ttl_steps: int | None = None
    min_count: int = 1
    admit_probability: float = 1.0
    bucket_size: int = 64
    filter_capacity: int | None = None

    def __post_init__(self):
        where = "DynamicTable"
        if not is_int(self.capacity) or self.capacity <= 0:
            raise ValueError(f"{where}: capacity must be an int > 0, got {self.capacity!r}.")
        if self.eviction not in EVICTIONS:
            raise ValueError(
                f"{where}: eviction must be one of {list(EVICTIONS)}, got {self.eviction!r}."
            )
        if self.ttl_steps is not None and (not is_int(self.ttl_steps) or self.ttl_steps < 1):
            raise ValueError(
                f"{where}: ttl_steps must be an int >= 1 or None, got {self.ttl_steps!r}."
            )
        if not is_int(self.min_count) or self.min_count < 1:
            raise ValueError(f"{where}: min_count must be an int >= 1, got {self.min_count!r}.")
        p = self.admit_probability
        if (
            isinstance(p, bool)
            or not isinstance(p, (int, float, np.floating))
            or not (0.0 < float(p) <= 1.0)
        ):
            raise ValueError(f"{where}: admit_probability must be in (0, 1], got {p!r}.")
        if not is_int(self.bucket_size) or not 1 <= self.bucket_size <= 1024:
            raise ValueError(
                f"{where}: bucket_size must be an int in [1, 1024], got {self.bucket_size!r}."
            )
        fc = self.filter_capacity
        if fc is not None and (not is_int(fc) or fc <= 0):
            raise ValueError(f"{where}: filter_capacity must be an int > 0 or None, got {fc!r}.")


@dataclasses.dataclass(frozen=True, eq=False)
class TableConfig:
    """One embedding table: `vocabulary_size` rows of width `dim`.

    Tables are identified by object (eq=False): two TableConfigs with equal fields are two
    tables, as in TensorFlow.

    Attributes:
        vocabulary_size: Number of rows V; valid ids are [0, V). None for a dynamic table.
        dim: Row width D.
        initializer: fn(key, shape, dtype) called with the logical shape (V, D). Default:
            truncated normal, mean 0, stddev 1/sqrt(D) (TensorFlow's default).
        optimizer: Overrides the spec's optimizer for this table.
        combiner: Reduces one example's ids: "sum", "mean" or "sqrtn".
        name: Unique table name; an unnamed table takes the path of the first feature (in
            sorted flattened order) that uses it.
        dtype: Storage dtype, float32 or bfloat16. Lookups and updates compute in float32.
        stochastic_rounding: bfloat16 tables only (and their default): each updated row is
            rounded up or down to bfloat16 with probability proportional to the distance,
            from random bits keyed by (table name, step, row), so results do not depend on
            the mesh, the partition strategy or the backend. False rounds to nearest, which
            loses updates smaller than half a bfloat16 step. Slots stay float32.
        dynamic: A `DynamicTable`: the table has no vocabulary (vocabulary_size None) and
            takes any int64 id but -1.
        placement: "device" (the default): rows and slots in the devices' memory (HBM);
            "host": in the memory of each device's host (pinned host memory), so a table
            may be larger than HBM: each step gathers the rows it touches to the device
            and writes the updated ones back, in place (README, "Tables in host memory";
            a dynamic table's index stays in HBM); `jte.HostCached(cache_rows=...)`: in
            host memory, with the hot rows cached in HBM.
    """

    vocabulary_size: int | None = None
    dim: int = None  # type: ignore[assignment]  # Required; checked below.
    initializer: Initializer | None = None
    optimizer: _optimizers.Optimizer | None = None
    combiner: str = "mean"
    name: str | None = None
    dtype: Any = jnp.float32
    stochastic_rounding: bool | None = None
    dynamic: DynamicTable | None = None
    placement: str | HostCached = "device"

    @property
    def on_host(self) -> bool:
        """Whether the rows live in host memory (placement "host" or `HostCached`)."""
        return self.placement == "host" or isinstance(self.placement, HostCached)

    @property
    def cache(self) -> HostCached | None:
        return self.placement if isinstance(self.placement, HostCached) else None

    def __post_init__(self):
        where = f"TableConfig(name={self.name!r})"
        cached = isinstance(self.placement, HostCached)
        if not cached and (not isinstance(self.placement, str) or self.placement not in PLACEMENTS):
            raise ValueError(
                f"{where}: placement must be one of {list(PLACEMENTS)} or a "
                f"jte.HostCached(cache_rows=...), got {self.placement!r}."
            )
        rows = self.vocabulary_size
        if isinstance(self.dynamic, DynamicTable):
            rows = self.dynamic.capacity
        if cached and is_int(rows):
            assert isinstance(self.placement, HostCached)
            if self.placement.cache_rows >= int(rows):  # type: ignore[arg-type]
                raise ValueError(
                    f"{where}: HostCached(cache_rows={self.placement.cache_rows}) is not "
                    f"smaller than the table's {rows} rows: the whole table "
                    f"fits the cache; use placement='device'."
                )
        if self.dynamic is not None:
            if not isinstance(self.dynamic, DynamicTable):
                raise TypeError(
                    f"{where}: dynamic must be a jte.DynamicTable or None, got {self.dynamic!r}."
                )
            if self.vocabulary_size is not None:
                raise ValueError(
                    f"{where}: a dynamic table has no vocabulary; give vocabulary_size="
                    f"{self.vocabulary_size!r} or dynamic=, not both."
                )
            if self.initializer is not None and not isinstance(
                self.initializer, initializers.RowInitializer
            ):
                raise ValueError(
                    f"{where}: a dynamic table draws each id's initial row from a hash of "
                    f"(table, id); initializer= takes the row initializers of "
                    f"jte.initializers, which are drawn so, not {self.initializer!r}."
                )
        elif not is_int(self.vocabulary_size) or int(self.vocabulary_size or 0) <= 0:
            raise ValueError(
                f"{where}: vocabulary_size must be an int > 0, got {self.vocabulary_size!r} "
                f"(or give dynamic=jte.DynamicTable(...) for a table without a vocabulary)."
            )
        if not is_int(self.dim) or self.dim <= 0:
            raise ValueError(f"{where}: dim must be an int > 0, got {self.dim!r}.")
        if self.combiner not in COMBINERS:
            raise ValueError(
                f"{where}: combiner must be one of {list(COMBINERS)}, got {self.combiner!r}."
            )
        if self.initializer is not None and not callable(self.initializer):
            raise TypeError(
                f"{where}: initializer must be a callable fn(key, shape, dtype) "
                f"or None, got {self.initializer!r}."
            )
        if self.optimizer is not None and not isinstance(self.optimizer, _optimizers.Optimizer):
            raise TypeError(
                f"{where}: optimizer must be a jte optimizer (e.g. "
                f"jte.Adagrad(...)) or None, got {self.optimizer!r}."
            )
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ValueError(
                f"TableConfig: name must be a non-empty str or None, got {self.name!r}."
            )
        try:
            dtype = jnp.dtype(self.dtype)
        except TypeError as e:
            raise TypeError(
                f"{where}: dtype must be float32 or bfloat16, got {self.dtype!r}."
            ) from e
        if dtype not in [jnp.dtype(d) for d in _DTYPES]:
            raise ValueError(f"{where}: dtype must be float32 or bfloat16, got {dtype}.")
        object.__setattr__(self, "dtype", dtype)
        sr = self.stochastic_rounding
        if sr is not None and not isinstance(sr, (bool, np.bool_)):
            raise TypeError(f"{where}: stochastic_rounding must be a bool or None, got {sr!r}.")
        if sr and dtype != jnp.dtype(jnp.bfloat16):
            raise ValueError(
                f"{where}: stochastic_rounding=True needs dtype bfloat16 (a float32 table "
                f"stores its updates exactly), got dtype {dtype}."
            )
        object.__setattr__(
            self,
            "stochastic_rounding",
            bool(dtype == jnp.dtype(jnp.bfloat16) if sr is None else sr),
        )


@dataclasses.dataclass(frozen=True, eq=False)
class FeatureConfig:
    """One input feature looked up in `table`.

    Attributes:
        table: The TableConfig (several features may share one). A str (a table's name) is
            accepted only by `jte.compat`'s dict form.
        max_sequence_length: 0 for a combined feature (output (B, D)); > 0 for a sequence
            feature (output (B, L, D) with L = max_sequence_length, no combiner).
        output_shape: The activation is reshaped to output_shape + (D,); the product must
            equal the number of outputs (B, or B * L for a sequence feature).
        name: Informational name; the feature is identified by its path in the spec.
    """

    table: TableConfig | str
    max_sequence_length: int = 0
    output_shape: tuple | None = None
    name: str | None = None

    def __post_init__(self):
        where = f"FeatureConfig(name={self.name!r})"
        if not isinstance(self.table, (TableConfig, str)):
            raise TypeError(
                f"{where}: table must be a TableConfig (or a table name inside "
                f"jte.compat), got {type(self.table).__name__}."
            )
        if not is_int(self.max_sequence_length) or self.max_sequence_length < 0:
            raise ValueError(
                f"{where}: max_sequence_length must be an int >= 0, "
                f"got {self.max_sequence_length!r}."
            )
        if self.output_shape is not None:
            shape = (
                tuple(self.output_shape) if isinstance(self.output_shape, (tuple, list)) else None
            )
            if not shape or not all(is_int(d) and d > 0 for d in shape):
                raise ValueError(
                    f"{where}: output_shape must be a non-empty tuple of ints "
                    f"> 0, got {self.output_shape!r}."
                )
            object.__setattr__(self, "output_shape", tuple(int(d) for d in shape))

    @property
    def is_sequence(self) -> bool:
        return self.max_sequence_length > 0


def flatten_features(features: Mapping, prefix: str = "") -> list[tuple[str, Any]]:
    """(path, leaf) pairs of a nested dict in sorted order; paths are "a/b"."""
    if not isinstance(features, Mapping):
        raise TypeError(
            f"features must be a dict (nesting allowed), got {type(features).__name__}."
        )
    out = []
    for key in sorted(features):
        if not isinstance(key, str):
            raise TypeError(f"feature keys must be str, got {key!r} under {prefix or 'root'!r}.")
        path = f"{prefix}/{key}" if prefix else key
        value = features[key]
        if isinstance(value, Mapping):
            out.extend(flatten_features(value, path))
        else:
            out.append((path, value))
    return out


def unflatten(paths_values: Mapping[str, Any]) -> dict:
    """Inverse of flatten_features: {"a/b": x} -> {"a": {"b": x}}."""
    out: dict = {}
    for path, value in paths_values.items():
        node = out
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class EmbeddingSpec:
    """Features, their tables and how the tables are trained and sharded.

    Attributes:
        features: A dict (nesting allowed) of FeatureConfig; inputs and outputs mirror it.
        optimizer: The optimizer of every table without its own.
        partition_strategy: "div" (contiguous row blocks) or "mod" (row r on shard r % N).
        clipping_limit: Clips each summed row-gradient element to [-limit, limit] before the
            optimizer, for every table.
        gradient_multiplier_fn: fn(step) -> scalar multiplying every embedding gradient.
        pipeline_execution: TF's pipeline_execution_with_tensor_core: in the train step, the
            lookup of step N+1 reads the tables without step N's update.
    """

    features: Mapping
    optimizer: _optimizers.Optimizer | None
    partition_strategy: str = "div"
    clipping_limit: float | None = None
    gradient_multiplier_fn: Callable | None = None
    pipeline_execution: bool = False

    def __post_init__(self):
        flat = flatten_features(self.features)
        if not flat:
            raise ValueError("EmbeddingSpec: features is empty; give at least one FeatureConfig.")
        for path, f in flat:
            if not isinstance(f, FeatureConfig):
                raise TypeError(
                    f"EmbeddingSpec: feature {path!r} must be a FeatureConfig, "
                    f"got {type(f).__name__}."
                )
            if isinstance(f.table, str):
                raise TypeError(
                    f"EmbeddingSpec: feature {path!r} names its table by the string "
                    f"{f.table!r}; give the TableConfig object (table names are resolved "
                    f"only by jte.compat.EmbeddingConfigSpec)."
                )
        if self.optimizer is not None and not isinstance(self.optimizer, _optimizers.Optimizer):
            raise TypeError(
                f"EmbeddingSpec: optimizer must be a jte optimizer, got {self.optimizer!r}."
            )
        if self.optimizer is None:
            bare = sorted({p for p, f in flat if f.table.optimizer is None})
            if bare:
                raise ValueError(
                    f"EmbeddingSpec: optimizer is None but the tables of "
                    f"features {bare} have no optimizer of their own."
                )
        if self.partition_strategy not in PARTITION_STRATEGIES:
            raise ValueError(
                f"EmbeddingSpec: partition_strategy must be one of "
                f"{list(PARTITION_STRATEGIES)}, got {self.partition_strategy!r}."
            )
        if self.clipping_limit is not None and not (
            isinstance(self.clipping_limit, (int, float))
            and math.isfinite(self.clipping_limit)
            and self.clipping_limit > 0
        ):
            raise ValueError(
                f"EmbeddingSpec: clipping_limit must be a float > 0 or None, "
                f"got {self.clipping_limit!r}."
            )
        if self.gradient_multiplier_fn is not None and not callable(self.gradient_multiplier_fn):
            raise TypeError(
                f"EmbeddingSpec: gradient_multiplier_fn must be fn(step) -> "
                f"scalar or None, got {self.gradient_multiplier_fn!r}."
            )
        if not isinstance(self.pipeline_execution, bool):
            raise TypeError(
                f"EmbeddingSpec: pipeline_execution must be a bool, "
                f"got {self.pipeline_execution!r}."
            )
        table_names(self)  # Raises on name clashes.

    @property
    def flat_features(self) -> list[tuple[str, FeatureConfig]]:
        return flatten_features(self.features)

    def tables(self) -> dict[str, TableConfig]:
        """{table name: TableConfig} in order of first use."""
        names = table_names(self)
        out = {}
        for _, f in self.flat_features:
            out.setdefault(names[id(f.table)], f.table)
        return out

    def optimizer_of(self, table: TableConfig) -> _optimizers.Optimizer:
        optimizer = table.optimizer if table.optimizer is not None else self.optimizer
        assert optimizer is not None  # __post_init__: no bare table without a spec optimizer.
        return optimizer


def table_names(spec: EmbeddingSpec) -> dict[int, str]:
    """{id(TableConfig): name}; unnamed tables take their first feature's path."""
    names: dict[int, str] = {}
    owners: dict[str, TableConfig] = {}
    for path, f in spec.flat_features:
        t = f.table
        assert isinstance(t, TableConfig)  # __post_init__ rejected table names (str).
        if id(t) in names:
            continue
        name = t.name if t.name is not None else path
        if name in owners and owners[name] is not t:
            how = "explicit" if t.name is not None else f"derived from feature {path!r}"
            raise ValueError(
                f"EmbeddingSpec: two different tables are named {name!r} "
                f"(the second name is {how}); table names must be unique."
            )
        owners[name] = t
        names[id(t)] = name
    return names
