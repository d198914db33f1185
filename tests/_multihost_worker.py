"""One process of the 2-process CPU job of test_multihost.py, and the training both share.

As a script (the test starts two, with JAX_PLATFORMS=cpu and 4 CPU devices each):

    python tests/_multihost_worker.py --port P --process-id I --num-processes 2 \
        --out DIR --cases div:explicit,mod:auto:numpy:restore

it joins JAX's multi-controller runtime on 127.0.0.1:P (gloo CPU collectives) and runs
`train` for every case (strategy:mesh[:inputs[:start]], its arguments) over a mesh of all
global devices, each process feeding only its rows of the global batch; process 0 writes
DIR/<case with _ for :>.npz. The case "criteo" instead reads DIR/criteo_{0,1}.tsv with
`jte.data.criteo` (`read_criteo`), one file per process; "fuzz:PATH" trains the fuzzer's
configuration at PATH (`fuzz.in_processes`) and writes DIR/fuzz.npz. Imported by the test
(one process, 8 devices), `train` gives the single-process result of the same training.

jax_tpu_embed never touches a device at import, so importing it before
`jax.distributed.initialize` is fine.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

import jax_tpu_embed as jte
from jax_tpu_embed import _multihost as multihost

B = 32
STEPS = 3
SEED = 1234


def make_spec(strategy: str, placement: str = "device") -> jte.EmbeddingSpec:
    if placement == "cached":  # Fewer rows than a batch's distinct rows on 8 devices.
        return make_spec_placed(strategy, jte.HostCached(cache_rows=16, ways=2))
    return make_spec_placed(strategy, placement)


SIZES = {"shared": 37, "hot": 29, "seq": 21}
# Multiples of 8: each "div" shard one block of the logical rows (checkpoints by shard).
EVEN_SIZES = {"shared": 40, "hot": 32, "seq": 24}


def make_spec_placed(strategy: str, placement, sizes=SIZES) -> jte.EmbeddingSpec:
    """Three tables: "shared" (Adagrad, the spec's) for a weighted multi-hot and a one-hot
    feature, "hot" (the same row form and optimizer: stacked with "shared") for a multi-hot
    feature, "seq" (its own Adam) for a sequence feature. With SIZES V is not a multiple of
    8, so "div" shards differ in size and both strategies pad. `placement`: every table's."""
    shared = jte.TableConfig(
        vocabulary_size=sizes["shared"], dim=8, combiner="mean", name="shared", placement=placement
    )
    hot = jte.TableConfig(
        vocabulary_size=sizes["hot"], dim=8, combiner="sum", name="hot", placement=placement
    )
    seq = jte.TableConfig(
        vocabulary_size=sizes["seq"],
        dim=4,
        name="seq",
        optimizer=jte.Adam(learning_rate=0.05),
        placement=placement,
    )
    features = {
        "multi": jte.FeatureConfig(shared),  # Weighted (B, 3)
        "one": jte.FeatureConfig(shared),  # (B,)
        "hot": jte.FeatureConfig(hot),  # (B, 2)
        "seq": jte.FeatureConfig(seq, max_sequence_length=4),  # (B, 5), truncated
    }
    return jte.EmbeddingSpec(features, jte.Adagrad(learning_rate=0.1), partition_strategy=strategy)


def make_mesh(kind: str) -> jax.sharding.Mesh:
    """One axis "shard" over every device. "explicit": jax.make_mesh (Explicit axes); "auto":
    jax.sharding.Mesh (Auto axes); "interleaved": Auto, the processes' devices alternating
    along the axis, so a process's rows of the batch are not one contiguous block."""
    devices = jax.devices()  # Sorted by process, then by id.
    if kind == "explicit":
        return jax.make_mesh((len(devices),), ("shard",))
    if kind == "interleaved":
        by_process = {}
        for d in devices:
            by_process.setdefault(d.process_index, []).append(d)
        devices = [d for group in zip(*by_process.values()) for d in group]
    return jax.sharding.Mesh(np.array(devices), ("shard",))


def global_step_data(step: int):
    """(features, act_grads) of the global batch of `step`, as NumPy; the same everywhere."""
    rng = np.random.default_rng([SEED, step])
    # Small id ranges: many duplicates within and across features of the shared table.
    multi = rng.integers(-1, 37, (B, 3)).astype(np.int32)
    weights = rng.uniform(0.5, 2.0, (B, 3)).astype(np.float32)
    one = rng.integers(0, 37, (B,)).astype(np.int32)
    seq = rng.integers(-1, 21, (B, 5)).astype(np.int32)
    hot = rng.integers(-1, 29, (B, 2)).astype(np.int32)
    features = {"multi": jte.Weighted(multi, weights), "one": one, "hot": hot, "seq": seq}
    grads = {
        "multi": rng.standard_normal((B, 8)).astype(np.float32),
        "one": rng.standard_normal((B, 8)).astype(np.float32),
        "hot": rng.standard_normal((B, 8)).astype(np.float32),
        "seq": rng.standard_normal((B, 4, 4)).astype(np.float32),
    }
    return features, grads


def _gather(x):
    """A global jax.Array as NumPy on every process."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _raises(fn, *args) -> bool:
    try:
        fn(*args)
    except ValueError:
        return True
    return False


def _gather_rows(rows):
    if jax.process_count() == 1:
        return np.asarray(rows)[None]
    return np.asarray(multihost_utils.process_allgather(rows.astype(np.int32)))


def initial_values():
    """(tables, slots) for `restore_tables`: the Adam table's "velocities" left out."""
    rng = np.random.default_rng([SEED, 99])
    tables = {
        "shared": rng.standard_normal((37, 8)).astype(np.float32),
        "seq": rng.standard_normal((21, 4)).astype(np.float32),
        "hot": rng.standard_normal((29, 8)).astype(np.float32),
    }
    slots = {
        "shared": {"accumulators": rng.uniform(0.1, 0.5, (37, 8)).astype(np.float32)},
        "hot": {"accumulators": rng.uniform(0.1, 0.5, (29, 8)).astype(np.float32)},
        "seq": {"momenta": rng.uniform(-0.1, 0.1, (21, 4)).astype(np.float32)},
    }
    return tables, slots


def train(
    strategy: str,
    mesh_kind: str,
    inputs: str = "local",
    start: str = "init",
    routing: str = "auto",
    placement: str = "device",
    directory: str | None = None,
) -> dict:
    """Trains STEPS steps; {"table/t", "slot/t/s", "acts/<step>/<feature>": np.ndarray}.

    inputs="local": every process feeds only its rows of each global batch, as global
    jax.Arrays (in one process: all rows). "numpy": every process passes the whole global
    batch as NumPy arrays. start="init": `emb.init(key)`; "restore": `emb.restore_tables`
    from `initial_values()` (no table-initializer compiles: the cheaper start). routing:
    the Embedding's ("owner": ids travel to their rows' owners with all_to_all).
    placement: every table's ("host": in the processes' host memory; "cached": there with
    a small HostCached cache, each step prefetching the next step's rows first).
    """
    if strategy == "dynamic":
        return train_dynamic(mesh_kind, inputs, routing, placement, directory)
    emb = jte.Embedding(make_spec(strategy, placement), make_mesh(mesh_kind), routing=routing)
    if placement in ("host", "cached"):  # Never stacked; their arrays stay on the host.
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(emb.abstract_state().tables)}
        assert kinds == {"pinned_host"}, kinds
    elif routing == "owner":  # Stacks are for tables routed to their owners.
        assert ("hot", "shared") in emb.stacks.values(), emb.stacks
    if start == "init":
        state = emb.init(jax.random.key(0))
    else:
        tables, slots = initial_values()
        state = emb.restore_tables(tables, slots, step=5)
    first_step = int(_gather(state.step))
    rows = multihost.process_batch_rows(emb, B)
    out = {}
    for step in range(STEPS):
        features, grads = global_step_data(step)
        local = jax.tree.map(lambda x: x[rows], (features, grads))
        if inputs == "local":
            features, grads = multihost.global_batch(emb, local)
        elif step == 0:  # Whether the NumPy check passes the global batch, rejects local rows.
            out["meta/same_check"] = np.array(
                [
                    _raises(multihost.check_same_on_every_process, (features, grads)),
                    _raises(multihost.check_same_on_every_process, local),
                ]
            )
        acts = emb.lookup(state, features)
        for path, a in acts.items():
            out[f"acts/{step}/{path}"] = _gather(a)
        if placement == "cached" and step + 1 < STEPS:
            upcoming = jax.tree.map(lambda x: x[rows], global_step_data(step + 1)[0])
            state = emb.prefetch(state, multihost.global_batch(emb, upcoming))
        state = emb.apply_gradients(state, features, grads)
    assert int(_gather(state.step)) == first_step + STEPS
    # Which rows each process fed: (processes, b); checked by the test, not compared.
    out["meta/rows"] = _gather_rows(rows)
    out.update(_exported(emb, state))
    return out


