"""The dynamic table's index on CPU: keys per second of `update` and `find`, XLA and C++,
against a C++ std::unordered_map and a Python dict.

One device, jitted, state donated: each step hands the index U distinct ids (power-law draws
from a pool larger than the index, so buckets fill and evict), located inside the step as the
engine would. The untimed warm-up steps fill the index first. Both implementations of the
index run the same batches: `_hashindex` (XLA) and `_hashindex_cpu` (the C++ kernels); their
stats must agree at the end.

The baselines do the same per-key work on the same batches: a lookup of every key, and an
insert of each missing one while there is room, then a lookup of every key. One is
std::unordered_map<int64_t, int32_t> (reserved to the capacity), a tiny standalone program
compiled with the same g++ and flags as the kernels in the same run; the other a Python dict.
They have no buckets, admission, eviction or TTL: the floor a host-side index starts from.

Every path runs on one thread (the C++ ones by construction; XLA:CPU may use more threads,
so the table also gives keys per CPU-second of the process). The index timings include the
jit dispatch and the `locate` hash.

    python benchmarks/hashindex_bench.py --slots 1048576 --keys 65536 --steps 5
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jax_tpu_embed import _cpu_kernels, _hashindex_cpu  # noqa: E402
from jax_tpu_embed import _hashindex as hx  # noqa: E402

# The baseline: the same find+insert and find passes over the same batches, per step timed
# with steady_clock and the thread's CPU clock; prints the medians over the timed steps of
# "update_wall update_cpu find_wall find_cpu" (seconds) and a checksum of the rows.
_UNORDERED_MAP = r"""
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <unordered_map>
#include <vector>

static double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  if (argc != 6) return 2;
  const char* path = argv[1];
  long steps = atol(argv[2]), keys = atol(argv[3]), capacity = atol(argv[4]);
  long warmup = atol(argv[5]);
  std::vector<int64_t> ids(size_t(steps * keys));
  FILE* f = fopen(path, "rb");
  if (!f || fread(ids.data(), sizeof(int64_t), ids.size(), f) != ids.size()) return 3;
  fclose(f);
  std::unordered_map<int64_t, int32_t> table;
  table.reserve(size_t(capacity));
  std::vector<int32_t> rows(static_cast<size_t>(keys));
  std::vector<double> update_s, find_s, update_cpu, find_cpu;
  int64_t checksum = 0;
  using Clock = std::chrono::steady_clock;
  auto cpu = [] {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  };
  for (long t = 0; t < steps; ++t) {
    const int64_t* batch = ids.data() + t * keys;
    auto start = Clock::now();
    double cpu0 = cpu();
    for (long i = 0; i < keys; ++i) {
      auto it = table.find(batch[i]);
      int32_t r = -1;
      if (it != table.end()) {
        r = it->second;
      } else if (long(table.size()) < capacity) {
        r = int32_t(table.size());
        table.emplace(batch[i], r);
      }
      rows[size_t(i)] = r;
    }
    auto mid = Clock::now();
    double cpu1 = cpu();
    for (long i = 0; i < keys; ++i) {
      auto it = table.find(batch[i]);
      rows[size_t(i)] = it == table.end() ? -1 : it->second;
    }
    auto end = Clock::now();
    double cpu2 = cpu();
    for (long i = 0; i < keys; i += 97) checksum += rows[size_t(i)];
    if (t >= warmup) {
      update_s.push_back(std::chrono::duration<double>(mid - start).count());
      find_s.push_back(std::chrono::duration<double>(end - mid).count());
      update_cpu.push_back(cpu1 - cpu0);
      find_cpu.push_back(cpu2 - cpu1);
    }
  }
  printf("%.9f %.9f %.9f %.9f %lld\n", Median(update_s), Median(update_cpu), Median(find_s),
         Median(find_cpu), (long long)checksum);
  return 0;
}
"""


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


def _time_index(impl, config, batches, warmup: int):
    """Median (wall s, CPU s) of update and of find per step, and the index's stats."""

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, hi, lo, now):
        _, lb = hx.locate(config, 1, hi, lo)
        state, row, fresh = impl.update(config, state, hi, lo, lb, hi == hi, now)
        return state, row, fresh

    @jax.jit
    def lookup(state, hi, lo, now):
        _, lb = hx.locate(config, 1, hi, lo)
        return impl.find(config, state, hi, lo, lb, now)

    state = jax.tree.map(jax.numpy.asarray, hx.empty_state(config, 1))
    split = [tuple(jax.device_put(x) for x in hx.split_ids(b)) for b in batches]
    update_s, find_s = [], []
    for t, (hi, lo) in enumerate(split, start=1):
        start, cpu = time.perf_counter(), time.process_time()
        state, row, _ = step(state, hi, lo, np.int32(t))
        jax.block_until_ready(row)
        update_s.append((time.perf_counter() - start, time.process_time() - cpu))
        start, cpu = time.perf_counter(), time.process_time()
        found = lookup(state, hi, lo, np.int32(t))
        jax.block_until_ready(found)
        find_s.append((time.perf_counter() - start, time.process_time() - cpu))
    s = {k: int(v) for k, v in hx.stats(config, state, len(batches)).items()}
    median = lambda x: tuple(np.median(np.asarray(x[warmup:]), axis=0))
    return median(update_s), median(find_s), s


