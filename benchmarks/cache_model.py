"""A model of a device cache of hot rows for tables in host memory: miss rate against size.

    python benchmarks/cache_model.py                    # W1's id law, 1M rows, 200 steps
    python benchmarks/cache_model.py --steps 50 --quick

Every step touches the distinct rows of one batch of one W1 table (4,096 examples x 20 ids
of the truncated power law P(r) ~ (r+1)^-1.05 over 1M rows, benchmarks/workloads.py). A cache
of C rows serves them; a row not in it is a miss (fetched from host memory), then cached.
Rows touched in the current step are never evicted in it (they are in use), so a set whose
ways are all in use takes no more rows that step (the row bypasses the cache: a miss).
Policies, each simulated over the same stream:

- `exact LRU`: one global least-recently-used order (the reference).
- `W-way LRU`: set-associative, the set a hash of the row, LRU within the set; FBGEMM's UVM
  cache is 32-way (64 on ROCm); the dynamic tables' buckets hold 64.

With `--engine`, the same stream also runs through jte's own cache (`HostCached`, one
device, the XLA backend on the CPU), whose update counts its misses (`cache_stats`): the
model's W-way policy is the policy jte implements, so the two columns agree row for row.

With `--criteo FILES`, the streams are Criteo click logs instead (`jte.data.criteo`, ids
mapped to rows by MLPerf's rule, x mod V, with the vocabulary sizes of
configs/criteo_1tb_dcnv2.yaml): one stream per feature whose table has at least
`--min-rows` rows (the tables worth keeping in host memory), each step the distinct rows of
one batch, and the cache sizes fractions of the rows the stream touches (a few files touch
a small part of a 40M-row table).

    python benchmarks/cache_model.py --criteo day_0.gz --batch 65536 --steps 400

The issue's target for the cache: within 1 point of exact LRU of the same size. Prints a
table of miss rates (after a warm-up of a quarter of the steps) and writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import workloads as workloads_mod  # noqa: E402


def stream(vocab: int, batch: int, length: int, steps: int, seed: int = 0) -> list[np.ndarray]:
    """The distinct rows of each step's batch (W1's law, a fixed random row permutation)."""
    rng = np.random.default_rng(seed)
    cdf = workloads_mod.power_law_cdf(vocab)
    perm = rng.permutation(vocab)
    return [
        np.unique(perm[workloads_mod.sample_ranks(cdf, (batch, length), rng)]) for _ in range(steps)
    ]


CRITEO_CONFIG = os.path.join(HERE, os.pardir, "configs", "criteo_1tb_dcnv2.yaml")


def criteo_streams(
    files: list[str], batch: int, steps: int, min_rows: int
) -> dict[str, tuple[int, list[np.ndarray]]]:
    """{feature: (its table's rows V, the distinct rows of each of up to `steps` batches)}
    of the Criteo features whose table in configs/criteo_1tb_dcnv2.yaml has >= min_rows
    rows, read from `files` with x mod V (MLPerf's rule)."""
    import jax_tpu_embed as jte

    spec = jte.load_spec(CRITEO_CONFIG)
    tables = spec.tables()
    vocab = [
        int(tables[f"cat_{j}"].vocabulary_size or 0) for j in range(len(jte.data.SPARSE_NAMES))
    ]
    kept = {name: v for name, v in zip(jte.data.SPARSE_NAMES, vocab) if v >= min_rows}
    if not kept:
        raise SystemExit(f"cache_model: no Criteo table has >= {min_rows:,} rows (--min-rows).")
    out: dict[str, tuple[int, list[np.ndarray]]] = {name: (v, []) for name, v in kept.items()}
    for k, b in enumerate(jte.data.criteo(files, batch, vocab, id_mapping="mod")):
        if k == steps:
            break
        for name in kept:
            out[name][1].append(np.unique(np.asarray(b["sparse"][name], np.int64)))
    if not out[next(iter(kept))][1]:
        raise SystemExit(f"cache_model: {files} hold no full batch of {batch} lines.")
    return out


def miss_rates(
    steps: list[np.ndarray], capacities: list[int], ways: list[int], vocab: int | None = None
) -> list[dict]:
    """Per cache size: the miss rate (misses over rows touched after a warm-up of a quarter
    of the steps) of exact LRU and of each W-way LRU, and with `vocab` of jte's own cache
    of a table of that many rows (`engine`)."""
    warm = len(steps) // 4
    touched = sum(int(r.size) for r in steps[warm:])
    rows = []
    for capacity in capacities:
        entry: dict = {"cache_rows": capacity}
        entry["exact LRU"] = sum(exact_lru(steps, capacity)[warm:]) / touched
        for w in ways:
            entry[f"{w}-way LRU"] = sum(set_associative(steps, capacity, w)[warm:]) / touched
            if vocab is not None:
                entry[f"jte {w}-way"] = sum(engine(steps, vocab, capacity, w)[warm:]) / touched
        rows.append(entry)
    return rows


def print_rates(rows: list[dict], ways: list[int], engine_run: bool) -> None:
    names = ["exact LRU"] + [f"{w}-way LRU" for w in ways]
    names += [f"jte {w}-way" for w in ways] if engine_run else []
    print(f"{'cache':>16s} " + " ".join(f"{n:>12s}" for n in names) + "   worst gap")
    for e in rows:
        gap = max(e[n] - e["exact LRU"] for n in names[1:])
        cells = " ".join(f"{100 * e[n]:>11.2f}%" for n in names)
        print(f"{e['cache_rows']:>9,} ({e['fraction']:.0%}) {cells}   {100 * gap:+.2f} pts")


def exact_lru(steps: list[np.ndarray], capacity: int) -> list[int]:
    """Misses per step of one global LRU order of `capacity` rows."""
    order: collections.OrderedDict = collections.OrderedDict()
    misses = []
    for rows in steps:
        miss = 0
        for r in rows.tolist():
            if r in order:
                order.move_to_end(r)
            else:
                miss += 1
                order[r] = None
        # Evict after the step: the step's own rows are all in use until it ends.
        while len(order) > capacity:
            order.popitem(last=False)
        misses.append(miss)
    return misses


def _mix(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash (murmur3's finalizer): the set of a row."""
    x = x.astype(np.uint32)
    x ^= x >> 16
    x *= np.uint32(0x85EBCA6B)
    x ^= x >> 13
    x *= np.uint32(0xC2B2AE35)
    x ^= x >> 16
    return x


def set_associative(steps: list[np.ndarray], capacity: int, ways: int) -> list[int]:
    """Misses per step of a `ways`-way set-associative LRU cache of `capacity` rows."""
    sets = max(1, -(-capacity // ways))  # Rounded up to whole sets, as HostCached does.
    tags = np.full((sets, ways), -1, np.int64)
    last = np.full((sets, ways), -1, np.int64)
    misses = []
    for now, rows in enumerate(steps):
        s = (_mix(rows) % np.uint32(sets)).astype(np.int64)
        found = tags[s] == rows[:, None]
        hit = found.any(axis=1)
        way = found.argmax(axis=1)
        last[s[hit], way[hit]] = now
        m_rows, m_sets = rows[~hit], s[~hit]
        misses.append(int(m_rows.size))
        if not m_rows.size:
            continue
        # The r-th miss of a set takes its set's r-th least recently used way, if that way
        # was not used in this step; else the row bypasses the cache.
        order = np.argsort(m_sets, kind="stable")
        m_rows, m_sets = m_rows[order], m_sets[order]
        first = np.searchsorted(m_sets, m_sets, side="left")
        rank = np.arange(m_sets.size) - first
        ok = rank < ways
        m_rows, m_sets, rank = m_rows[ok], m_sets[ok], rank[ok]
        victims = np.argsort(last[m_sets], axis=1, kind="stable")[np.arange(m_sets.size), rank]
        free = last[m_sets, victims] < now
        tags[m_sets[free], victims[free]] = m_rows[free]
        last[m_sets[free], victims[free]] = now
    return misses


def engine(steps: list[np.ndarray], vocab: int, capacity: int, ways: int) -> list[int]:
    """Misses per step of jte's HostCached cache of `capacity` rows and `ways` ways, one
    device, each step an update of its distinct rows (no prefetch)."""
    import jax

    import jax_tpu_embed as jte

    table = jte.TableConfig(
        vocab, 8, name="t", combiner="sum", placement=jte.HostCached(capacity, ways=ways)
    )
    spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.SGD(0.1))
    mesh = jax.make_mesh((1,), ("shard",), devices=jax.devices()[:1])
    emb = jte.Embedding(spec, mesh, backend="xla", lane_width=0)
    state = emb.init(jax.random.key(0))
    width = max(int(r.size) for r in steps)
    grads = {"f": np.ones((width, 8), np.float32)}
    misses, before = [], 0
    for rows in steps:
        ids = np.full((width,), -1, np.int64)
        ids[: rows.size] = rows
        state = emb.apply_gradients(state, {"f": ids}, grads)
        total = int(emb.cache_stats(state)["t"]["misses"])
        misses.append(total - before)
        before = total
    return misses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--vocab", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--length", type=int, default=20)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument(
        "--fractions",
        default="0.05,0.1,0.2,0.4",
        help="cache sizes as fractions of the vocabulary",
    )
    p.add_argument("--ways", default="16,32,64")
    p.add_argument("--quick", action="store_true", help="a small stream: a smoke run")
    p.add_argument(
        "--engine", action="store_true", help="also run jte's HostCached cache on the stream"
    )
    p.add_argument(
        "--criteo",
        nargs="+",
        default=None,
        metavar="FILE",
        help="Criteo click-log files: streams of their large features instead of W1's law",
    )
    p.add_argument(
        "--min-rows",
        type=int,
        default=1_000_000,
        help="with --criteo: the features whose table has at least this many rows",
    )
    p.add_argument("--out", default="bench_results/cache_model.json")
    args = p.parse_args(argv)
    if args.quick:
        args.vocab, args.batch, args.steps = 20_000, 256, 24
    start = time.perf_counter()
    fractions = [float(f) for f in args.fractions.split(",")]
    ways = [int(w) for w in args.ways.split(",")]
    warm = args.steps // 4

    def sized(steps, of: int, vocab: int) -> list[dict]:
        capacities = [max(1, int(f * of)) for f in fractions]
        rows = miss_rates(steps, capacities, ways, vocab if args.engine else None)
        for e, f in zip(rows, fractions):
            e["fraction"] = f
        return rows

    result: dict = {"batch": args.batch, "steps": args.steps, "warmup_steps": warm}
    if args.criteo:
        result["files"] = args.criteo
        result["features"] = {}
        for name, (vocab, steps) in criteo_streams(
            args.criteo, args.batch, args.steps, args.min_rows
        ).items():
            seen = len(np.unique(np.concatenate(steps)))
            distinct = np.mean([r.size for r in steps])
            print(
                f"Criteo {name} (table of {vocab:,} rows), {len(steps)} batches of "
                f"{args.batch}: {seen:,} rows touched, {distinct:,.0f} distinct a batch; "
                f"cache sizes as fractions of the rows touched"
            )
            rows = sized(steps, seen, vocab)
            print_rates(rows, ways, args.engine)
            result["features"][name] = {
                "vocab": vocab,
                "rows_touched": seen,
                "batches": len(steps),
                "distinct_rows_per_step": float(distinct),
                "miss_rates": rows,
            }
    else:
        steps = stream(args.vocab, args.batch, args.length, args.steps)
        rows = sized(steps, args.vocab, args.vocab)
        distinct = np.mean([r.size for r in steps])
        print(
            f"W1 law over {args.vocab:,} rows, batch {args.batch} x {args.length}: "
            f"{distinct:,.0f} distinct rows per step; miss rates after {warm} warm-up steps"
        )
        print_rates(rows, ways, args.engine)
        result.update(
            vocab=args.vocab,
            ids_per_example=args.length,
            distinct_rows_per_step=float(distinct),
            miss_rates=rows,
        )
    result["seconds"] = time.perf_counter() - start
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
