"""Embedding specs from YAML or TOML files: `jte.load_spec(path)`, `jte.load_config(path)`.

The format (YAML shown; TOML has the same structure, see configs/example_small.toml):

    optimizer:                       # the global optimizer: a name, or a mapping with `name`
      name: adagrad                  # and that optimizer's arguments (API.md section 2)
      learning_rate: 0.05
    partition_strategy: div          # "div" (default) or "mod"
    clipping_limit: 10.0             # optional, > 0
    pipeline_execution: false        # optional

    tables:                          # {table name: table}; or a list of tables with `name`
      users:
        vocabulary_size: 100000      # required, int > 0
        dim: 32                      # required, int > 0
        combiner: sum                # sum | mean (default) | sqrtn
        dtype: bfloat16              # float32 (default) | bfloat16
        stochastic_rounding: true    # bfloat16 only; default true for bfloat16
        initializer: {name: truncated_normal, stddev: 0.05}   # or just "zeros"
        optimizer: {name: sgd, learning_rate: 0.1}            # overrides the global one
        placement: host              # device (default) | host: rows in host memory |
                                     # {host_cached: {cache_rows: 50000, ways: 16}}
      items: {vocabulary_size: 5000, dim: 16}
      clicks:                        # a dynamic table: no vocabulary_size, any int64 id
        dim: 16
        dynamic: {capacity: 1000000, eviction: lru, ttl_steps: 10000, min_count: 2}

    features:                        # nested mappings; a mapping with `table` is a feature,
      user: {table: users}           # any other mapping is a group (paths "group/feature")
      history: {table: items, max_sequence_length: 20}
      context:
        item: items                  # shorthand for {table: items}
        slate: {table: items, output_shape: [4, 8]}

Optimizers (`name`, then the arguments of the jte class): sgd, adagrad, adagrad_momentum,
adam, ftrl, rowwise_adagrad, momentum, rmsprop, proximal_adagrad (the class names, e.g.
"RowwiseAdagrad", work too). A
learning_rate may be a number or an optax schedule: {schedule: cosine_decay_schedule,
init_value: 0.1, decay_steps: 1000} (any function of optax.schedules, with its arguments).
`clipvalue: [min, max]` becomes a pair.

Initializers (`name`, then arguments) are `jte.initializers`, which `init` draws row by row
in blocks, as the default: truncated_normal (mean 0, stddev 1/sqrt(dim), cut at 2 stddev;
without arguments, the default initializer), normal (mean 0, stddev 1/sqrt(dim)), uniform
(minval -0.05, maxval 0.05), zeros, ones, constant (value).

Every table must be used by a feature. Top-level keys other than those above are kept,
unread, in `load_config(path).extra` (e.g. a `model:` or `training:` section for the
program that reads the file), unless they look like a misspelt key. Every error is a
ValueError naming the file, the key and the value, e.g.
`configs/x.yaml: tables.users.dim: must be an int > 0, got -3.`
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tomllib
from collections.abc import Mapping

import jax.numpy as jnp

from . import _config, _optimizers, initializers

_TOP_KEYS = (
    "tables",
    "features",
    "optimizer",
    "partition_strategy",
    "clipping_limit",
    "pipeline_execution",
)
_TABLE_KEYS = (
    "vocabulary_size",
    "dim",
    "combiner",
    "name",
    "dtype",
    "stochastic_rounding",
    "initializer",
    "optimizer",
    "dynamic",
    "placement",
)
_DYNAMIC_KEYS = tuple(f.name for f in dataclasses.fields(_config.DynamicTable))
_HOST_CACHED_KEYS = tuple(f.name for f in dataclasses.fields(_config.HostCached))
_FEATURE_KEYS = ("table", "max_sequence_length", "output_shape", "name")

_OPTIMIZERS = {
    "sgd": _optimizers.SGD,
    "adagrad": _optimizers.Adagrad,
    "adagrad_momentum": _optimizers.AdagradMomentum,
    "adam": _optimizers.Adam,
    "ftrl": _optimizers.FTRL,
    "rowwise_adagrad": _optimizers.RowwiseAdagrad,
    "momentum": _optimizers.Momentum,
    "rmsprop": _optimizers.RMSProp,
    "proximal_adagrad": _optimizers.ProximalAdagrad,
}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


@dataclasses.dataclass(frozen=True)
class ConfigFile:
    """A loaded config: the spec, and the top-level sections it does not use.

    Attributes:
        spec: The EmbeddingSpec.
        extra: {key: value} of the other top-level keys, as parsed (e.g. "model").
        path: The file read.
    """

    spec: _config.EmbeddingSpec
    extra: dict
    path: str


def load_spec(path: str | os.PathLike) -> _config.EmbeddingSpec:
    """The EmbeddingSpec described by a .yaml/.yml or .toml file (format: module docstring).

    Raises:
        FileNotFoundError: no such file.
        ValueError: anything wrong in it, naming the file, the key and the value.
    """
    return load_config(path).spec


def load_config(path: str | os.PathLike) -> ConfigFile:
    """Like `load_spec`, also returning the file's other top-level sections."""
    path = os.fspath(path)
    data = _read(path)
    spec = spec_from_dict(data, source=path)
    extra = {k: v for k, v in data.items() if k not in _TOP_KEYS}
    return ConfigFile(spec, extra, path)


