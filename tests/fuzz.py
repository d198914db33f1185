"""A differential fuzzer of feature combinations (`tests/test_fuzz.py` replays some cases).

Each case draws a spec (1-3 tables: static or dynamic, in device memory, in host memory or
`HostCached`, initialized by the default or another initializer; one-hot, multi-hot,
weighted and sequence features; most optimizers, with overrides, schedules, clipping,
weight decay and gradient multipliers), options (routing,
stacking, TPU layouts, round limits, backends) and a training loop (`accumulate_steps`,
`pipeline_execution`, prefetch by `next_batch`, NumPy or global `jax.Array` inputs, a run
with `jax_enable_x64` on and int64 ids), trains
it a few steps through one of the front ends (`jte.make_train_step`, a flax.linen model around
`jte.flax.Embed` or a flax.nnx model around `jte.nnx.Embed`, the same dense model in each) and
compares everything it can read with an oracle, which trains through `jte.make_train_step`
and must give the same results:

- ``placement``: the same spec on the same mesh with every table in device memory. Static
  tables in host memory must be bit-identical (the README's promise) unless the run stages
  their rows (`stage_host_rows`, drawn for every oracle); otherwise 1e-4
  (relative; 1e-5 absolute): XLA:CPU contracts a multiply and an add into one rounding in
  some programs and not in others. Adam at a large learning rate made that a few 1e-7
  apart; RMSProp with momentum, over five steps of a model whose gradients depend on the
  rows, 1.6e-6 on values of 0.03 (both match bit for bit with
  `--xla_backend_optimization_level=0`, which contracts nothing).
- ``mesh``: the same spec on one device, every table in device memory. Resident ids and
  every counter must be equal; rows, slots and losses to 1e-4, since sums run in
  another order on another mesh.
- ``paths``: the same spec on the same devices by the plainest path: every table in device
  memory, "div", a `jax.sharding.Mesh`, the XLA backend, the all-gather exchange, no
  stacking, no TPU layout, no round limits, NumPy inputs, no prefetch, and one step on the
  concatenated batch where the run accumulates k micro-batches (its loss k times the mean:
  the README's sum of the k losses). What the run's options change must not change a
  result (the mesh oracle keeps them on both sides, so it cannot see a fault they share):
  resident ids and counters equal, floats as for ``mesh``.
- ``processes``: the run on 2 processes of 4 CPU devices each (JAX's multi-controller
  runtime over loopback, gloo collectives; `tests/_multihost_worker.py`), each feeding its
  own rows of every batch; the oracle the same spec in this process on 8 devices. Resident
  ids and counters equal, floats to 1e-5; the run's checkpoints (written by both
  processes, shard by shard) restore on both sides bit for bit.

Both sides also check what holds by construction: one trace of the train step, host tables
in host memory, and the dynamic tables' counters adding up. Then the run's final state,
saved on top of a save after its second step (incremental for dynamic tables) and restored
into the oracle's embedding (and into one of twice the capacity), must give back its rows,
slots and counters bit for bit, and one more step of each (the run from its state, the
oracle from the restored one) must agree as the steps before did; a `jte.serving.Server` of
the run's tables must read what the run's lookup reads. A case is ``ok``, ``mismatch`` (with
a report), ``error`` (with the stage and traceback) or ``rejected`` (the library refused the
configuration at construction; the error is recorded).

Usage (one JSON line per case; ``--case`` runs one case and prints its configuration):

    python tests/fuzz.py --oracle mesh --seed 3 --budget 600 --out fuzz.jsonl
    python tests/fuzz.py --oracle placement --seed 3 --case 17
"""

from __future__ import annotations

# isort: off
import conftest  # The tests' environment (8 CPU devices), set up before jax is imported.

# isort: on
import argparse
import dataclasses
import faulthandler
import json
import os
import shutil
import tempfile
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_tpu_embed as jte

ORACLES = ("placement", "mesh", "processes", "paths")
FRONTS = ("core", "linen", "nnx")  # The run's front end; the oracle's is "core".
OPTIMIZERS = (
    "sgd",
    "adagrad",
    "adam",
    "ftrl",
    "rowwise_adagrad",
    "adagrad_momentum",
    "momentum",
    "momentum_nesterov",
    "rmsprop",
    "rmsprop_centered",
    "proximal_adagrad",
    "optax_adam",
    "optax_adamw_clipped",
    "optax_lion",
    "optax_rmsprop",
    "optax_nesterov",
    "custom_momentum",
    "custom_rowwise",
)
Config = dict[str, Any]


# ------------------------------------------------------------------------- configurations


