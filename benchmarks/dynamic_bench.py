"""Dynamic tables against static ones, and bucket eviction against exact global LRU.

    python benchmarks/dynamic_bench.py                  # W0 step times + eviction quality
    python benchmarks/dynamic_bench.py --workload W1 --steps 5 --json out.json
    python benchmarks/dynamic_bench.py --combiner mean  # the tables combine by mean
    python benchmarks/dynamic_bench.py --tpu v5p:2x2x1  # also TPU compiler bytes (no TPU needed)
    python benchmarks/dynamic_bench.py --serving 4194304 --dim 16   # serving lookups too
    JAX_PLATFORMS=tpu python benchmarks/dynamic_bench.py --workload W1 --min-count 2  # TPU VM

1. The train step (lookup, backward, update; jitted, state donated) on the workload's tables
   as static tables, and as dynamic tables fed the same batches with every id remapped to a
   random int64 (a fixed random map per table). The dynamic tables are sized so that the
   ids of the cycled batches fill them to `--occupancy` (0.8), and are filled by one pass
   over the batches before timing. Both are measured in the same run, alternating, so the
   ratio holds on a noisy machine. The process's CPU time per step (user + system, summed
   over the timed steps of each) is reported too: it moves less than the wall time when
   other work shares the cores. On a TPU VM (`JAX_PLATFORMS=tpu`) the same step runs on the
   chips: what the compiler's bytes (3) cannot show, the rounds the resolution takes at run
   time (a loop's body is charged once) and the admission filter's rounds (`--min-count`).
2. Eviction quality: a Zipf(1.05) stream of int64 ids through a dynamic table's index
   (`_hashindex.update`, LRU, one step = one batch of distinct ids) at `--eviction-occupancy`
   (0.85) of the stream's distinct ids, against exact global LRU of the same capacity (a
   Python OrderedDict): the hit rates and their difference in points.
3. With --tpu: the TPU compiler's bytes accessed per device of the W1-shaped step (8 tables,
   1,024 examples per chip), static and dynamic, and the dynamic step's estimated cycles of
   its XLA ops and longest fixed-trip loop (`_aot.Loop`); where the tables stack (owner routing, 64
   chips and more), the dynamic step with `stacking=False` too.
4. With --serving N: `jte.serving.Server` lookups from a dynamic table serving N ids against
   a static table of N rows (alternating, median ms); with --tpu too, the TPU compiler's
   bytes accessed of both lookups on one chip.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads  # noqa: E402

import jax_tpu_embed as jte  # noqa: E402
from jax_tpu_embed import _hashindex  # noqa: E402


def remapped(wl) -> list[list[np.ndarray]]:
    """Every id of table t replaced by a fixed random int64 (distinct per row)."""
    out = [[None] * wl.config.tables for _ in range(wl.num_batches)]
    for t in range(wl.config.tables):
        rng = np.random.default_rng([7, t])
        table = rng.integers(-(2**63), 2**63 - 1, size=wl.config.vocabulary_size, dtype=np.int64)
        for k in range(wl.num_batches):
            out[k][t] = table[wl.ids[k][t]]
    return out


def make_step(wl, dynamic_capacity: int | None, combiner: str = "sum", min_count: int = 1):
    c = wl.config
    mesh = Mesh(np.array(jax.devices()), ("shard",))
    names = [f"t{i}" for i in range(c.tables)]
    tables = [
        jte.TableConfig(
            None if dynamic_capacity else c.vocabulary_size,
            c.dim,
            combiner=combiner,
            name=n,
            dynamic=(
                jte.DynamicTable(capacity=dynamic_capacity, min_count=min_count)
                if dynamic_capacity
                else None
            ),
        )
        for n in names
    ]
    spec = jte.EmbeddingSpec(
        {n: jte.FeatureConfig(t) for n, t in zip(names, tables)}, jte.Adagrad(learning_rate=0.05)
    )
    emb = jte.Embedding(spec, mesh)
    sharding = NamedSharding(mesh, P("shard"))
    ids = remapped(wl) if dynamic_capacity else wl.ids
    batches = []
    for k in range(wl.num_batches):
        feats = {}
        for i, n in enumerate(names):
            x = ids[k][i]
            if dynamic_capacity:
                s = jte.split_ids(x)
                x = jte.SplitIds(jax.device_put(s.hi, sharding), jax.device_put(s.lo, sharding))
            else:
                x = jax.device_put(x, sharding)
            feats[n] = x
        batches.append(feats)
    R = {n: jax.device_put(wl.R[i], sharding) for i, n in enumerate(names)}

    def train_step(state, features, R):
        acts = emb.lookup(state, features)
        loss, grads = workloads.jax_loss(acts, R)
        return emb.apply_gradients(state, features, grads), loss

    fn = jax.jit(train_step, donate_argnums=0)
    return emb, fn, batches, R


def _cpu_seconds() -> float:
    """This process's CPU time so far (all threads, user + system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def step_times(wl, occupancy: float, steps: int, combiner: str = "sum", min_count: int = 1) -> dict:
    distinct = max(
        len(np.unique(np.concatenate([wl.ids[k][t].ravel() for k in range(wl.num_batches)])))
        for t in range(wl.config.tables)
    )
    capacity = int(np.ceil(distinct / occupancy / 64)) * 64
    runs = {}
    for label, cap in (("static", None), ("dynamic", capacity)):
        emb, fn, batches, R = make_step(wl, cap, combiner, min_count)
        state = emb.init(jax.random.key(0))
        for k in range(wl.num_batches):  # Compile, and fill the dynamic tables.
            state, _ = fn(state, batches[k], R)
        jax.block_until_ready(state)
        runs[label] = [emb, fn, batches, R, state, [], 0.0]
    for i in range(steps):  # Alternating, so that both see the same machine.
        for run in runs.values():
            emb, fn, batches, R, state, times, _ = run
            c0, t0 = _cpu_seconds(), time.perf_counter()
            state, loss = fn(state, batches[i % len(batches)], R)
            jax.block_until_ready((state, loss))
            times.append(time.perf_counter() - t0)
            run[4], run[6] = state, run[6] + _cpu_seconds() - c0
    out = {label: float(np.median(run[5]) * 1e3) for label, run in runs.items()}
    cpu = {label: run[6] / steps * 1e3 for label, run in runs.items()}
    emb, state = runs["dynamic"][0], runs["dynamic"][4]
    stats = {n: {k: int(v) for k, v in s.items()} for n, s in emb.dynamic_stats(state).items()}
    occupied = np.mean([s["occupancy"] for s in stats.values()]) / emb.dynamic["t0"].rows
    return {
        "static_ms": out["static"],
        "dynamic_ms": out["dynamic"],
        "ratio": out["dynamic"] / out["static"],
        "static_cpu_ms": cpu["static"],
        "dynamic_cpu_ms": cpu["dynamic"],
        "cpu_ratio": cpu["dynamic"] / cpu["static"],
        "capacity": capacity,
        "occupancy": float(occupied),
        "stats_t0": stats["t0"],
    }