def dynamic_step_data(step: int):
    """(features, act_grads) of `step` for `train_dynamic`: int64 ids from a pool over the
    whole int64 range (negatives included), many repeats, -1 padding; NumPy, the same
    everywhere."""
    pool = np.random.default_rng([SEED, 7]).integers(
        np.iinfo(np.int64).min, np.iinfo(np.int64).max, 120, np.int64
    )
    pool = pool[pool != -1]
    rng = np.random.default_rng([SEED, 8, step])
    user = pool[rng.integers(0, pool.size, (B,))]
    hist = np.where(rng.random((B, 3)) < 0.2, -1, pool[rng.integers(0, pool.size, (B, 3))])
    item = np.where(rng.random((B, 2)) < 0.2, -1, pool[rng.integers(0, pool.size, (B, 2))])
    features = {"user": user, "hist": hist, "item": item}
    grads = {k: rng.standard_normal((B, 8)).astype(np.float32) for k in features}
    return features, grads


def dynamic_embedding(mesh, routing: str = "auto", placement: str = "device", capacity=64):
    """`train_dynamic`'s Embedding on `mesh`: "users" and "items", stacked in one array with
    routing="owner" (in device memory)."""
    users = jte.TableConfig(
        dim=8,
        combiner="mean",
        name="users",
        dynamic=jte.DynamicTable(capacity=capacity, bucket_size=8),
        placement=placement,
    )
    items = jte.TableConfig(
        dim=8,
        combiner="sum",
        name="items",
        dynamic=jte.DynamicTable(capacity=64, bucket_size=8, eviction="lfu"),
        placement=placement,
    )
    features = {"user": users, "hist": users, "item": items}
    spec = jte.EmbeddingSpec(
        {path: jte.FeatureConfig(table) for path, table in features.items()},
        jte.Adagrad(learning_rate=0.1),
    )
    emb = jte.Embedding(spec, mesh, routing=routing)
    if emb.routing["users"] == "owner" and placement == "device":
        assert emb.stacks == {"users+items": ("users", "items")}, emb.stacks
    return emb


