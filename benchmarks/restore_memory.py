"""Host memory of restoring a dynamic table's checkpoint on several processes.

    python benchmarks/restore_memory.py                     # 2 processes x 4 CPU devices
    python benchmarks/restore_memory.py --capacity 4194304 --json out.json

Each process (`jax.distributed` with gloo collectives on loopback, as the multi-host tests
run) fills one dynamic table (Adagrad, `--occupancy` of `--capacity` held, D = `--dim`) by
`restore_tables`, saves it with `jte.checkpoint`, and restores it onto the same capacity
(each shard reads its own block) and onto twice the capacity (other buckets). For each
restore it reports the peak of the NumPy and Python memory the process allocated during the
call (`tracemalloc`, which NumPy reports its buffers to) and the seconds it took, per
process, against the item's bytes: what a host must hold to restore a table, which for a
table of 10^9 rows decides whether the restore can run at all.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import tracemalloc

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(args) -> None:
    import jax
    import numpy as np

    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    # The multi-host tests' start: gloo on loopback.
    from _multihost_worker import join  # pyright: ignore[reportMissingImports]

    join(args.port, args.processes, args.process_id, init_timeout=120)
    import jax_tpu_embed as jte
    from jax_tpu_embed import _hashindex, checkpoint

    mesh = jax.make_mesh((jax.device_count(),), ("shard",))

    def embedding(capacity: int) -> jte.Embedding:
        dynamic = jte.DynamicTable(capacity=capacity, bucket_size=64)
        table = jte.TableConfig(dim=args.dim, name="t", dynamic=dynamic)
        spec = jte.EmbeddingSpec({"f": jte.FeatureConfig(table)}, jte.Adagrad(0.1))
        return jte.Embedding(spec, mesh)

    emb = embedding(args.capacity)
    rng = np.random.default_rng(0)  # The same ids and rows on every process.
    held = int(args.capacity * args.occupancy)
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, held, np.int64))
    g = np.asarray(_hashindex.global_bucket(emb.dynamic["t"].index, *jte.split_ids(ids)))
    order = np.argsort(g, kind="stable")  # Buckets hold 64: drop overfull buckets' ids.
    lane = np.empty_like(g)
    lane[order] = np.arange(len(g)) - np.searchsorted(g[order], g[order])
    ids = ids[lane < 64]
    rows = rng.normal(size=(len(ids), args.dim)).astype(np.float32)
    state = emb.restore_tables({"t": jte.DynamicRows(ids, rows)})
    del rows
    checkpoint.save(args.directory, emb, state)
    del state
    out = {"held": len(ids), "item_mb": len(ids) * (8 + 8 + 2 * 4 * args.dim) / 1e6}
    for key, capacity in (("same", args.capacity), ("twice", 2 * args.capacity)):
        onto = embedding(capacity)
        tracemalloc.start()
        t0 = time.perf_counter()
        restored, _ = checkpoint.restore(args.directory, onto)
        jax.block_until_ready(restored)
        seconds = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert int(onto.dynamic_stats(restored)["t"]["held"]) == len(ids)
        out[f"restore_{key}_peak_mb"] = peak / 1e6
        out[f"restore_{key}_s"] = seconds
        del restored
    print("RESULT " + json.dumps({"process": jax.process_index(), **out}), flush=True)
    jax.distributed.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=4, help="CPU devices a process")
    parser.add_argument("--capacity", type=int, default=1 << 20)
    parser.add_argument("--occupancy", type=float, default=0.8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--directory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.process_id is not None:
        return worker(args)

    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}",
    }
    with tempfile.TemporaryDirectory(prefix="jte_restore_memory_") as directory:
        common = [sys.executable, __file__, "--port", str(port), "--directory", directory]
        for flag in ("processes", "capacity", "occupancy", "dim"):
            common += [f"--{flag}", str(getattr(args, flag))]
        procs = [
            subprocess.Popen(
                common + ["--process-id", str(i)], env=env, stdout=subprocess.PIPE, text=True
            )
            for i in range(args.processes)
        ]
        outputs = [p.communicate(timeout=3600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
    results = [
        json.loads(line[len("RESULT ") :])
        for text in outputs
        for line in text.splitlines()
        if line.startswith("RESULT ")
    ]
    head = ("process", "item MB", "same: peak MB", "s", "twice: peak MB", "s")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (8, 8, 14, 6, 15, 6))))
    for r in sorted(results, key=lambda r: r["process"]):
        print(
            f"{r['process']:>8} {r['item_mb']:>8.1f} {r['restore_same_peak_mb']:>14.1f} "
            f"{r['restore_same_s']:>6.2f} {r['restore_twice_peak_mb']:>15.1f} "
            f"{r['restore_twice_s']:>6.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "processes": results}, f, indent=1)


if __name__ == "__main__":
    main()