def eviction_quality(
    occupancy: float, steps: int, batch: int, universe: int, bucket_size: int = 64
) -> dict:
    rng = np.random.default_rng(0)
    ids_of_rank = rng.integers(-(2**63), 2**63 - 1, size=universe, dtype=np.int64)
    cdf = workloads.power_law_cdf(universe, 1.05)
    stream = [
        np.unique(ids_of_rank[workloads.sample_ranks(cdf, (batch,), rng)]) for _ in range(steps)
    ]
    distinct = len(np.unique(np.concatenate(stream)))
    buckets = max(1, int(round(distinct * occupancy / bucket_size)))
    capacity = buckets * bucket_size
    config = _hashindex.IndexConfig(buckets=buckets, bucket_size=bucket_size, seed=1)
    state = jax.tree.map(jnp.asarray, _hashindex.empty_state(config, 1))
    size = max(len(s) for s in stream)

    @jax.jit
    def step(state, hi, lo, valid, now):
        _, bucket = _hashindex.locate(config, 1, hi, lo)
        return _hashindex.update(config, state, hi, lo, bucket, valid, now)[0]

    lru: collections.OrderedDict = collections.OrderedDict()
    hits = exact_hits = total = 0
    warm = steps // 4
    for now, ids in enumerate(stream):
        before = _hashindex.stats(config, state, now)["hits"]
        hi, lo = _hashindex.split_ids(np.pad(ids, (0, size - len(ids)), constant_values=-1))
        valid = np.arange(size) < len(ids)
        state = step(state, hi, lo, valid, jnp.int32(now))
        got = int(_hashindex.stats(config, state, now)["hits"]) - int(before)
        exact = 0
        for i in ids.tolist():
            if i in lru:
                exact += 1
                lru.move_to_end(i)
            else:
                lru[i] = True
                if len(lru) > capacity:
                    lru.popitem(last=False)
        if now >= warm:
            hits, exact_hits, total = hits + got, exact_hits + exact, total + len(ids)
    return {
        "capacity": capacity,
        "distinct_in_stream": distinct,
        "bucket_lru_hit_rate": hits / total,
        "exact_lru_hit_rate": exact_hits / total,
        "difference_points": 100 * (exact_hits - hits) / total,
    }