def train_dynamic(
    mesh_kind: str,
    inputs: str = "local",
    routing: str = "auto",
    placement: str = "device",
    directory: str | None = None,
) -> dict:
    """`train` for a dynamic table shared by two features, so small that LRU evicts every
    step: {"ids", "rows", "acc", "stats/<counter>", "acts/<step>/<feature>", "pieces/..."}.
    Ids travel as `jte.split_ids` halves (global jax.Arrays with inputs="local"). placement
    "host": its rows and slots in the processes' host memory, its index on the devices.
    With a `directory`, the state is saved there by `jte.checkpoint` and restored:
    "restored/ids", "restored/rows", "restored/acc" are the restored table's, "larger/..."
    those restored onto twice the capacity."""
    emb = dynamic_embedding(make_mesh(mesh_kind), routing, placement)
    state = emb.init(jax.random.key(0))
    if placement == "host":
        assert state.tables["users"].sharding.memory_kind == "pinned_host"
    rows = multihost.process_batch_rows(emb, B)
    out = {}
    for step in range(STEPS + 2):
        features, grads = dynamic_step_data(step)
        features = {k: jte.split_ids(v[rows]) for k, v in features.items()}
        grads = {k: v[rows] for k, v in grads.items()}
        if inputs == "local":
            features, grads = multihost.global_batch(emb, (features, grads))
        acts = emb.lookup(state, features)
        for path, a in acts.items():
            out[f"acts/{step}/{path}"] = _gather(a)
        state = emb.apply_gradients(state, features, grads)
    table = emb.export(state)["users"]
    out["ids"], out["rows"] = table.ids, table.rows
    out["acc"] = emb.export_slots(state)["users"]["accumulators"].rows
    items = emb.export(state)["items"]
    out["items/ids"], out["items/rows"] = items.ids, items.rows
    # Rows of the stored table and of an index array read in pieces of 3 rows (through the
    # devices with several processes), in a shuffled order with repeats.
    for key, array in (
        ("table", state.tables[emb.plan.stack_of["users"]]),
        ("index", jax.tree.leaves(state.index)[0]),
    ):
        at = np.random.default_rng(0).permutation(np.r_[np.arange(array.shape[0]), 0, 5, 5])
        row_bytes = array.dtype.itemsize * int(np.prod(array.shape[1:]))
        out[f"pieces/{key}"] = multihost.to_host(array, at, chunk_bytes=3 * row_bytes)
    stats = emb.dynamic_stats(state)
    for name, value in stats["users"].items():
        out[f"stats/{name}"] = np.asarray(_gather(value))
    for name, value in stats["items"].items():
        out[f"stats/items/{name}"] = np.asarray(_gather(value))
    if directory is not None:
        from jax_tpu_embed import checkpoint

        checkpoint.save(directory, emb, state)
        restored, _ = checkpoint.restore(directory, emb)
        table = emb.export(restored)["users"]
        out["restored/ids"], out["restored/rows"] = table.ids, table.rows
        out["restored/acc"] = emb.export_slots(restored)["users"]["accumulators"].rows
        items = emb.export(restored)["items"]
        out["restored/items/ids"], out["restored/items/rows"] = items.ids, items.rows
        # Onto another capacity: each process reads its own blocks, and the devices send
        # each entry to its new shard, across the processes.
        larger = dynamic_embedding(make_mesh(mesh_kind), routing, placement, capacity=128)
        restored, _ = checkpoint.restore(directory, larger)
        table = larger.export(restored)["users"]
        out["larger/ids"], out["larger/rows"] = table.ids, table.rows
        out["larger/acc"] = larger.export_slots(restored)["users"]["accumulators"].rows
    return out