def _time_unordered_map(capacity: int, batches, warmup: int):
    """Median (wall s, CPU s) per step of the std::unordered_map baseline: find+insert, find."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        return None
    flags = ["-O3", "-std=c++17", *_cpu_kernels._cpu_flags()]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe, ids = (pathlib.Path(tmp) / n for n in ("map.cc", "map", "ids.bin"))
        src.write_text(_UNORDERED_MAP)
        subprocess.run([cxx, *flags, str(src), "-o", str(exe)], check=True)
        np.stack(batches).astype(np.int64).tofile(ids)
        argv = [exe, ids, len(batches), batches[0].size, capacity, warmup]
        out = subprocess.run(
            [str(a) for a in argv],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
    return (float(out[0]), float(out[1])), (float(out[2]), float(out[3]))


def _time_dict(capacity: int, batches, warmup: int):
    """Median (wall s, CPU s) per step of the Python dict baseline: find+insert, find."""
    table: dict[int, int] = {}
    update_s, find_s = [], []
    for batch in batches:
        keys = batch.tolist()
        start, cpu = time.perf_counter(), time.process_time()
        rows = []
        for k in keys:
            r = table.get(k)
            if r is None and len(table) < capacity:
                r = table[k] = len(table)
            rows.append(r)
        update_s.append((time.perf_counter() - start, time.process_time() - cpu))
        start, cpu = time.perf_counter(), time.process_time()
        found = [table.get(k) for k in keys]
        find_s.append((time.perf_counter() - start, time.process_time() - cpu))
        del rows, found
    median = lambda x: tuple(np.median(np.asarray(x[warmup:]), axis=0))
    return median(update_s), median(find_s)


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
    parser.add_argument("--json", default="bench_results/hashindex_bench.json")
    parser.add_argument(
        "--skip-xla", action="store_true", help="time only the C++ index and the baselines"
    )
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
    rows = []  # (name, wall s, CPU s)
    stats = {}
    impls = {"C++": _hashindex_cpu} if _hashindex_cpu.available() else {}
    if not args.skip_xla:
        impls = {"XLA": hx, **impls}
    for name, impl in impls.items():
        up, fi, stats[name] = _time_index(impl, config, batches, args.warmup)
        rows += [(f"index update ({name})", *up), (f"index find ({name})", *fi)]
    if len(stats) == 2:
        assert stats["XLA"] == stats["C++"], stats  # the same index, step for step
    umap = _time_unordered_map(config.capacity, batches, args.warmup)
    if umap is not None:
        rows += [("unordered_map find+insert", *umap[0]), ("unordered_map find", *umap[1])]
    dict_up, dict_fi = _time_dict(config.capacity, batches, args.warmup)
    rows += [("dict find+insert", *dict_up), ("dict find", *dict_fi)]
    per_s = {name: args.keys / wall for name, wall, _ in rows}
    per_cpu_s = {name: args.keys / cpu for name, _, cpu in rows}
    print(
        f"{jax.devices()[0].platform}, 1 device; {config.capacity} slots "
        f"({config.buckets} x {config.bucket_size}), {args.keys} distinct keys/step, "
        f"{args.steps} timed steps (median)"
    )
    print(f"{'what':<27}{'ms/step':>10}{'Mkeys/s':>10}{'Mkeys/CPU-s':>13}")
    for name, wall, _ in rows:
        print(f"{name:<27}{wall * 1e3:>10.2f}{per_s[name] / 1e6:>10.2f}", end="")
        print(f"{per_cpu_s[name] / 1e6:>13.2f}")
    # Ratios of keys per CPU-second (per core; the machine may be shared) and of wall keys/s.
    pairs = [
        ("C++ find / unordered_map find", "index find (C++)", "unordered_map find"),
        (
            "C++ update / unordered_map find+insert",
            "index update (C++)",
            "unordered_map find+insert",
        ),
        ("C++ update / XLA update", "index update (C++)", "index update (XLA)"),
        ("C++ find / XLA find", "index find (C++)", "index find (XLA)"),
    ]
    ratios = {
        name: {"per_cpu_s": per_cpu_s[a] / per_cpu_s[b], "per_wall_s": per_s[a] / per_s[b]}
        for name, a, b in pairs
        if a in per_s and b in per_s
    }
    print(f"{'ratio of keys/s':<42}{'per CPU-s':>10}{'wall':>8}")
    for name, r in ratios.items():
        print(f"{name:<42}{r['per_cpu_s']:>9.2f}x{r['per_wall_s']:>7.2f}x")
    s = next(iter(stats.values()), {})
    print("index stats after the run:", s)
    result = {
        "platform": jax.devices()[0].platform,
        "slots": config.capacity,
        "bucket_size": config.bucket_size,
        "keys_per_step": args.keys,
        "eviction": args.eviction,
        "steps": args.steps,
        "ms_per_step": {name: wall * 1e3 for name, wall, _ in rows},
        "keys_per_s": per_s,
        "keys_per_cpu_s": per_cpu_s,
        "ratios": ratios,
        "stats": s,
    }
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print("wrote", args.json)


if __name__ == "__main__":
    main()