def tpu_bytes(topology: str, dim: int, min_count: int = 1) -> dict:
    from jax_tpu_embed import _aot

    topo = _aot.topology(topology)
    out = {}
    runs = (("static", False, True), ("dynamic", True, True), ("dynamic_unstacked", True, False))
    for label, dynamic, stacking in runs:
        tables = [
            jte.TableConfig(
                None if dynamic else 1_000_000,
                dim,
                combiner="sum",
                name=f"t{i}",
                dynamic=jte.DynamicTable(capacity=1_000_000, min_count=min_count)
                if dynamic
                else None,
            )
            for i in range(8)
        ]
        spec = jte.EmbeddingSpec(
            {f"t{i}": jte.FeatureConfig(t) for i, t in enumerate(tables)},
            jte.Adagrad(learning_rate=0.05),
        )
        emb = jte.Embedding(spec, _aot.mesh(topo), stacking=stacking)
        if not stacking and "dynamic" in out and out["dynamic"]["stacks"] == len(tables):
            continue  # Nothing stacks (all-gather routing): the same step.
        r = _aot.compile_train_step(emb, 1024 * emb.num_shards, 20, topo=topo)
        out[label] = {
            "bytes_accessed_per_device": r.bytes_accessed,
            "temp_bytes": r.temp_bytes,
            "fits": r.fits,
            "unaliased_state": r.unaliased_state,
            "collectives": len(r.collectives),
            "stacks": len(emb.stacks),
            # XLA ops only (Pallas calls carry no estimate); the longest fixed-trip loop
            # flags a gather or scatter written as one window an iteration.
            "estimated_cycles": r.estimated_cycles,
            "longest_loop_trips": max((loop.trips for loop in r.loops), default=0),
        }
    out["ratio"] = (
        out["dynamic"]["bytes_accessed_per_device"] / out["static"]["bytes_accessed_per_device"]
    )
    return out