CRITEO_VOCAB = [97] * 26
CRITEO_BATCH = 16


def read_criteo(directory: str) -> dict:
    """Every global batch of `jte.data.criteo` over directory/criteo_{0,1}.tsv, gathered: each
    process reads its own file and feeds its rows of the batch over an 8-device mesh."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    paths = [os.path.join(directory, f"criteo_{i}.tsv") for i in range(2)]
    sharding = NamedSharding(make_mesh("explicit"), P("shard"))
    batches = jte.data.criteo(paths, CRITEO_BATCH, CRITEO_VOCAB, sharding=sharding)
    out = {"meta/files": _gather_rows(np.array([paths.index(f) for f in batches.files]))}
    for i, batch in enumerate(batches):
        assert batch["labels"].sharding == sharding and batch["labels"].shape == (CRITEO_BATCH,)
        out[f"labels/{i}"] = _gather(batch["labels"])
        out[f"dense/{i}"] = _gather(batch["dense"])
        out[f"ids/{i}"] = np.stack([_gather(batch["sparse"][f"C{j + 1}"]) for j in range(26)], 1)
    return out


def checkpoint_roundtrip(
    strategy: str, mesh_kind: str, placement: str, directory: str, sizes: str = "even"
) -> dict:
    """Trains two steps on tables whose V is a multiple of 8 (sizes "even", else SIZES),
    saves a checkpoint under `directory` with `jte.checkpoint` (every process writing its
    shards), and restores it. {"saved/...": the tables and slots saved, "table/...",
    "slot/...": those restored, "meta/how": how each table was converted
    (`checkpoint._conversion`)}."""
    from jax_tpu_embed import checkpoint

    spec = make_spec_placed(strategy, placement, EVEN_SIZES if sizes == "even" else SIZES)
    emb = jte.Embedding(spec, make_mesh(mesh_kind))
    state = emb.init(jax.random.key(0))
    rows = multihost.process_batch_rows(emb, B)
    for step in range(2):
        local = jax.tree.map(lambda x: x[rows], global_step_data(step))
        features, grads = multihost.global_batch(emb, local)
        state = emb.apply_gradients(state, features, grads)
    out = {f"saved/{k}": v for k, v in _exported(emb, state).items()}
    checkpoint.save(directory, emb, state)
    restored, _ = checkpoint.restore(directory, emb)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves((restored.tables, restored.slots))}
    assert kinds == {"pinned_host" if placement == "host" else "device"}, kinds
    out.update(_exported(emb, restored))
    out["meta/how"] = np.array([checkpoint._conversion(emb, n) for n in sorted(emb.table_plans)])
    return out


def _exported(emb, state) -> dict:
    out = {f"table/{n}": np.asarray(t) for n, t in emb.export(state).items()}
    for name, slots in emb.export_slots(state).items():
        out.update({f"slot/{name}/{k}": np.asarray(v) for k, v in slots.items()})
    return out


def agree() -> dict:
    """`_guards.on_every_process` where only process 1's part is corrupt: what each process
    raises, then a collective that both must still reach (none hangs)."""
    from jax_tpu_embed import _guards
    from jax_tpu_embed.checkpoint import CheckpointCorruptError

    def part():
        if jax.process_index() == 1:
            raise CheckpointCorruptError("block 5 holds an id of shard 2")
        return "fine"

    out = {}
    try:
        _guards.on_every_process(part, "restore", (ValueError, CheckpointCorruptError))
        out["raised"] = np.array("nothing")
    except ValueError as e:
        out["raised"], out["message"] = np.array(type(e).__name__), np.array(str(e))
    out["after"] = np.asarray(multihost_utils.process_allgather(np.asarray([7])))
    return out


def _file(case: str) -> str:
    """The name a case's files take under --out."""
    return "fuzz" if case.startswith("fuzz:") else case.replace(":", "_")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default="div:explicit")
    parser.add_argument("--init-timeout", type=int, default=60)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    join(args.port, args.num_processes, args.process_id, args.init_timeout)
    assert jax.process_count() == args.num_processes, jax.process_count()
    assert jax.device_count() == args.num_processes * jax.local_device_count()
    print(
        f"[{args.process_id}] up in {time.perf_counter() - start:.1f}s: "
        f"{jax.local_device_count()} local of {jax.device_count()} devices",
        flush=True,
    )

    for case in args.cases.split(","):
        t0 = time.perf_counter()
        if case == "criteo":
            result = read_criteo(args.out)
        elif case == "agree":
            result = agree()
        elif case.startswith("checkpoint:"):
            _, strategy, mesh_kind, placement, *sizes = case.split(":")
            where = os.path.join(args.out, _file(case))
            result = checkpoint_roundtrip(strategy, mesh_kind, placement, where, *sizes)
        elif case.startswith("fuzz:"):  # A configuration of tests/fuzz.py ("processes").
            import fuzz

            result = fuzz.in_processes(case[len("fuzz:") :])
        elif case.startswith("dynamic:"):
            result = train(*case.split(":"), directory=os.path.join(args.out, _file(case)))
        else:
            result = train(*case.split(":"))
        if jax.process_index() == 0:
            # Written whole, then renamed: the test reads each case as soon as it appears.
            path = os.path.join(args.out, _file(case) + ".npz")
            with open(path + ".tmp", "wb") as f:
                np.savez(f, **result)
            os.replace(path + ".tmp", path)
        print(f"[{args.process_id}] {case}: {time.perf_counter() - t0:.1f}s", flush=True)
    jax.distributed.shutdown()
    return 0