def draw(seed: int, case: int, oracle: str, front: str | None = None) -> Config:
    """Case `case` of `seed` for `oracle`: a JSON-able configuration, the same on every run.
    The run's front end is drawn from a stream of its own (the rest of a case does not
    depend on it), unless `front` names it."""
    if oracle not in ORACLES:
        raise ValueError(f"oracle must be one of {ORACLES}, got {oracle!r}")
    if front is None and oracle == "processes":
        front = "core"  # The flax and NNX steps are not run on several processes here.
    elif front is None:
        fronts = np.random.default_rng([seed, case, ORACLES.index(oracle), 1])
        front = FRONTS[int(fronts.choice(len(FRONTS), p=[0.5, 0.25, 0.25]))]
    elif front not in FRONTS:
        raise ValueError(f"front must be one of {FRONTS}, got {front!r}")
    r = np.random.default_rng([seed, case, ORACLES.index(oracle)])
    pick = lambda options, p=None: options[int(r.choice(len(options), p=p))]
    n = (
        8
        if oracle == "processes"
        else int(pick([1, 2, 4, 8] if oracle == "placement" else [2, 4, 8]))
    )
    c: Config = {
        "oracle": oracle,
        "front": front,
        "n": n,
        "mesh": pick(["explicit", "auto"]),  # conftest.make_mesh's kinds
        "routing": pick(["gather", "owner"], [0.4, 0.6]),
        "strategy": pick(["div", "mod"]),
        "backend": pick(["xla", "cpu", "pallas_interpret"], [0.7, 0.15, 0.15]),
        "tpu_layout": bool(r.random() < 0.25),
        "stacking": bool(r.random() < 0.8),
        "accumulate_steps": int(pick([1, 2])),
        "pipeline": bool(r.random() < 0.3),
        "prefetch": bool(r.random() < 0.6),
        "input": pick(["numpy", "jax"]),
        "dense": pick(["sgd", "adam"]),
        "steps": int(pick([3, 4, 5])),
        "per_device": int(pick([1, 2, 3], [0.5, 0.3, 0.2])),  # examples a micro-batch
        "clipping_limit": pick([None, 0.5, 2.0]),
        "gradient_multiplier": bool(r.random() < 0.3),
        "invalid_ids": bool(r.random() < 0.15),
        "optimizer": _optimizer(r),
        "max_ids_per_shard": pick([None, 1, 2, 3, 5, 8, 16], [0.55] + [0.075] * 6),
        "max_unique_ids_per_shard": None,
        "data_seed": int(r.integers(2**31)),
    }
    if c["backend"] == "cpu" and (c["routing"] == "owner" or c["tpu_layout"]):
        c["backend"] = "xla"  # The C++ kernels serve the all-gather exchange alone.
    if c["max_ids_per_shard"] and r.random() < 0.4:
        c["max_unique_ids_per_shard"] = pick([1, 2, 4, 8])
    plain = not (c["tpu_layout"] or c["max_ids_per_shard"]) and c["backend"] == "xla"
    if oracle == "paths" and plain and c["routing"] == "gather":
        c["routing"] = "owner"  # Something for the oracle to differ in.
    shared = _optimizer(r) if r.random() < 0.3 else None
    tables = []
    for t in range(int(pick([1, 2, 3], [0.4, 0.4, 0.2]))):
        tables.append(_table(r, pick, f"t{t}", n, shared, oracle))
    if oracle == "placement" and all(t["placement"] == "device" for t in tables):
        tables[0]["placement"] = "host"  # Something for the oracle to differ in.
    c["tables"] = tables
    # A stream of its own, so that the rest of a case is as before it was drawn: whether
    # the run stages its "host" tables' rows (`Embedding.stage`, the TPU default), which
    # CPU meshes do only when asked.
    stages = np.random.default_rng([seed, case, ORACLES.index(oracle), 2])
    c["stage_host_rows"] = bool(stages.random() < 0.5)
    # And the tables' initializers, from a third stream for the same reason.
    inits = np.random.default_rng([seed, case, ORACLES.index(oracle), 3])
    for t in tables:
        t["initializer"] = _initializer(inits, t["dynamic"])
    # And a fourth: whether the run has jax_enable_x64 on (its dynamic ids fed as int64,
    # not SplitIds); the oracle never has. One process only.
    wide = np.random.default_rng([seed, case, ORACLES.index(oracle), 4])
    c["x64"] = oracle != "processes" and bool(wide.random() < 0.25)
    if c["x64"]:  # Then SGD for the dense side: optax.adam rounds otherwise under x64, and
        c["dense"] = "sgd"  # the drift reached a table's momenta (placement seed 47, case 7).
    return c


def _initializer(r, dynamic: bool) -> Config | None:
    """A table's initializer: None (the default) mostly; else one of `jte.initializers`,
    or for a static table an initializer called with the whole table's shape."""
    u = r.random()
    if u < 0.6:
        return None
    if u < 0.7 and not dynamic:
        return {"kind": "whole", "stddev": float(r.choice([0.1, 0.5]))}
    kind = str(r.choice(["truncated_normal", "normal", "uniform", "constant", "ones"]))
    if kind in ("truncated_normal", "normal"):
        return {
            "kind": kind,
            "stddev": float(r.choice([0.05, 0.5])),
            "mean": float(r.choice([0.0, 0.3])),
        }
    if kind == "uniform":
        low = float(r.choice([-0.5, 0.0, 1.0]))
        return {"kind": kind, "minval": low, "maxval": low + float(r.choice([0.1, 1.0]))}
    if kind == "constant":
        return {"kind": kind, "value": float(r.choice([-0.2, 0.7]))}
    return {"kind": kind}


def initializer(i: Config | None):
    """The initializer object of a configuration (None: the table's default)."""
    if i is None:
        return None
    kind, args = i["kind"], {k: v for k, v in i.items() if k != "kind"}
    if kind == "whole":  # Drawn with the whole table's shape, by jax.random.
        return jax.nn.initializers.normal(args["stddev"])
    return getattr(jte.initializers, kind)(**args)