def checkpoint_times(capacity: int, dim: int = 64, occupancy: float = 0.8, repeats: int = 3):
    """Seconds to save one dynamic table (Adagrad, `occupancy` of `capacity` held, every
    device of this process a shard) with `jte.checkpoint` and to restore it onto the same
    mesh (each shard reads its own block), onto half the devices (each shard reads two
    blocks) and onto twice the capacity (each shard reads its block, whose entries go to
    their shards in the new index): the best of `repeats`, and the item's bytes."""
    import shutil
    import tempfile

    from jax_tpu_embed import checkpoint

    devices = jax.devices()

    def embedding(n, capacity=capacity):
        table = jte.TableConfig(
            dim=dim, name="t", dynamic=jte.DynamicTable(capacity=capacity, bucket_size=64)
        )
        spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.Adagrad(0.1))
        return jte.Embedding(spec, Mesh(np.array(devices[:n]), ("shard",)))

    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, int(capacity * occupancy), np.int64))
    rows = rng.normal(size=(len(ids), dim)).astype(np.float32)
    emb = embedding(len(devices))
    # Buckets hold at most 64: drop the ids of overfull buckets (a few at 0.8).
    hi, lo = _hashindex.split_ids(ids)
    g = np.asarray(_hashindex.global_bucket(emb.dynamic["t"].index, hi, lo))
    order = np.argsort(g, kind="stable")
    lane = np.empty_like(g)
    lane[order] = np.arange(len(g)) - np.searchsorted(g[order], g[order])
    ids, rows = ids[lane < 64], rows[lane < 64]
    state = emb.restore_tables({"t": jte.DynamicRows(ids, rows)})
    out: dict[str, float] = {"capacity": capacity, "held": len(ids), "dim": dim}
    out["devices"] = len(devices)
    out["item_mb"] = len(ids) * (8 + 8 + 2 * 4 * dim) / 1e6
    half, larger = embedding(max(len(devices) // 2, 1)), embedding(len(devices), 2 * capacity)
    best = collections.defaultdict(lambda: float("inf"))
    for _ in range(repeats):
        path = tempfile.mkdtemp(prefix="jte_ckpt_bench_")
        try:
            t0 = time.perf_counter()
            checkpoint.save(path, emb, state)
            best["save_s"] = min(best["save_s"], time.perf_counter() - t0)
            ontos = (("restore_same_s", emb), ("restore_half_s", half))
            for key, onto in ontos + (("restore_capacity_s", larger),):
                t0 = time.perf_counter()
                restored, _ = checkpoint.restore(path, onto)
                jax.block_until_ready(restored)
                best[key] = min(best[key], time.perf_counter() - t0)
        finally:
            shutil.rmtree(path, ignore_errors=True)
    out.update(best)
    return out


def serving_times(
    n: int, dim: int = 64, batch: int = 4096, ids: int = 20, repeats: int = 9, tpu: str = ""
) -> dict:
    """`jte.serving.Server` lookups of a (batch, ids) batch (Zipf(1.05) positions, so with
    repeats) from a dynamic table serving n ids against a static table of n rows, the same
    rows: median ms, alternating. With `tpu`, also the TPU compiler's bytes accessed of the
    two lookups on one chip of that topology, with the tables as a TPU server holds them
    (lane-packed, `served_tables(lanes=128)`) and as they are on CPU ("_unpacked")."""
    from jax_tpu_embed import _aot, serving

    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64))
    rows = rng.standard_normal((len(keys), dim)).astype(np.float32)
    at = (rng.zipf(1.05, (batch, ids)) - 1) % len(keys)
    dynamic = jte.TableConfig(dim=dim, name="t", dynamic=jte.DynamicTable(capacity=2 * n))
    cases = {
        "static": (jte.TableConfig(len(keys), dim, name="t"), rows, at.astype(np.int32)),
        "dynamic": (dynamic, jte.DynamicRows(keys, rows), jte.split_ids(keys[at])),
    }
    servers, feats, times = {}, {}, {}
    for name, (table, served, f) in cases.items():
        spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.SGD(0.1))
        servers[name], feats[name], times[name] = serving.Server(spec, {"t": served}), f, []
        jax.block_until_ready(servers[name]({"f": f}))
    for _ in range(repeats):
        for name in cases:
            t0 = time.perf_counter()
            jax.block_until_ready(servers[name]({"f": feats[name]}))
            times[name].append(time.perf_counter() - t0)
    out: dict = {"ids": len(keys), "dim": dim, "batch": batch, "ids_per_example": ids}
    for name in cases:
        out[f"{name}_ms"] = float(np.median(times[name]) * 1e3)
    out["ratio"] = out["dynamic_ms"] / out["static_ms"]
    if tpu:
        topo = _aot.topology(tpu)
        one = NamedSharding(Mesh(np.array(topo.devices[:1]), ("d",)), P())
        abstract = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=one)
        for name in cases:
            spec = servers[name].spec
            for lanes, label in ((serving.LANES, ""), (0, "_unpacked")):
                tables = serving.served_tables(spec, servers[name].tables, lanes=lanes)
                tables = jax.tree.map(abstract, tables)
                f = jax.tree.map(abstract, {"f": feats[name]})
                lookup = jax.jit(lambda t, f, spec=spec: serving.lookup(spec, t, f))
                cost = lookup.lower(tables, f).compile().cost_analysis()
                cost = cost[0] if isinstance(cost, (list, tuple)) else cost
                out[f"{name}_tpu_bytes{label}"] = float((cost or {})["bytes accessed"])
        out["tpu_ratio"] = out["dynamic_tpu_bytes"] / out["static_tpu_bytes"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--workload", default="W0")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--occupancy", type=float, default=0.8)
    p.add_argument("--combiner", default="sum", help="the tables' combiner: sum, mean, sqrtn")
    p.add_argument(
        "--min-count",
        type=int,
        default=1,
        help="the dynamic tables' min_count (admission after that many sightings)",
    )
    p.add_argument("--eviction-occupancy", type=float, default=0.85)
    p.add_argument(
        "--eviction-steps", type=int, default=200, help="0 skips the eviction-quality run"
    )
    p.add_argument("--tpu", default=None, help="a topology, e.g. v5p:2x2x1")
    p.add_argument("--dim", type=int, default=64, help="table width for --tpu")
    p.add_argument(
        "--checkpoint",
        type=int,
        default=0,
        help="also time jte.checkpoint of a dynamic "
        "table of this capacity (and restores onto the same mesh and half of it)",
    )
    p.add_argument(
        "--serving",
        type=int,
        default=0,
        help="also time jte.serving lookups of a dynamic table serving this many ids "
        "against a static table of as many rows (with --tpu, their TPU compiler bytes too)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    wl = workloads.generate(workloads.load_config(args.workload))
    platform = jax.devices()[0].platform
    result = {"workload": args.workload, "devices": len(jax.devices()), "platform": platform}
    result["step"] = step_times(wl, args.occupancy, args.steps, args.combiner, args.min_count)
    s = result["step"]
    print(
        f"{args.workload} train step, {args.combiner} combiner, min_count {args.min_count}, "
        f"{len(jax.devices())} {platform.upper()} devices (median ms)"
    )
    print(
        f"  static {s['static_ms']:9.1f}   dynamic {s['dynamic_ms']:9.1f}   ratio {s['ratio']:.2f}x"
    )
    print(
        f"  CPU ms per step: static {s['static_cpu_ms']:6.1f}   dynamic "
        f"{s['dynamic_cpu_ms']:6.1f}   ratio {s['cpu_ratio']:.2f}x"
    )
    print(f"  dynamic capacity {s['capacity']} per table, occupancy {s['occupancy']:.2f}")
    if args.eviction_steps > 0:
        q = eviction_quality(args.eviction_occupancy, args.eviction_steps, 4096, 1_000_000)
        result["eviction"] = q
        print(
            f"eviction: capacity {q['capacity']} ({args.eviction_occupancy} of "
            f"{q['distinct_in_stream']} distinct ids), hit rate bucket LRU "
            f"{q['bucket_lru_hit_rate']:.4f}, exact LRU {q['exact_lru_hit_rate']:.4f}, "
            f"difference {q['difference_points']:.2f} points"
        )
    if args.tpu:
        result["tpu"] = tpu_bytes(args.tpu, args.dim, args.min_count)
        t = result["tpu"]
        print(
            f"TPU {args.tpu} D={args.dim}, min_count {args.min_count}: bytes accessed per "
            f"device static "
            f"{t['static']['bytes_accessed_per_device'] / 1e6:.1f} MB, dynamic "
            f"{t['dynamic']['bytes_accessed_per_device'] / 1e6:.1f} MB, ratio {t['ratio']:.2f}x; "
            f"collectives in the step static {t['static']['collectives']}, dynamic "
            f"{t['dynamic']['collectives']}; the dynamic step's XLA ops "
            f"{t['dynamic']['estimated_cycles']:,} estimated cycles, its longest loop "
            f"{t['dynamic']['longest_loop_trips']} iterations"
        )
        if "dynamic_unstacked" in t:
            u = t["dynamic_unstacked"]
            bytes_u = u["bytes_accessed_per_device"]
            ratio_u = bytes_u / t["static"]["bytes_accessed_per_device"]
            print(
                f"  dynamic tables stacked in {t['dynamic']['stacks']} arrays; with "
                f"stacking=False {bytes_u / 1e6:.1f} MB ({ratio_u:.2f}x), "
                f"{u['collectives']} collectives"
            )
    if args.checkpoint:
        c = result["checkpoint"] = checkpoint_times(args.checkpoint)
        print(
            f"checkpoint of {c['held']} held rows (capacity {c['capacity']}, D={c['dim']}, "
            f"{c['item_mb']:.0f} MB), {c['devices']} devices, best seconds: save "
            f"{c['save_s']:.2f}, restore onto the same mesh {c['restore_same_s']:.2f}, "
            f"onto half of it {c['restore_half_s']:.2f}, onto twice the capacity "
            f"{c['restore_capacity_s']:.2f}"
        )
    if args.serving:
        v = result["serving"] = serving_times(args.serving, args.dim, tpu=args.tpu or "")
        print(
            f"serving {v['ids']:,} ids of D={v['dim']}, {v['batch']} x {v['ids_per_example']} "
            f"ids a lookup (median ms): static {v['static_ms']:.1f}, dynamic "
            f"{v['dynamic_ms']:.1f}, ratio {v['ratio']:.2f}x"
        )
        if args.tpu:
            print(
                f"  TPU compiler, one {args.tpu} chip, tables lane-packed: static "
                f"{v['static_tpu_bytes'] / 1e6:,.1f} MB, dynamic "
                f"{v['dynamic_tpu_bytes'] / 1e6:,.1f} MB, ratio {v['tpu_ratio']:.2f}x; "
                f"unpacked: static "
                f"{v['static_tpu_bytes_unpacked'] / 1e6:,.1f} MB, dynamic "
                f"{v['dynamic_tpu_bytes_unpacked'] / 1e6:,.1f} MB"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
