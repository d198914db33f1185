"""Specs from YAML and TOML files: every field maps, every config in configs/ loads, and every
error names the file, the key and the value."""

import copy
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

import jax_tpu_embed as jte
from conftest import make_mesh

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"

BASE: dict[str, Any] = {
    "optimizer": {"name": "adagrad", "learning_rate": 0.05},
    "tables": {
        "users": {"vocabulary_size": 100, "dim": 8, "combiner": "sum"},
        "items": {"vocabulary_size": 50, "dim": 4},
    },
    "features": {
        "user": {"table": "users"},
        "ctx": {"item": "items", "hist": {"table": "items", "max_sequence_length": 3}},
    },
}


def _init(table: jte.TableConfig):
    """The table's initializer, which every table of these configs sets."""
    assert table.initializer is not None
    return table.initializer


def _write(tmp_path, data, name="spec.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data)
    return path


def _spec_files():
    """Every config in configs/ written in the spec format (a top-level `tables:` mapping or
    list; the benchmark workload files use `tables: <count>` and are not specs)."""
    out = []
    for path in sorted(CONFIGS.iterdir()):
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(path.read_text())
        elif path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(path.read_text())
        else:
            continue
        if isinstance(data, dict) and isinstance(data.get("tables"), (dict, list)):
            out.append(path)
    return out


def test_examples_are_found():
    names = {p.name for p in _spec_files()}
    assert {"example_small.yaml", "example_small.toml"} <= names


@pytest.mark.parametrize("path", _spec_files(), ids=lambda p: p.name)
def test_every_config_in_configs_loads(path):
    config = jte.load_config(path)
    assert isinstance(config.spec, jte.EmbeddingSpec)
    emb = jte.Embedding(config.spec, make_mesh(2))
    shapes = emb.abstract_state()  # Allocates nothing, even for huge tables.
    assert set(shapes.tables) == set(emb.stacks)
    stacked = [t for members in emb.stacks.values() for t in members]
    assert sorted(stacked) == sorted(config.spec.tables())


def test_yaml_and_toml_examples_describe_the_same_spec():
    a = jte.load_spec(CONFIGS / "example_small.yaml")
    b = jte.load_spec(CONFIGS / "example_small.toml")
    key = jax.random.key(3)
    for spec in (a, b):
        users, items = spec.tables()["users"], spec.tables()["items"]
        assert (users.vocabulary_size, users.dim, users.combiner, users.dtype) == (
            1000,
            16,
            "sum",
            jnp.dtype(jnp.float32),
        )
        assert (items.vocabulary_size, items.dim, items.combiner, items.dtype) == (
            5000,
            8,
            "mean",
            jnp.dtype(jnp.bfloat16),
        )
        assert isinstance(items.optimizer, jte.RowwiseAdagrad)
        assert items.optimizer.learning_rate == 0.1
        assert isinstance(spec.optimizer, jte.Adagrad)
        assert (spec.optimizer.learning_rate, spec.optimizer.initial_accumulator_value) == (
            0.05,
            0.1,
        )
        assert (spec.partition_strategy, spec.clipping_limit) == ("div", 10.0)
        feats = dict(spec.flat_features)
        assert sorted(feats) == ["context/item", "context/slate", "history", "user"]
        assert feats["history"].max_sequence_length == 20
        assert feats["context/slate"].output_shape == (4, 8)
        assert feats["context/item"].table is items and feats["user"].table is users
    for name in ("users", "items"):
        ta, tb = a.tables()[name], b.tables()[name]
        shape = (ta.vocabulary_size, ta.dim)
        np.testing.assert_array_equal(
            _init(ta)(key, shape, jnp.float32), _init(tb)(key, shape, jnp.float32)
        )
    u = np.asarray(_init(a.tables()["items"])(key, (5000, 8), jnp.float32))
    assert u.min() >= -0.01 and u.max() < 0.01 and u.std() > 0.004


def test_default_truncated_normal_is_the_table_default(tmp_path):
    data = copy.deepcopy(BASE)
    data["tables"]["users"]["initializer"] = "truncated_normal"
    data["tables"]["items"]["initializer"] = {
        "name": "truncated_normal",
        "stddev": 0.5,
        "mean": 1.0,
    }
    spec = jte.load_spec(_write(tmp_path, data))
    key = jax.random.key(0)
    # The default initializer, bit for bit: a row initializer that `init` draws in blocks.
    assert _init(spec.tables()["users"]) == jte.initializers.truncated_normal()
    np.testing.assert_array_equal(
        _init(spec.tables()["users"])(key, (100, 8)),
        jte.initializers.rows(key, jnp.arange(100), 8),
    )
    x = np.asarray(_init(spec.tables()["items"])(key, (50_000, 4)))
    assert abs(x.mean() - 1.0) < 0.01 and x.min() >= 0.0 and x.max() <= 2.0


@pytest.mark.parametrize(
    "init,check",
    [
        ("zeros", lambda x: not x.any()),
        ("ones", lambda x: (x == 1).all()),
        ({"name": "constant", "value": 0.25}, lambda x: (x == 0.25).all()),
        ({"name": "normal", "stddev": 2.0}, lambda x: 1.8 < x.std() < 2.2 and x.max() > 4),
        ({"name": "uniform", "minval": 1, "maxval": 3}, lambda x: x.min() >= 1 and x.max() < 3),
    ],
)
def test_initializers(tmp_path, init, check):
    data = copy.deepcopy(BASE)
    data["tables"]["users"]["initializer"] = init
    table = jte.load_spec(_write(tmp_path, data)).tables()["users"]
    assert check(np.asarray(_init(table)(jax.random.key(1), (200, 8), jnp.float32)))


def test_optimizers_schedules_and_yaml_number_quirks(tmp_path):
    data = copy.deepcopy(BASE)
    data["optimizer"] = {
        "name": "Adam",
        "learning_rate": "1e-3",
        "lazy_adam": False,
        "clipvalue": [-1, 2],
    }
    data["tables"]["users"]["optimizer"] = {
        "name": "ftrl",
        "learning_rate": {
            "schedule": "exponential_decay",
            "init_value": 0.1,
            "transition_steps": 10,
            "decay_rate": 0.5,
        },
    }
    data["tables"]["items"]["optimizer"] = "sgd"
    data["clipping_limit"] = "5e0"
    data["partition_strategy"] = "mod"
    data["pipeline_execution"] = True
    spec = jte.load_spec(_write(tmp_path, data))
    assert isinstance(spec.optimizer, jte.Adam)
    assert (spec.optimizer.learning_rate, spec.optimizer.lazy_adam, spec.optimizer.clipvalue) == (
        0.001,
        False,
        (-1, 2),
    )
    users_opt = spec.tables()["users"].optimizer
    assert isinstance(users_opt, jte.FTRL)
    want = optax.exponential_decay(0.1, 10, 0.5)
    assert float(users_opt.learning_rate(20)) == pytest.approx(float(np.asarray(want(20))))
    assert spec.tables()["items"].optimizer == spec.tables()["items"].optimizer
    assert isinstance(spec.tables()["items"].optimizer, jte.SGD)
    assert (spec.clipping_limit, spec.partition_strategy, spec.pipeline_execution) == (
        5.0,
        "mod",
        True,
    )


def test_table_list_form_and_extra_sections(tmp_path):
    text = """
        model: {hidden: [64, 32]}
        training: {batch_size: 128}
        optimizer: sgd
        tables:
          - {name: t, vocabulary_size: 10, dim: 2}
        features:
          f: t
    """
    config = jte.load_config(_write(tmp_path, text))
    assert config.extra == {"model": {"hidden": [64, 32]}, "training": {"batch_size": 128}}
    assert list(config.spec.tables()) == ["t"]
    assert config.path == str(tmp_path / "spec.yaml")


def test_placement(tmp_path):
    text = """
        optimizer: adagrad
        tables:
          big: {vocabulary_size: 1000, dim: 8, placement: host}
          small: {vocabulary_size: 10, dim: 8, placement: device}
          other: {vocabulary_size: 10, dim: 8}
          cached:
            vocabulary_size: 1000
            dim: 8
            placement: {host_cached: {cache_rows: 100, ways: 4}}
        features: {a: big, b: small, c: other, d: cached}
    """
    tables = jte.load_spec(_write(tmp_path, text)).tables()
    assert {n: t.placement for n, t in tables.items()} == {
        "big": "host",
        "small": "device",
        "other": "device",
        "cached": jte.HostCached(cache_rows=100, ways=4),
    }


def _mutate(path, value):
    def apply(data):
        node = data
        *parents, last = path
        for p in parents:
            node = node[p]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value
        return data

    return apply


_DELETE = object()


@pytest.mark.parametrize(
    "change,key,value",
    [
        (_mutate(["tables", "users", "dim"], -3), "tables.users.dim", "-3"),
        (
            _mutate(["tables", "users", "vocabulary_size"], "big"),
            "tables.users.vocabulary_size",
            "'big'",
        ),
        (_mutate(["tables", "users", "dim"], _DELETE), "tables.users", "'dim'"),
        (_mutate(["tables", "users", "combiner"], "max"), "tables.users.combiner", "'max'"),
        (_mutate(["tables", "users", "dtype"], "float16"), "tables.users.dtype", "'float16'"),
        (_mutate(["tables", "users", "colour"], "red"), "tables.users.colour", "'red'"),
        (_mutate(["tables", "users", "name"], "people"), "tables.users.name", "'people'"),
        (
            _mutate(["tables", "users", "initializer"], "glorot"),
            "tables.users.initializer.name",
            "'glorot'",
        ),
        (
            _mutate(["tables", "users", "initializer"], {"name": "normal", "sigma": 1}),
            "tables.users.initializer.sigma",
            "1",
        ),
        (
            _mutate(["tables", "users", "initializer"], {"name": "normal", "stddev": 0}),
            "tables.users.initializer.stddev",
            "got 0",
        ),
        (
            _mutate(["tables", "users", "optimizer"], {"name": "lion"}),
            "tables.users.optimizer.name",
            "'lion'",
        ),
        (_mutate(["optimizer", "momentum"], 0.9), "optimizer.momentum", "0.9"),
        (_mutate(["optimizer", "learning_rate"], -1.0), "optimizer", "-1.0"),
        (
            _mutate(["optimizer", "learning_rate"], {"schedule": "warp_drive"}),
            "optimizer.learning_rate.schedule",
            "'warp_drive'",
        ),
        (_mutate(["features", "user", "table"], "people"), "features.user.table", "'people'"),
        (
            _mutate(["features", "user", "max_sequence_length"], -2),
            "features.user.max_sequence_length",
            "-2",
        ),
        (
            _mutate(["features", "user", "output_shape"], [0, 4]),
            "features.user.output_shape",
            "[0, 4]",
        ),
        (_mutate(["features", "user", "pooling"], "max"), "features.user.pooling", "'max'"),
        (_mutate(["features", "ctx", "item"], 7), "features.ctx.item", "7"),
        (_mutate(["features", "user"], "items"), "tables.users", "'users'"),  # Unused table.
        (_mutate(["partition_strategy"], "hash"), "partition_strategy", "'hash'"),
        (_mutate(["clipping_limit"], 0), "clipping_limit", "0"),
        (_mutate(["pipeline_execution"], "yes"), "pipeline_execution", "'yes'"),
        (
            _mutate(["tables", "users", "stochastic_rounding"], "yes"),
            "tables.users.stochastic_rounding",
            "'yes'",
        ),
        (_mutate(["tables", "users", "stochastic_rounding"], True), "tables.users", "float32"),
        (_mutate(["optimizer"], {"name": "rmsprop", "rho": 2.0}), "optimizer", "rho must be <= 1"),
        (_mutate(["partition_stratgy"], "div"), "partition_stratgy", "'partition_strategy'"),
        (_mutate(["optimizer"], _DELETE), "optimizer", "None"),
        (_mutate(["tables"], 8), "tables", "8"),
        (_mutate(["tables", "users", "placement"], "hbm"), "tables.users.placement", "'hbm'"),
        (
            _mutate(["tables", "users", "placement"], {"host_cached": {"rows": 5}}),
            "tables.users.placement.host_cached",
            "{'rows': 5}",
        ),
        (
            _mutate(["tables", "users", "placement"], {"host_cached": {"cache_rows": 0}}),
            "tables.users.placement.host_cached",
            "cache_rows must be an int > 0, got 0",
        ),
        (
            _mutate(["tables", "users", "placement"], {"host_cached": {"cache_rows": 10**9}}),
            "tables.users",
            "is not smaller than the table's",
        ),
    ],
)
def test_errors_name_file_key_and_value(tmp_path, change, key, value):
    path = _write(tmp_path, change(copy.deepcopy(BASE)))
    with pytest.raises(ValueError) as info:
        jte.load_spec(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {key}:"), message
    assert value in message, message


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        jte.load_spec(tmp_path / "missing.yaml")
    bad_ext = tmp_path / "spec.json"
    bad_ext.write_text("{}")
    with pytest.raises(ValueError, match=r"spec.json: unknown config file type '.json'"):
        jte.load_spec(bad_ext)
    broken = _write(tmp_path, "tables: {a: [1, 2\n", "broken.yaml")
    with pytest.raises(ValueError, match=r"(?s)broken.yaml: cannot parse the file.*line 1"):
        jte.load_spec(broken)
    bad_toml = _write(tmp_path, "tables = [\n", "broken.toml")
    with pytest.raises(ValueError, match=r"broken.toml: cannot parse the file"):
        jte.load_spec(bad_toml)
    scalar = _write(tmp_path, "42\n", "scalar.yaml")
    with pytest.raises(ValueError, match=r"scalar.yaml: the top level must be a mapping"):
        jte.load_spec(scalar)


def test_bf16_rounding_and_the_new_optimizers(tmp_path):
    data = copy.deepcopy(BASE)
    data["tables"]["users"].update(dtype="bfloat16", stochastic_rounding=False)
    data["tables"]["items"].update(dtype="bfloat16")
    data["optimizer"] = {"name": "rmsprop", "learning_rate": 0.1, "centered": True}
    data["tables"]["users"]["optimizer"] = {"name": "ProximalAdagrad", "learning_rate": 0.1}
    data["tables"]["items"]["optimizer"] = {"name": "momentum", "use_nesterov": True}
    spec = jte.load_spec(_write(tmp_path, data))
    users, items = spec.tables()["users"], spec.tables()["items"]
    assert (users.stochastic_rounding, items.stochastic_rounding) == (False, True)
    assert isinstance(spec.optimizer, jte.RMSProp) and spec.optimizer.centered
    assert isinstance(users.optimizer, jte.ProximalAdagrad)
    assert isinstance(items.optimizer, jte.Momentum) and items.optimizer.use_nesterov