def _read(path: str) -> dict:
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".yaml", ".yml", ".toml"):
        raise ValueError(f"{path}: unknown config file type {ext!r}; use .yaml, .yml or .toml.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such config file.")
    try:
        if ext == ".toml":
            with open(path, "rb") as f:
                data = tomllib.load(f)
        else:
            with open(path, encoding="utf-8") as f:
                data = _load_yaml(f)
    except _DuplicateKey as e:
        raise ValueError(f"{path}: {e}") from None
    except Exception as e:  # Parser errors carry the line and column.
        raise ValueError(f"{path}: cannot parse the file: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: the top level must be a mapping with `tables:` and "
            f"`features:`, got {type(data).__name__} {data!r}."
        )
    return data


class _DuplicateKey(Exception):
    """A YAML mapping that gives one key twice (YAML's safe_load keeps the last silently)."""


def _load_yaml(stream):
    """yaml.safe_load, except that a key given twice in one mapping is an error naming it
    and both lines (keys merged in with `<<:` may still be overridden)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen: dict = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    line = key_node.start_mark.line + 1
                    try:
                        first = seen.get(key)
                    except TypeError:  # An unhashable key: construct_mapping's own error.
                        continue
                    seen.setdefault(key, line)
                    if first is not None:
                        raise _DuplicateKey(
                            f"line {line}: key {key!r} is given twice in one mapping (first "
                            f"on line {first}); YAML would keep only the last. Remove one."
                        )
            return super().construct_mapping(node, deep=deep)

    return yaml.load(stream, Loader=Loader)  # noqa: S506 (a SafeLoader)


class _Where:
    """Formats errors as "<file>: <key>: <problem>"."""

    def __init__(self, source: str):
        self.source = source

    def error(self, key: str, problem: str) -> ValueError:
        return ValueError(f"{self.source}: {key}: {problem}")


def spec_from_dict(data: Mapping, source: str = "<dict>") -> _config.EmbeddingSpec:
    """The EmbeddingSpec of an already parsed config (same format); `source` names it in
    errors."""
    w = _Where(source)
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: the config must be a mapping, got {data!r}.")
    for key in data:
        if key in _TOP_KEYS:
            continue
        close = difflib.get_close_matches(str(key), _TOP_KEYS, n=1, cutoff=0.8)
        if close:
            raise w.error(str(key), f"unknown key {key!r}; did you mean {close[0]!r}?")
    for key in ("tables", "features"):
        if key not in data:
            raise ValueError(f"{source}: missing top-level key {key!r}.")
    tables = _tables(w, data["tables"])
    features = _features(w, data["features"], tables, "features")
    used = {id(f.table) for _, f in _config.flatten_features(features)}
    unused = [n for n, t in tables.items() if id(t) not in used]
    if unused:
        raise w.error(
            f"tables.{unused[0]}",
            f"table {unused[0]!r} is used by no feature "
            f"(unused tables: {unused}); remove it or add a feature.",
        )
    optimizer = (
        None if data.get("optimizer") is None else _optimizer(w, "optimizer", data["optimizer"])
    )
    strategy = data.get("partition_strategy", "div")
    if strategy not in _config.PARTITION_STRATEGIES:
        raise w.error(
            "partition_strategy",
            f"must be one of {list(_config.PARTITION_STRATEGIES)}, got {strategy!r}.",
        )
    clipping = data.get("clipping_limit")
    if clipping is not None:
        clipping = _number(clipping)
        if (
            not isinstance(clipping, (int, float))
            or isinstance(clipping, bool)
            or not (math.isfinite(clipping) and clipping > 0)
        ):
            raise w.error(
                "clipping_limit", f"must be a number > 0, got {data['clipping_limit']!r}."
            )
        clipping = float(clipping)
    pipeline = data.get("pipeline_execution", False)
    if not isinstance(pipeline, bool):
        raise w.error("pipeline_execution", f"must be true or false, got {pipeline!r}.")
    try:
        return _config.EmbeddingSpec(
            features=features,
            optimizer=optimizer,
            partition_strategy=strategy,
            clipping_limit=clipping,
            pipeline_execution=pipeline,
        )
    except (ValueError, TypeError) as e:
        key = "optimizer" if optimizer is None and "optimizer is None" in str(e) else "features"
        raise w.error(key, str(e)) from e


def _number(value):
    """YAML 1.1 reads `1e-3` (no dot) as a string; numbers written so are meant as floats."""
    if isinstance(value, str) and _FLOAT.match(value.strip()):
        return float(value)
    return value


def _check_keys(w: _Where, key: str, value: Mapping, allowed) -> None:
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise w.error(
            f"{key}.{unknown[0]}",
            f"unknown key {unknown[0]!r} (value "
            f"{value[unknown[0]]!r}); allowed keys are {list(allowed)}.",
        )


def _int(w: _Where, key: str, value, low: int) -> int:
    if not _config.is_int(value) or value < low:
        raise w.error(key, f"must be an int >= {low}, got {value!r}.")
    return int(value)


def _tables(w: _Where, raw) -> dict[str, _config.TableConfig]:
    if isinstance(raw, list):
        entries = []
        for i, t in enumerate(raw):
            if not isinstance(t, Mapping) or not isinstance(t.get("name"), str):
                raise w.error(
                    f"tables[{i}]", f"a table in a list must be a mapping with a `name`, got {t!r}."
                )
            entries.append((t["name"], f"tables[{i}]", t))
    elif isinstance(raw, Mapping):
        entries = [(str(n), f"tables.{n}", t) for n, t in raw.items()]
    else:
        raise w.error(
            "tables", f"must be a mapping {{name: table}} or a list of tables, got {raw!r}."
        )
    if not entries:
        raise w.error("tables", "no tables given.")
    tables = {}
    for name, key, t in entries:
        if name in tables:
            raise w.error(key, f"a second table named {name!r}.")
        tables[name] = _table(w, key, name, t)
    return tables


def _table(w: _Where, key: str, name: str, t) -> _config.TableConfig:
    if not isinstance(t, Mapping):
        raise w.error(key, f"a table must be a mapping with vocabulary_size and dim, got {t!r}.")
    _check_keys(w, key, t, _TABLE_KEYS)
    if t.get("name", name) != name:
        raise w.error(f"{key}.name", f"{t['name']!r} differs from the table's key {name!r}.")
    dynamic = None
    if t.get("dynamic") is not None:
        dynamic = _dynamic(w, f"{key}.dynamic", t["dynamic"])
    for field in ("dim",) if dynamic else ("vocabulary_size", "dim"):
        if field not in t:
            raise w.error(key, f"missing {field!r} (table {name!r} is {dict(t)!r}).")
    if dynamic and t.get("vocabulary_size") is not None:
        raise w.error(
            f"{key}.vocabulary_size",
            f"a dynamic table has no vocabulary; give vocabulary_size or dynamic, not both "
            f"(got {t['vocabulary_size']!r}).",
        )
    vocab = None if dynamic else _int(w, f"{key}.vocabulary_size", t["vocabulary_size"], 1)
    dim = _int(w, f"{key}.dim", t["dim"], 1)
    combiner = t.get("combiner", "mean")
    if combiner not in _config.COMBINERS:
        raise w.error(
            f"{key}.combiner", f"must be one of {list(_config.COMBINERS)}, got {combiner!r}."
        )
    dtype = t.get("dtype", "float32")
    if dtype not in _DTYPES:
        raise w.error(f"{key}.dtype", f"must be one of {list(_DTYPES)}, got {dtype!r}.")
    rounding = t.get("stochastic_rounding")
    if rounding is not None and not isinstance(rounding, bool):
        raise w.error(f"{key}.stochastic_rounding", f"must be true or false, got {rounding!r}.")
    initializer = None
    if t.get("initializer") is not None:
        initializer = _initializer(w, f"{key}.initializer", t["initializer"], dim)
    optimizer = None
    if t.get("optimizer") is not None:
        optimizer = _optimizer(w, f"{key}.optimizer", t["optimizer"])
    placement = _placement(w, f"{key}.placement", t.get("placement", "device"))
    try:
        return _config.TableConfig(
            vocabulary_size=vocab,
            dim=dim,
            initializer=initializer,
            optimizer=optimizer,
            combiner=combiner,
            name=name,
            dtype=_DTYPES[dtype],
            stochastic_rounding=rounding,
            dynamic=dynamic,
            placement=placement,
        )
    except (ValueError, TypeError) as e:
        raise w.error(key, str(e)) from e


def _placement(w: _Where, key: str, raw) -> str | _config.HostCached:
    """`placement: device | host`, or `placement: {host_cached: {cache_rows: N, ...}}` (the
    fields of jte.HostCached)."""
    if isinstance(raw, Mapping) and set(raw) == {"host_cached"}:
        fields = raw["host_cached"]
        if not isinstance(fields, Mapping) or "cache_rows" not in fields:
            raise w.error(
                f"{key}.host_cached",
                f"must be a mapping with at least `cache_rows`, got {fields!r}.",
            )
        _check_keys(w, f"{key}.host_cached", fields, _HOST_CACHED_KEYS)
        try:
            return _config.HostCached(**dict(fields))
        except (ValueError, TypeError) as e:
            raise w.error(f"{key}.host_cached", str(e)) from e
    if not isinstance(raw, str) or raw not in _config.PLACEMENTS:
        raise w.error(
            key,
            f"must be one of {list(_config.PLACEMENTS)} or {{host_cached: {{cache_rows: N}}}}, "
            f"got {raw!r}.",
        )
    return raw


def _dynamic(w: _Where, key: str, raw) -> _config.DynamicTable:
    """`dynamic: {capacity: N, ...}`: the fields of jte.DynamicTable."""
    if not isinstance(raw, Mapping) or "capacity" not in raw:
        raise w.error(key, f"must be a mapping with at least `capacity`, got {raw!r}.")
    _check_keys(w, key, raw, _DYNAMIC_KEYS)
    try:
        return _config.DynamicTable(**dict(raw))
    except (ValueError, TypeError) as e:
        raise w.error(key, str(e)) from e


def _features(w: _Where, raw, tables: dict, key: str) -> dict:
    if not isinstance(raw, Mapping) or not raw:
        raise w.error(
            key, f"must be a non-empty mapping of features (or groups of them), got {raw!r}."
        )
    out = {}
    for name, value in raw.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise w.error(
                f"{key}.{name}",
                f"feature and group names must be non-empty strings without '/', got {name!r}.",
            )
        sub = f"{key}.{name}"
        if isinstance(value, str):
            value = {"table": value}
        if not isinstance(value, Mapping):
            raise w.error(
                sub,
                f"must be a feature (a table name, or a mapping with `table`) "
                f"or a group of features (a mapping), got {value!r}.",
            )
        if "table" in value:
            out[name] = _feature(w, sub, value, tables)
        else:
            out[name] = _features(w, value, tables, sub)
    return out


def _feature(w: _Where, key: str, f: Mapping, tables: dict) -> _config.FeatureConfig:
    _check_keys(w, key, f, _FEATURE_KEYS)
    table = f["table"]
    if not isinstance(table, str) or table not in tables:
        raise w.error(f"{key}.table", f"no table named {table!r}; the tables are {list(tables)}.")
    length = _int(w, f"{key}.max_sequence_length", f.get("max_sequence_length", 0), 0)
    shape = f.get("output_shape")
    if shape is not None:
        if (
            not isinstance(shape, list)
            or not shape
            or not all(_config.is_int(d) and d > 0 for d in shape)
        ):
            raise w.error(
                f"{key}.output_shape", f"must be a non-empty list of ints > 0, got {shape!r}."
            )
        shape = tuple(shape)
    name = f.get("name")
    if name is not None and not isinstance(name, str):
        raise w.error(f"{key}.name", f"must be a string, got {name!r}.")
    try:
        return _config.FeatureConfig(
            tables[table], max_sequence_length=length, output_shape=shape, name=name
        )
    except (ValueError, TypeError) as e:
        raise w.error(key, str(e)) from e


def _name_and_args(w: _Where, key: str, raw, kind: str) -> tuple[str, dict]:
    if isinstance(raw, str):
        return raw, {}
    if isinstance(raw, Mapping) and isinstance(raw.get("name"), str):
        return raw["name"], {k: v for k, v in raw.items() if k != "name"}
    raise w.error(key, f"an {kind} is a name or a mapping with `name` and arguments, got {raw!r}.")


def _optimizer(w: _Where, key: str, raw) -> _optimizers.Optimizer:
    name, args = _name_and_args(w, key, raw, "optimizer")
    lookup = dict(_OPTIMIZERS)
    lookup.update({cls.__name__.lower(): cls for cls in _OPTIMIZERS.values()})
    cls = lookup.get(name.lower())
    if cls is None:
        raise w.error(f"{key}.name", f"unknown optimizer {name!r}; use one of {list(_OPTIMIZERS)}.")
    extras = [f.name for f in dataclasses.fields(_optimizers._Extras)]
    fields = sorted(
        (f.name for f in dataclasses.fields(cls) if f.init), key=lambda n: n in extras
    )  # The optimizer's own arguments first.
    kwargs = {}
    for arg, value in args.items():
        if arg not in fields:
            raise w.error(
                f"{key}.{arg}",
                f"{cls.__name__} has no argument {arg!r} (value "
                f"{value!r}); its arguments are {fields}.",
            )
        if arg == "learning_rate" and isinstance(value, Mapping):
            value = _schedule(w, f"{key}.learning_rate", value)
        elif arg == "clipvalue" and isinstance(value, list):
            value = tuple(_number(v) for v in value)
        else:
            value = _number(value)
        kwargs[arg] = value
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise w.error(key, f"{e} (given {dict(args)!r})") from e


def _schedule(w: _Where, key: str, raw: Mapping):
    import optax

    name = raw.get("schedule")
    fn = getattr(optax.schedules, name, None) if isinstance(name, str) else None
    if not isinstance(name, str) or name.startswith("_") or fn is None or not callable(fn):
        raise w.error(
            f"{key}.schedule",
            f"must name a function of optax.schedules (e.g. "
            f"'cosine_decay_schedule'), got {name!r}.",
        )
    args = {k: _number(v) for k, v in raw.items() if k != "schedule"}
    try:
        return fn(**args)
    except Exception as e:
        raise w.error(key, f"optax.schedules.{name}({args}) failed: {e}") from e


def _initializer(w: _Where, key: str, raw, dim: int):
    """A `jte.initializers` row initializer (drawn by `init` in blocks, as the default)."""
    name, args = _name_and_args(w, key, raw, "initializer")
    del dim  # A stddev not given is 1/sqrt(dim), which the initializer applies itself.
    defaults = {
        "truncated_normal": (initializers.truncated_normal, {"mean": 0.0, "stddev": None}),
        "normal": (initializers.normal, {"mean": 0.0, "stddev": None}),
        "uniform": (initializers.uniform, {"minval": -0.05, "maxval": 0.05}),
        "zeros": (initializers.constant, {}),
        "ones": (initializers.constant, {}),
        "constant": (initializers.constant, {"value": 0.0}),
    }
    if name not in defaults:
        raise w.error(f"{key}.name", f"unknown initializer {name!r}; use one of {list(defaults)}.")
    fn, params = defaults[name]
    params = dict(params)
    for arg, value in args.items():
        if arg not in params:
            raise w.error(
                f"{key}.{arg}",
                f"initializer {name!r} has no argument {arg!r} "
                f"(value {value!r}); its arguments are {list(params)}.",
            )
        value = _number(value)
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
        ):
            raise w.error(f"{key}.{arg}", f"must be a finite number, got {args[arg]!r}.")
        params[arg] = float(value)
    if name in ("zeros", "ones"):
        params = {"value": 0.0 if name == "zeros" else 1.0}
    if params.get("stddev") is not None and params["stddev"] <= 0:
        raise w.error(f"{key}.stddev", f"must be > 0, got {params['stddev']!r}.")
    if name == "uniform" and not params["minval"] < params["maxval"]:
        raise w.error(
            key, f"minval must be < maxval, got {params['minval']!r} and {params['maxval']!r}."
        )
    return fn(**params)