def _table(r, pick, name: str, n: int, shared, oracle: str) -> Config:
    # Against the same mesh, bf16 rows; against one device none: float32 sums that differ in
    # their last bit there round to rows a bf16 unit apart, which the loss spreads to every
    # table. And more tables in device memory, where the C++ and Pallas kernels serve.
    same_mesh = oracle == "placement"
    t: Config = {
        "name": name,
        "dim": int(pick([4, 8, 12, 16, 24, 32, 64, 100, 128])),
        "combiner": pick(["sum", "mean", "sqrtn"]),
        "bf16": same_mesh and bool(r.random() < 0.08),
        "dynamic": bool(r.random() < 0.5),
        "placement": pick(
            ["device", "host", "cached"], [0.2, 0.2, 0.6] if same_mesh else [0.4, 0.15, 0.45]
        ),
        "optimizer": None,
    }
    if r.random() < 0.35:
        t["optimizer"] = shared if shared is not None and r.random() < 0.6 else _optimizer(r)
    if t["dynamic"]:
        b = int(pick([4, 8, 16, 64], [0.3, 0.3, 0.25, 0.15]))
        # A multiple of b slots a shard (2b for b = 64) holds the same ids on every mesh.
        unit = b * n * (2 if b == 64 else 1)
        t.update(
            bucket_size=b,
            capacity=unit * int(pick([1, 2, 3])),
            eviction=pick(["lru", "lfu", "none"], [0.45, 0.45, 0.1]),
            ttl_steps=int(pick([1, 2, 3])) if r.random() < 0.3 else None,
            min_count=2 if r.random() < 0.3 else 1,
            admit_probability=float(pick([0.5, 0.8])) if r.random() < 0.25 else 1.0,
        )
        t["pool"] = int(r.integers(8, max(10, int(t["capacity"] * 1.5))))
        rows = t["capacity"]
    else:
        t["vocabulary"] = int(r.integers(16, 300))
        t["id_range"] = int(pick([t["vocabulary"], max(4, t["vocabulary"] // 4)]))
        rows = t["vocabulary"]
    if t["placement"] == "cached":
        ways = int(pick([1, 2, 3, 5, 7, 12, 16]))
        while ways > 1 and ways * n > rows - 1:
            ways -= 1
        size = pick(["tiny", "small", "mid", "big"], [0.3, 0.3, 0.2, 0.2])
        cache = {"tiny": ways * n, "small": rows // 8, "mid": rows // 2, "big": rows - 1}[size]
        t.update(
            cache_rows=int(min(max(cache, ways * n), rows - 1)),
            ways=ways,
            max_misses=None,
            cache_prefetch=bool(r.random() < 0.85),
        )
        if t["cache_rows"] < ways * n:  # A table too small to cache on this mesh.
            t["placement"] = "host"
        elif r.random() < 0.6:  # At most the rows a device caches.
            t["max_misses"] = int(pick([m for m in (1, 2, 3, 5, 8) if m <= t["cache_rows"] // n]))
    features = []
    for f in range(int(pick([1, 2]))):
        kind = pick(["onehot", "multi", "weighted", "sequence"])
        feature = {"name": f"{name}f{f}", "kind": kind, "length": int(r.integers(1, 6))}
        if kind == "sequence":
            feature["max_sequence_length"] = int(r.integers(1, 5))
        features.append(feature)
    t["features"] = features
    return t


def _optimizer(r) -> Config:
    pick = lambda options: options[int(r.choice(len(options)))]
    name = pick(OPTIMIZERS)
    o: Config = {"name": name, "lr": pick([0.01, 0.05, 0.2])}
    o["schedule"] = bool(r.random() < 0.35)
    if not name.startswith(("optax", "custom")):
        if r.random() < 0.4:
            o["weight_decay"] = pick([0.01, 0.1])
            o["weight_decay_by_lr"] = bool(r.random() < 0.5)
        if r.random() < 0.3:
            o["clipvalue"] = pick([0.05, 0.5])
        if r.random() < 0.2:
            o["clip_weight"] = [-0.3, 0.3]
    return o


# ------------------------------------------------------------------------- building


def optimizer(o: Config | None):
    """The optimizer object of a configuration (None: the spec's)."""
    if o is None:
        return None
    name, lr = o["name"], o["lr"]
    if o["schedule"]:
        lr = lambda step, lr=lr: lr * (1.0 + 0.5 * jnp.sin(jnp.asarray(step, jnp.float32) + 1.0))
    extras = {}
    if "weight_decay" in o:
        extras["weight_decay_factor"] = o["weight_decay"]
        extras["multiply_weight_decay_factor_by_learning_rate"] = o["weight_decay_by_lr"]
    if "clipvalue" in o:
        extras["clipvalue"] = o["clipvalue"]
    if "clip_weight" in o:
        extras["clip_weight_min"], extras["clip_weight_max"] = o["clip_weight"]
    l1l2 = dict(l1_regularization_strength=0.01, l2_regularization_strength=0.02)
    plain = {
        "sgd": lambda: jte.SGD(learning_rate=lr, **extras),
        "adagrad": lambda: jte.Adagrad(learning_rate=lr, **extras),
        "adam": lambda: jte.Adam(learning_rate=lr, epsilon=1e-3, **extras),
        "ftrl": lambda: jte.FTRL(learning_rate=lr, **l1l2, **extras),
        "rowwise_adagrad": lambda: jte.RowwiseAdagrad(learning_rate=lr, **extras),
        # Its accumulators start at 0, so a row's first step is g / sqrt(g² + epsilon): at the
        # default 1e-10 a gradient near 1e-5 turns float32 rounding into a 1e-3 change of
        # the momentum on another mesh (docs/design.md, the fuzzer). Conditioned here, as
        # are Adam's and RMSProp's epsilons, for the same first step.
        "adagrad_momentum": lambda: jte.AdagradMomentum(
            learning_rate=lr, momentum=0.9, epsilon=1e-3, **extras
        ),
        "momentum": lambda: jte.Momentum(learning_rate=lr, momentum=0.9, **extras),
        "momentum_nesterov": lambda: jte.Momentum(
            learning_rate=lr, momentum=0.8, use_nesterov=True, **extras
        ),
        "rmsprop": lambda: jte.RMSProp(
            learning_rate=lr, rho=0.9, momentum=0.5, epsilon=1e-3, **extras
        ),
        "rmsprop_centered": lambda: jte.RMSProp(
            learning_rate=lr, rho=0.8, epsilon=1e-3, centered=True, **extras
        ),
        "proximal_adagrad": lambda: jte.ProximalAdagrad(learning_rate=lr, **l1l2, **extras),
    }
    if name in plain:
        return plain[name]()
    rate = optax.schedules.exponential_decay(o["lr"], 2, 0.5) if o["schedule"] else o["lr"]
    if name == "optax_adam":
        return jte.FromOptax(optax.adam(rate, eps=1e-3))
    if name == "optax_adamw_clipped":
        return jte.FromOptax(
            optax.chain(optax.clip(0.5), optax.adamw(rate, eps=1e-3, weight_decay=1e-2))
        )
    if name == "optax_lion":
        return jte.FromOptax(optax.lion(rate))
    if name == "optax_rmsprop":
        return jte.FromOptax(optax.rmsprop(rate, eps=1e-3, momentum=0.5))
    if name == "optax_nesterov":
        return jte.FromOptax(optax.sgd(rate, momentum=0.9, nesterov=True))
    if name == "custom_momentum":

        def momentum(g, row, slots, learning_rate, hyperparameters):
            (v,), (beta,) = slots, hyperparameters
            v = beta * v + g
            return row - learning_rate * v, v

        return jte.CustomOptimizer(
            momentum,
            learning_rate=lr,
            slot_names=["velocity"],
            slot_initializers=[0.0],
            hyperparameters=[0.9],
        )
    if name == "custom_rowwise":

        def rowwise(g, row, slots, learning_rate, hyperparameters):
            (acc, m), (eps,) = slots, hyperparameters
            acc = acc + jnp.mean(g * g)
            m = 0.5 * m + g
            return row - learning_rate * m / jnp.sqrt(acc + eps), acc, m

        eps = (lambda step: 1e-3 + 1e-4 * jnp.asarray(step, jnp.float32)) if o["schedule"] else 1e-3
        return jte.CustomOptimizer(
            rowwise,
            learning_rate=lr,
            slot_names=["acc", "m"],
            slot_initializers=[0.1, 0.0],
            hyperparameters=[eps],
            slot_dims=[1, 2],
        )
    raise ValueError(f"unknown optimizer {name!r}")


def spec(c: Config, oracle: bool, grow: int = 1) -> jte.EmbeddingSpec:
    """The spec of `c`; the oracle's keeps every table in device memory; `grow` multiplies
    the dynamic tables' capacities."""
    features, overrides = {}, {}
    for t in c["tables"]:
        override = None
        if t["optimizer"] is not None:  # One object for equal overrides: they may stack.
            key = json.dumps(t["optimizer"], sort_keys=True)
            override = overrides.setdefault(key, optimizer(t["optimizer"]))
        placement: str | jte.HostCached = t["placement"]
        if oracle or placement == "device":
            placement = "device"
        elif placement == "cached":
            placement = jte.HostCached(
                cache_rows=t["cache_rows"],
                ways=t["ways"],
                max_misses=t["max_misses"],
                prefetch=t["cache_prefetch"],
            )
        kwargs: dict[str, Any] = dict(
            dim=t["dim"],
            combiner=t["combiner"],
            name=t["name"],
            optimizer=override,
            placement=placement,
            dtype=jnp.bfloat16 if t["bf16"] else jnp.float32,
        )
        if t["initializer"] is not None:
            kwargs["initializer"] = initializer(t["initializer"])
        if t["dynamic"]:
            kwargs["dynamic"] = jte.DynamicTable(
                capacity=t["capacity"] * grow,
                bucket_size=t["bucket_size"],
                eviction=t["eviction"],
                ttl_steps=t["ttl_steps"],
                min_count=t["min_count"],
                admit_probability=t["admit_probability"],
            )
        else:
            kwargs["vocabulary_size"] = t["vocabulary"]
        table = jte.TableConfig(**kwargs)
        for f in t["features"]:
            features[f["name"]] = jte.FeatureConfig(
                table, max_sequence_length=f.get("max_sequence_length", 0)
            )
    multiplier = None
    if c["gradient_multiplier"]:
        multiplier = lambda step: 1.0 / (1.0 + 0.3 * jnp.asarray(step, jnp.float32))
    return jte.EmbeddingSpec(
        features,
        optimizer(c["optimizer"]),
        partition_strategy=c["strategy"],
        clipping_limit=c["clipping_limit"],
        gradient_multiplier_fn=multiplier,
        pipeline_execution=c["pipeline"],
    )


def plainest(c: Config) -> Config:
    """`c` by the plainest path: the paths oracle's configuration (its tables in device
    memory, as every oracle's). Where `c` accumulates k micro-batches this takes one batch,
    its loss k times a micro-batch's mean (`run` joins the batches)."""
    return dict(
        c,
        strategy="div",
        mesh="auto",
        backend="xla",
        routing="gather",
        stacking=False,
        tpu_layout=False,
        max_ids_per_shard=None,
        max_unique_ids_per_shard=None,
        input="numpy",
        prefetch=False,
        accumulate_steps=1,
    )


def embedding(c: Config, oracle: bool, grow: int = 1) -> jte.Embedding:
    if oracle and c["oracle"] == "paths":
        c = plainest(c)
    n = 1 if oracle and c["oracle"] == "mesh" else c["n"]
    # The C++ and Pallas kernels serve tables in device memory; the oracle takes the run's
    # backends.
    backends = {
        t["name"]: c["backend"] if t["placement"] == "device" else "xla" for t in c["tables"]
    }
    options: dict[str, Any] = dict(
        backend=backends,
        routing=c["routing"],
        stacking=c["stacking"],
        max_ids_per_shard=c["max_ids_per_shard"],
        max_unique_ids_per_shard=c["max_unique_ids_per_shard"],
        stage_host_rows=c.get("stage_host_rows") or None,  # Configurations from before it.
    )
    if c["tpu_layout"]:
        options.update(tpu_layout=True, lane_width=128)
    return jte.Embedding(spec(c, oracle, grow), conftest.make_mesh(n, c["mesh"]), **options)


# ------------------------------------------------------------------------- data and model


def pools(c: Config, r) -> dict[str, np.ndarray]:
    """Each dynamic table's ids: int64 over the whole range, and small ones too."""
    out = {}
    for t in c["tables"]:
        if t["dynamic"]:
            pool = r.integers(-(2**63), 2**63 - 1, size=t["pool"], dtype=np.int64)
            pool[: len(pool) // 3] = r.integers(0, 1000, size=len(pool) // 3)
            out[t["name"]] = np.unique(pool[pool != -1])
    return out


def batch(c: Config, r, pool: dict[str, np.ndarray], novel: bool = False) -> dict:
    """One global batch of NumPy arrays; `novel`: ids the steps before have not seen (as far
    as a draw can tell), for the last step's `next_batch`."""
    k = c["accumulate_steps"]
    lead = (k,) if k > 1 else ()
    examples = c["n"] * c["per_device"]
    features = {}
    for t in c["tables"]:
        for f in t["features"]:
            shape = lead + (examples,) + (() if f["kind"] == "onehot" else (f["length"],))
            if t["dynamic"]:
                ids = (
                    r.integers(-(2**62), 2**62, size=shape, dtype=np.int64)
                    if novel
                    else r.choice(pool[t["name"]], size=shape)
                )
            else:
                top = t["vocabulary"] if novel else t["id_range"]
                ids = r.integers(0, top, size=shape).astype(np.int32)
            ids = np.where(r.random(shape) < 0.25, -1, ids).astype(ids.dtype)
            if c["invalid_ids"] and not t["dynamic"] and ids.size > 2 and r.random() < 0.5:
                ids.reshape(-1)[r.integers(0, ids.size)] = t["vocabulary"] + 3
            leaf = jte.split_ids(ids) if t["dynamic"] else ids
            if f["kind"] == "weighted":
                leaf = jte.Weighted(leaf, r.uniform(0.2, 2.0, shape).astype(np.float32))
            features[f["name"]] = leaf
    return {"features": features, "y": r.normal(size=lead + (examples,)).astype(np.float32)}


def on_mesh(c: Config, tree, mesh_: jax.sharding.Mesh, rows=None):
    """`tree` as global jax.Arrays sharded over the examples; with `rows` (this process's
    rows of the batch, `multihost.process_batch_rows`) each process gives only its own."""
    micro = c["accumulate_steps"] > 1
    axis = mesh_.axis_names[0]
    sharding = NamedSharding(mesh_, P(None, axis) if micro else P(axis))
    if rows is None:
        return jax.tree.map(lambda x: jax.device_put(np.asarray(x), sharding), tree)
    local = lambda x: np.asarray(x)[:, rows] if micro else np.asarray(x)[rows]
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, local(x)), tree)


def widened(batch_: dict) -> dict:
    """A batch with its dynamic tables' `SplitIds` as the int64 ids they split."""
    split = lambda x: isinstance(x, jte.SplitIds)
    return jax.tree.map(lambda x: jte.join_ids(x) if split(x) else x, batch_, is_leaf=split)


def joined(batch_: dict) -> dict:
    """A batch of k micro-batches as one batch of their examples, in order."""
    return jax.tree.map(lambda x: np.asarray(x).reshape((-1,) + np.shape(x)[2:]), batch_)


def widths(c: Config) -> dict[str, int]:
    return {
        f["name"]: t["dim"] * f.get("max_sequence_length", 1)
        for t in c["tables"]
        for f in t["features"]
    }


def outputs(params, activations):
    """The dense model: (a prediction per example, a penalty on the activations)."""
    total = 0.0
    for name in sorted(params):
        a = activations[name]
        total = total + jnp.tanh(a.reshape(a.shape[0], -1)) @ params[name]
    penalty = sum(jnp.mean(activations[name] ** 2) for name in sorted(params))
    return total, penalty


def objective(out, batch_):
    total, penalty = out
    return jnp.mean((total - batch_["y"]) ** 2) + 0.01 * penalty


def loss(params, activations, batch_):
    return objective(outputs(params, activations), batch_)


class _Linen(nn.Module):
    embed: jte.flax.Embed
    widths: tuple  # ((feature, width), ...)

    @nn.compact
    def __call__(self, batch_):
        acts = self.embed(batch_["features"])
        # float32 as `dense_params`, also under x64 (where flax's default is float64).
        zeros = nn.initializers.zeros
        params = {name: self.param(name, zeros, (w,), jnp.float32) for name, w in self.widths}
        return outputs(params, acts)


class _Nnx(nnx.Module):
    def __init__(self, emb: jte.Embedding, params: dict):
        self.embed = jte.nnx.Embed.from_embedding(emb, rngs=nnx.Rngs(0))
        self.names = tuple(sorted(params))
        for name in self.names:
            setattr(self, f"w_{name}", nnx.Param(jnp.array(params[name])))

    def params(self) -> dict:
        return {name: getattr(self, f"w_{name}")[...] for name in self.names}

    def __call__(self, batch_):
        return outputs(self.params(), self.embed(batch_["features"]))


class Loop:
    """One side's training through a front end (`FRONTS`), from the same dense parameters
    and tables whatever the front: `step(batch, next_batch) -> metrics`, `flush()`, and the
    state read the same way for each (`embedding`, `params`, `step_count`)."""

    def __init__(
        self,
        c: Config,
        emb: jte.Embedding,
        front: str,
        params: dict,
        first,
        scale: int = 1,
        x64: bool = False,
    ):
        """`scale` multiplies the loss (the core front end's); `x64`: every call of the
        loop runs with jax_enable_x64 on."""
        self.x64 = x64
        with jax.enable_x64(x64):
            self._build(c, emb, front, params, first, scale)

    def _build(self, c: Config, emb: jte.Embedding, front: str, params: dict, first, scale):
        self.front, self.emb = front, emb
        self.prefetch = c["prefetch"]  # Whether each step is given the next batch.
        tx = {"sgd": optax.sgd(0.05), "adam": optax.adam(0.01)}[c["dense"]]
        k = c["accumulate_steps"]
        tables = emb.init(jax.random.key(0))
        self.model: Any = None
        self.state: Any = None  # A TrainState; the nnx step keeps its own.
        if front == "core":
            scaled = loss if scale == 1 else lambda p, a, b: scale * loss(p, a, b)
            self.step: Any = jte.make_train_step(emb, scaled, tx, accumulate_steps=k)
            self.state = self.step.init(None, params, first, embedding_state=tables)
        elif front == "linen":
            widths_ = tuple(sorted((name, p.shape[0]) for name, p in params.items()))
            model = _Linen(jte.flax.Embed.from_embedding(emb), widths_)
            self.step = jte.flax.make_train_step(model, objective, tx, accumulate_steps=k)
            self.state = self.step.init(
                jax.random.key(1), first, params=params, embedding_state=tables
            )
        else:
            self.model = _Nnx(emb, params)
            self.step = jte.nnx.make_train_step(
                self.model, lambda m, b: objective(m(b), b), tx, accumulate_steps=k
            )
            self.step.init(embedding_state=tables)

    def __call__(self, batch_, next_batch=None) -> dict:
        with jax.enable_x64(self.x64):
            if self.front == "nnx":
                return self.step(batch_, next_batch=next_batch)
            self.state, metrics = self.step(self.state, batch_, next_batch=next_batch)
            return metrics

    def flush(self) -> None:
        with jax.enable_x64(self.x64):
            if self.front == "nnx":
                self.step.flush()
            else:
                self.state = self.step.flush(self.state)

    @property
    def embedding(self) -> jte.EmbeddingState:
        if self.front == "core":
            return self.state.embedding
        if self.front == "linen":
            (state,) = jte.flax.embedding_states(self.state.embedding).values()
            return state
        return self.model.embed.embedding_state

    @property
    def params(self) -> dict:
        return self.model.params() if self.front == "nnx" else self.state.params

    @property
    def step_count(self) -> int:
        return int((self.step.state if self.front == "nnx" else self.state).step)

    def resume(self, tables: jte.EmbeddingState) -> None:
        """Continues from `tables` (restored), the rest of the state as it is (core only)."""
        assert self.front == "core"
        self.state = dataclasses.replace(self.state, embedding=tables)


def distinct_ids(c: Config, batches: list[dict]) -> dict[str, int]:
    """Each dynamic table's distinct ids per update, summed over the steps: its hits and
    misses must add up to this."""
    out = {}
    for t in c["tables"]:
        if not t["dynamic"]:
            continue
        total = 0
        for b in batches:
            seen = set()
            for f in t["features"]:
                leaf = b["features"][f["name"]]
                ids = np.asarray(jte.join_ids(leaf.ids if isinstance(leaf, jte.Weighted) else leaf))
                if f["kind"] == "sequence":
                    ids = ids[..., : f["max_sequence_length"]]
                seen |= set(ids.ravel().tolist())
            seen.discard(-1)
            total += len(seen)
        out[t["name"]] = total
    return out


# ------------------------------------------------------------------------- comparing


class Report:
    """What differs between the run and its oracle, one line each."""

    def __init__(self, exact: bool, rtol: float, atol: float):
        self.exact, self.rtol, self.atol = exact, rtol, atol
        self.lines: list[str] = []

    def floats(self, what: str, got, want) -> None:
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        if got.shape != want.shape:
            self.lines.append(f"{what}: shape {got.shape}, oracle {want.shape}")
            return
        if not np.array_equal(np.isfinite(got), np.isfinite(want)):
            self.lines.append(f"{what}: finite in other places")
            return
        if self.exact:
            bad = ~((got == want) | (np.isnan(got) & np.isnan(want)))
        else:
            bad = np.abs(got - want) > self.atol + self.rtol * np.abs(want)
        if bad.any():
            diff = np.abs(got - want)[bad]
            self.lines.append(
                f"{what}: {int(bad.sum())} of {bad.size} differ"
                f"{'' if self.exact else ' beyond tolerance'}, by up to {diff.max():.3g}"
            )

    def equal(self, what: str, got, want) -> None:
        if got != want:
            self.lines.append(f"{what}: {got}, oracle {want}")

    def tree(self, what: str, got, want) -> None:
        if isinstance(want, jte.DynamicRows):
            a, b = np.asarray(got.ids), np.asarray(want.ids)
            if not np.array_equal(a, b):
                self.lines.append(
                    f"{what}: resident ids differ ({a.size} against {b.size}, "
                    f"{np.setdiff1d(a, b).size} only here, {np.setdiff1d(b, a).size} only there)"
                )
            else:
                self.floats(f"{what}.rows", got.rows, want.rows)
        elif isinstance(want, dict):
            if set(got) != set(want):
                self.lines.append(f"{what}: keys {sorted(got)}, oracle {sorted(want)}")
            else:
                for key in sorted(want):
                    self.tree(f"{what}/{key}", got[key], want[key])
        else:
            self.floats(what, got, want)


def ints(tree):
    return jax.tree.map(lambda x: int(np.asarray(x)), tree)


# ------------------------------------------------------------------------- one case


def data(c: Config) -> tuple[list[dict], dict]:
    """The batches of `c`'s steps (NumPy), and the batch after them (unseen ids)."""
    r = np.random.default_rng(c["data_seed"])
    ids = pools(c, r)
    batches = [batch(c, r, ids) for _ in range(c["steps"])]
    return batches, batch(c, r, ids, novel=True)


def dense_params(c: Config) -> dict:
    return {
        name: jnp.asarray(np.random.default_rng(123).normal(size=(w,)), jnp.float32) * 0.3
        for name, w in widths(c).items()
    }


def run(c: Config) -> dict:
    """Trains `c` and its oracle and compares them: {"status": ..., ...}."""
    if c["oracle"] == "processes":
        return _run_processes(c)
    result: dict[str, Any] = {}
    sides = {}
    for side, oracle in (("oracle", True), ("run", False)):
        try:
            sides[side] = embedding(c, oracle)
        except Exception as e:  # noqa: BLE001 - a refusal is an outcome, recorded.
            status = "rejected" if side == "run" else "oracle rejected"
            return dict(result, status=status, error=f"{type(e).__name__}: {e}"[:800])
    batches, tail = data(c)
    expected = distinct_ids(c, batches)
    report = Report(
        exact=c["oracle"] == "placement"
        and not c.get("stage_host_rows")  # Staged: to float32 rounding (README).
        and not c.get("x64")  # XLA may round the run's dense side otherwise under x64.
        and all(not t["dynamic"] and t["placement"] in ("host", "device") for t in c["tables"]),
        rtol=1e-4,
        atol=1e-5,
    )
    loops, metrics, feeds, stage, initial = {}, {}, {}, "start", None
    directory = tempfile.mkdtemp(prefix="jte-fuzz-")
    try:
        for side in ("oracle", "run"):
            emb = sides[side]
            here = plainest(c) if side == "oracle" and c["oracle"] == "paths" else c
            k = c["accumulate_steps"] // here["accumulate_steps"]  # Micro-batches joined.
            feed = [joined(b) for b in batches + [tail]] if k > 1 else batches + [tail]
            x64 = side == "run" and c.get("x64", False)
            if x64:  # int64 ids, which the run's calls narrow (`_inputs.x32`).
                feed = [widened(b) for b in feed]
            with jax.enable_x64(x64):
                if here["input"] == "jax":
                    feed = [on_mesh(here, b, emb.mesh) for b in feed]
            stage = f"{side}: init"
            front = c.get("front", "core") if side == "run" else "core"
            loop = Loop(here, emb, front, dense_params(c), feed[0], scale=k, x64=x64)
            if side == "run":
                report.tree("init", emb.export(loop.embedding), initial)
            else:
                initial = emb.export(loop.embedding)
            logged = []
            for i in range(c["steps"]):
                stage = f"{side}: step {i}"
                m = loop(feed[i], next_batch=feed[i + 1] if loop.prefetch else None)
                logged.append(jax.tree.map(np.asarray, m))
                if side == "run" and i == 1:  # The base of an incremental save.
                    stage = "run: the base checkpoint"
                    jte.checkpoint.save(directory, emb, loop.embedding)
            stage = f"{side}: flush"
            loop.flush()
            jax.block_until_ready((loop.params, loop.embedding))
            if loop.step.trace_count != 1:
                report.lines.append(f"{side}: the train step traced {loop.step.trace_count} times")
            loops[side], metrics[side], feeds[side] = loop, logged, feed
        stage = "compare"
        _compare(c, sides, loops, metrics, expected, report, result)
        stage = "restore and continue"
        _continue(c, sides, loops, feeds, tail, report, directory)
    except Exception as e:  # noqa: BLE001 - the fuzzer's finding, recorded.
        return dict(
            result,
            status="error",
            stage=stage,
            error=f"{type(e).__name__}: {e}"[:1500],
            traceback=traceback.format_exc()[-4000:],
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if report.lines:
        return dict(result, status="mismatch", report=report.lines[:30])
    return dict(result, status="ok")


def _compare(c, sides, loops, metrics, expected, report: Report, result: dict) -> None:
    emb, oracle = sides["run"], sides["oracle"]
    got, want = loops["run"].embedding, loops["oracle"].embedding
    for i, (m, w) in enumerate(zip(metrics["run"], metrics["oracle"])):
        report.floats(f"loss {i}", m["loss"], w["loss"])
        for key in ("skipped", "invalid_ids"):
            report.equal(f"step {i} {key}", int(m[key]), int(w[key]))
        report.equal(f"step {i} dynamic", ints(m.get("dynamic")), ints(w.get("dynamic")))
    report.tree("params", loops["run"].params, loops["oracle"].params)
    report.equal("step", loops["run"].step_count, loops["oracle"].step_count)
    report.equal("embedding step", int(got.step), int(want.step))
    report.tree("export", emb.export(got), oracle.export(want))
    report.tree("export_slots", emb.export_slots(got), oracle.export_slots(want))
    if emb.dynamic:
        stats = ints(emb.dynamic_stats(got))
        report.equal("dynamic_stats", stats, ints(oracle.dynamic_stats(want)))
        for table, s in stats.items():
            outcomes = s["admitted"] + s["rejected"] + s["failed"]
            report.equal(
                f"{table}: misses against admitted + rejected + failed", s["misses"], outcomes
            )
            report.equal(
                f"{table}: hits + misses against distinct ids",
                s["hits"] + s["misses"],
                expected[table],
            )
        result["dynamic"] = stats
    for t in c["tables"]:
        if t["placement"] != "device":
            key = next((k for k, members in emb.stacks.items() if t["name"] in members), t["name"])
            report.equal(
                f"{t['name']}: memory kind", got.tables[key].sharding.memory_kind, "pinned_host"
            )
    if emb.cached:
        result["cache"] = ints(emb.cache_stats(got))


def _continue(c, sides, loops, feeds, tail, report: Report, directory: str) -> None:
    """The run's state saved (on top of the base saved after its second step: incremental
    for dynamic tables) and restored into the oracle's embedding (another placement, or one
    device) holds the same logical rows, slots and counters, bit for bit; then one more
    step of the run from its state and of the oracle from the restored one (on new ids:
    admissions, evictions) must agree as the steps before did."""
    emb, oracle = sides["run"], sides["oracle"]
    got = loops["run"].embedding
    base = max(jte.checkpoint.all_steps(directory))
    if int(got.step) > base:  # Skipped steps leave the embedding and its step alone.
        jte.checkpoint.save(directory, emb, got, since_step=base)
    restored, _ = jte.checkpoint.restore(directory, oracle)
    exact = Report(exact=True, rtol=0.0, atol=0.0)
    exact.tree("restored export", oracle.export(restored), emb.export(got))
    exact.tree("restored export_slots", oracle.export_slots(restored), emb.export_slots(got))
    if emb.dynamic:
        exact.equal(
            "restored dynamic_stats",
            ints(oracle.dynamic_stats(restored)),
            ints(emb.dynamic_stats(got)),
        )
    if emb.dynamic:  # And into twice the capacity, which holds the same ids.
        larger = embedding(c, True, grow=2)
        bigger, _ = jte.checkpoint.restore(directory, larger)
        exact.tree("restored x2 export", larger.export(bigger), emb.export(got))
        exact.tree("restored x2 export_slots", larger.export_slots(bigger), emb.export_slots(got))
        exact.equal(
            "restored x2 dynamic_stats",
            ints(larger.dynamic_stats(bigger)),
            ints(emb.dynamic_stats(got)),
        )
    report.lines += exact.lines
    # A server of the run's tables reads what the run's lookup reads, new ids included.
    features = dict(tail["features"])  # NumPy: the Server's own input check.
    if c["accumulate_steps"] > 1:
        features = jax.tree.map(lambda x: x[0], features)
    for t in c["tables"]:  # Out-of-range ids: a ValueError on NumPy input, by contract.
        for f in [] if t["dynamic"] else t["features"]:
            leaf = features[f["name"]]
            ids = leaf.ids if isinstance(leaf, jte.Weighted) else leaf
            ids = np.where(ids < t["vocabulary"], ids, -1).astype(ids.dtype)
            features[f["name"]] = leaf._replace(ids=ids) if isinstance(leaf, jte.Weighted) else ids
    # (To float32 rounding: one device sums an example's rows in its own order.)
    server = jte.serving.Server.from_embedding(emb, got, unknown="init")
    served = Report(exact=False, rtol=1e-5, atol=1e-6)
    served.tree("served", server(features), emb.lookup(got, features))
    report.lines += served.lines
    run, want = loops["run"], loops["oracle"]
    want.resume(restored)
    # The last batch again as next_batch: the steps' own program, which fetches nothing.
    ahead = lambda side: feeds[side][-1] if loops[side].prefetch else None
    m = run(feeds["run"][-1], next_batch=ahead("run"))
    w = want(feeds["oracle"][-1], next_batch=ahead("oracle"))
    run.flush()
    want.flush()
    report.floats("continued loss", m["loss"], w["loss"])
    report.equal("continued dynamic", ints(m.get("dynamic")), ints(w.get("dynamic")))
    report.tree("continued export", emb.export(run.embedding), oracle.export(want.embedding))
    report.tree(
        "continued export_slots",
        emb.export_slots(run.embedding),
        oracle.export_slots(want.embedding),
    )


# ------------------------------------------------------------------------- several processes


def _local(x) -> np.ndarray:
    """A value of the run as NumPy, on every process (a global array gathered)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _flat(prefix: str, tree, out: dict) -> dict:
    if isinstance(tree, jte.DynamicRows):
        out[f"{prefix}/ids"], out[f"{prefix}/rows"] = _local(tree.ids), _local(tree.rows)
    elif isinstance(tree, dict):
        for key in sorted(tree):
            _flat(f"{prefix}/{key}", tree[key], out)
    elif tree is not None:
        out[prefix] = _local(tree)
    return out


def _readable(emb: jte.Embedding, state, prefix: str, out: dict) -> dict:
    _flat(f"{prefix}export", emb.export(state), out)
    _flat(f"{prefix}slots", emb.export_slots(state), out)
    if emb.dynamic:
        _flat(f"{prefix}stats", emb.dynamic_stats(state), out)
    return out


def trained(c: Config, emb: jte.Embedding, feed: list, directory: str) -> dict:
    """`c` trained on `emb` by `make_train_step` over `feed` (its steps' batches, then the
    batch after them), saved under `directory` after the second step and on top of that at
    the end, and restored: every value it can read, flat ({"loss/0": ..., "export/t0/ids":
    ..., "restored/export/...": ...}), the same on every process."""
    loop = Loop(c, emb, "core", dense_params(c), feed[0])
    out = {}
    for i in range(c["steps"]):
        m = loop(feed[i], next_batch=feed[i + 1] if loop.prefetch else None)
        _flat(f"step/{i}", {k: v for k, v in m.items() if k != "aux"}, out)
        if i == 1:
            jte.checkpoint.save(directory, emb, loop.embedding)
    loop.flush()
    _flat("params", loop.params, out)
    out["trace_count"] = np.asarray(loop.step.trace_count)
    _readable(emb, loop.embedding, "", out)
    base = max(jte.checkpoint.all_steps(directory))
    if loop.step_count > base:  # A skipped step leaves the embedding and its step alone.
        jte.checkpoint.save(directory, emb, loop.embedding, since_step=base)
    restored, _ = jte.checkpoint.restore(directory, emb)
    return _readable(emb, restored, "restored/", out)


def in_processes(path: str) -> dict:
    """One process's part of the "processes" oracle's run (`tests/_multihost_worker.py`
    calls it on each): the configuration at `path`, every process feeding its own rows of
    each global batch (global-array inputs) or the whole batch (NumPy inputs)."""
    with open(path) as f:
        c = json.load(f)
    from jax_tpu_embed import multihost

    emb = embedding(c, False)
    batches, tail = data(c)
    feed = batches + [tail]
    if c["input"] == "jax":
        rows = multihost.process_batch_rows(emb, c["n"] * c["per_device"])
        feed = [on_mesh(c, b, emb.mesh, rows) for b in feed]
    return trained(c, emb, feed, os.path.join(os.path.dirname(path), "run"))


def _run_processes(c: Config) -> dict:
    """The "processes" oracle: `in_processes` on 2 worker processes against `trained` here."""
    import subprocess
    import sys

    from test_multihost import _free_port, _worker_env

    try:
        emb = embedding(c, False)
    except Exception as e:  # noqa: BLE001 - a refusal is an outcome, recorded.
        return dict(status="rejected", error=f"{type(e).__name__}: {e}"[:800])
    directory = tempfile.mkdtemp(prefix="jte-fuzz-")
    stage, procs, report = "start", [], Report(exact=False, rtol=1e-5, atol=1e-6)
    try:
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(c, f)
        env = dict(_worker_env(), JTE_TEST_XLA_CACHE="off")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_multihost_worker.py")
        port = _free_port()
        for i in range(2):
            args = ["--port", str(port), "--process-id", str(i), "--num-processes", "2"]
            args += [
                "--out",
                directory,
                "--cases",
                "fuzz:" + os.path.join(directory, "config.json"),
            ]
            log = open(os.path.join(directory, f"worker{i}.log"), "wb")  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    [sys.executable, script, *args], stdout=log, stderr=subprocess.STDOUT, env=env
                )
            )
        stage = "oracle"
        batches, tail = data(c)
        feed = batches + [tail]
        if c["input"] == "jax":
            feed = [on_mesh(c, b, emb.mesh) for b in feed]
        want = trained(c, emb, feed, os.path.join(directory, "one"))
        stage = "run"
        for p in procs:
            p.wait(timeout=900)
        if any(p.returncode for p in procs):
            logs = [open(os.path.join(directory, f"worker{i}.log")).read() for i in range(2)]
            tails = "\n".join(f"--- worker {i} ---\n" + t[-3000:] for i, t in enumerate(logs))
            return dict(status="error", stage="run", error=tails[-6000:])
        with np.load(os.path.join(directory, "fuzz.npz")) as saved:
            got = dict(saved)
        stage = "compare"
        if sorted(got) != sorted(want):
            report.lines.append(f"keys: {sorted(set(got) ^ set(want))} on one side only")
        for key in sorted(set(got) & set(want)):
            counted = key.split("/")[0] in ("step", "stats") and not key.endswith("/loss")
            if counted or key.endswith("/ids"):
                report.equal(key, got[key].tolist(), want[key].tolist())
            else:
                report.floats(key, got[key], want[key])
        for key in [k for k in got if k.startswith("restored/")]:
            if not np.array_equal(got[key], got[key[len("restored/") :]], equal_nan=True):
                report.lines.append(f"{key}: the run's restore differs from what it saved")
        report.equal("trace_count", int(got["trace_count"]), 1)
        # The run's checkpoint (each process wrote its own shards) restored here, on 8
        # devices of one process: what the run held, bit for bit.
        restored, _ = jte.checkpoint.restore(os.path.join(directory, "run"), emb)
        here = _readable(emb, restored, "", {})
        for key, value in here.items():
            if not np.array_equal(value, got[key], equal_nan=True):
                report.lines.append(f"{key}: the run's checkpoint restores otherwise here")
    except Exception as e:  # noqa: BLE001 - the fuzzer's finding, recorded.
        return dict(
            status="error",
            stage=stage,
            error=f"{type(e).__name__}: {e}"[:1500],
            traceback=traceback.format_exc()[-4000:],
        )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(directory, ignore_errors=True)
    if report.lines:
        return dict(status="mismatch", report=report.lines[:30])
    return dict(status="ok")


# ------------------------------------------------------------------------- the command


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--oracle", choices=ORACLES, default="mesh")
    parser.add_argument("--front", choices=FRONTS, help="the run's front end (default: drawn)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case", type=int, help="run this case alone and print its configuration")
    parser.add_argument("--start", type=int, default=0, help="the first case of a campaign")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds for a campaign")
    parser.add_argument("--case-timeout", type=float, default=600.0, help="abort a hung case")
    parser.add_argument("--out", help="append one JSON line per case to this file")
    args = parser.parse_args(argv)
    cases = [args.case] if args.case is not None else range(args.start, 2**31)
    began = time.time()
    for case in cases:
        if args.case is None and time.time() - began > args.budget:
            break
        c = draw(args.seed, case, args.oracle, args.front)
        if args.case is not None:
            print(json.dumps(c, indent=1))
        # A hang in a collective would stop the campaign silently: dump and exit instead.
        faulthandler.dump_traceback_later(args.case_timeout, exit=True)
        started = time.time()
        result = run(c)
        faulthandler.cancel_dump_traceback_later()
        result = dict(seed=args.seed, case=case, seconds=round(time.time() - started, 1), **result)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(dict(result, config=c), default=str) + "\n")
        brief = {k: v for k, v in result.items() if k != "traceback"}
        print(json.dumps(brief, default=str), flush=True)
        if args.case is not None and "traceback" in result:
            print(result["traceback"])
        jax.clear_caches()


if __name__ == "__main__":
    main()