def join(port: int, num_processes: int, process_id: int, init_timeout: int = 60) -> None:
    """Joins this process to a `jax.distributed` job whose coordinator is on loopback at
    `port`, with gloo's CPU collectives on loopback too: these workers' start, and
    `benchmarks/restore_memory.py`'s."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = f"127.0.0.1:{port}"
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=num_processes,
        process_id=process_id,
        coordinator_bind_address=address,
        cluster_detection_method="deactivate",  # No probing for TPU/Slurm/MPI environments.
        initialization_timeout=init_timeout,
        heartbeat_timeout_seconds=30,
        shutdown_timeout_seconds=30,
    )
    _pin_gloo_to_loopback()


def _pin_gloo_to_loopback():
    """Makes gloo listen on 127.0.0.1 instead of the address the hostname resolves to.

    jax creates the CPU client's gloo collectives without a hostname, so gloo binds to
    whatever `hostname` resolves to (often an external interface). The backend is created
    lazily, so replacing the CPU factory between `distributed.initialize` and the first use
    of a device is enough. Private API of jax 0.10.2 (pinned); skipped if it moved.
    """
    try:
        from jax._src import distributed, xla_bridge
        from jax._src.lib import _jax  # pyright: ignore[reportPrivateImportUsage]

        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, hostname="127.0.0.1"
        )
        xla_bridge.register_backend_factory(
            "cpu",
            functools.partial(xla_bridge.make_cpu_client, collectives=collectives),
            priority=0,
            fail_quietly=False,
        )
    except (ImportError, AttributeError, TypeError) as e:  # pragma: no cover
        print(f"gloo keeps its default address ({e!r})", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
