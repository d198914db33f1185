"""The dynamic table's index on CPU: keys per second of `update` and `find` against a dict.

One device, jitted, state donated: each step hands the index U distinct ids (power-law draws
from a pool larger than the index, so buckets fill and evict), located inside the step as the
engine would. The untimed warm-up steps fill the index first. The baseline is a Python dict
doing the same per-key work in the same run: a lookup of every key, and an insert of each
missing one while there is room. The dict has no buckets, admission, eviction or TTL; it is
the floor a host-side index would start from.

    python benchmarks/hashindex_bench.py --slots 1048576 --keys 65536 --steps 5
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jax_tpu_embed import _hashindex as hx  # noqa: E402


def _batches(rng, steps: int, keys: int, pool: int):
    """`steps` arrays of exactly `keys` distinct int64 ids, power-law over a pool."""
    ids = rng.integers(0, np.iinfo(np.int64).max, pool, np.int64)
    out = []
    for _ in range(steps):
        draws = np.unique(ids[(rng.zipf(1.1, 3 * keys) - 1) % pool])
        extra = ids[rng.permutation(pool)[: 2 * keys]]
        draws = np.unique(np.concatenate([draws, extra]))[:keys]
        out.append(rng.permutation(draws))
    return out


def _time_index(config, batches, warmup: int):
    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, hi, lo, now):
        _, lb = hx.locate(config, 1, hi, lo)
        state, row, fresh = hx.update(config, state, hi, lo, lb, hi == hi, now)
        return state, row, fresh

    @jax.jit
    def lookup(state, hi, lo, now):
        _, lb = hx.locate(config, 1, hi, lo)
        return hx.find(config, state, hi, lo, lb, now)

    state = jax.tree.map(jax.numpy.asarray, hx.empty_state(config, 1))
    split = [tuple(jax.device_put(x) for x in hx.split_ids(b)) for b in batches]
    update_s, find_s = [], []
    for t, (hi, lo) in enumerate(split, start=1):
        start = time.perf_counter()
        state, row, _ = step(state, hi, lo, np.int32(t))
        jax.block_until_ready(row)
        update_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        found = lookup(state, hi, lo, np.int32(t))
        jax.block_until_ready(found)
        find_s.append(time.perf_counter() - start)
    s = {k: int(v) for k, v in hx.stats(config, state, len(batches)).items()}
    return np.median(update_s[warmup:]), np.median(find_s[warmup:]), s


def _time_dict(capacity: int, batches, warmup: int):
    table: dict[int, int] = {}
    update_s, find_s = [], []
    for batch in batches:
        keys = batch.tolist()
        start = time.perf_counter()
        rows = []
        for k in keys:
            r = table.get(k)
            if r is None and len(table) < capacity:
                r = table[k] = len(table)
            rows.append(r)
        update_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        found = [table.get(k) for k in keys]
        find_s.append(time.perf_counter() - start)
        del rows, found
    return np.median(update_s[warmup:]), np.median(find_s[warmup:])


def main():
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--slots", type=int, default=1 << 20)
    parser.add_argument("--bucket-size", type=int, default=64)
    parser.add_argument("--keys", type=int, default=1 << 16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--warmup", type=int, default=-1, help="untimed steps; -1: enough to fill the index"
    )
    parser.add_argument("--eviction", default="lru", choices=hx.EVICTIONS)
    parser.add_argument("--json", default="hashindex_bench.json")
    args = parser.parse_args()

    config = hx.IndexConfig(
        buckets=args.slots // args.bucket_size,
        bucket_size=args.bucket_size,
        eviction=args.eviction,
    )
    if args.warmup < 0:
        args.warmup = 2 * config.capacity // args.keys + 1
    rng = np.random.default_rng(0)
    batches = _batches(rng, args.warmup + args.steps, args.keys, 4 * args.slots)
    up, fi, s = _time_index(config, batches, args.warmup)
    dict_up, dict_fi = _time_dict(config.capacity, batches, args.warmup)
    rows = [
        ("index update (jit)", up),
        ("index find (jit)", fi),
        ("dict find+insert", dict_up),
        ("dict find", dict_fi),
    ]
    print(
        f"{jax.devices()[0].platform}, 1 device; {config.capacity} slots "
        f"({config.buckets} x {config.bucket_size}), {args.keys} distinct keys/step, "
        f"{args.steps} timed steps (median)"
    )
    print(f"{'what':<22}{'ms/step':>10}{'Mkeys/s':>10}")
    for name, sec in rows:
        print(f"{name:<22}{sec * 1e3:>10.1f}{args.keys / sec / 1e6:>10.2f}")
    print("index stats after the run:", s)
    result = {
        "platform": jax.devices()[0].platform,
        "slots": config.capacity,
        "bucket_size": config.bucket_size,
        "keys_per_step": args.keys,
        "eviction": args.eviction,
        "steps": args.steps,
        "ms_per_step": {name: sec * 1e3 for name, sec in rows},
        "keys_per_s": {name: args.keys / sec for name, sec in rows},
        "stats": s,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print("wrote", args.json)


if __name__ == "__main__":
    main()
