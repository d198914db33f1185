"""What the TPU compiler charges the dynamic-table index's access patterns, op by op.

    python benchmarks/hashindex_tpu_ops.py               # v5p:2x2x1, prints a table
    python benchmarks/hashindex_tpu_ops.py --json out.json

No TPU needed (shared/TPU_AOT.md). Compiles for one device of the topology, with U ids
against one shard of a 1M-slot index (buckets of 64 uint32 slots): `_hashindex.find`, the
Pallas `find` (`_hashindex_tpu`), `sighted`'s score writes (windowed scatters, and the Pallas
kernel) and `_hashindex.update` whole, then access patterns: the
2-D row gathers and point scatters the index was first built of, and the flat windows,
scatters into fresh arrays and sorts it is built of now; and `find` on keys stored in two
arrays (hi, lo) as they were before they were block-interleaved (bucket g's 64 hi words,
then its 64 lo words). The compiler's "bytes accessed" per id. These are the numbers
behind docs/design.md "Dynamic tables" (TPU: not yet efficient).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, SingleDeviceSharding  # noqa: E402

from jax_tpu_embed import (
    _aot,  # noqa: E402
    _hashindex_tpu,  # noqa: E402
)
from jax_tpu_embed import _hashindex as hx  # noqa: E402

SLOTS, BUCKET = 1_000_448, 64  # 3,908 buckets a shard of four: an even number.


def measure(topology: str, ids: int) -> list[dict]:
    device = _aot.topology(topology).devices[0]
    sharding = SingleDeviceSharding(device)
    nb = SLOTS // BUCKET // 4  # One shard of four.
    u = ids

    def spec(shape, dtype=jnp.uint32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def cost(fn, *args, donate=()):
        # Under a mesh of the device: Pallas' TPU lowering reads the chip from it.
        with jax.set_mesh(Mesh(np.array([device]), ("one",))):
            compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        c = compiled.cost_analysis()
        c = c[0] if isinstance(c, (list, tuple)) else c
        return float((c or {}).get("bytes accessed", 0.0))

    config = hx.IndexConfig(buckets=nb, bucket_size=BUCKET)
    rows, words = spec((nb, BUCKET)), spec((u,))
    state = hx.IndexState(
        keys=spec((nb * 2 * BUCKET,)),
        last=spec((nb * BUCKET,), jnp.int32),
        count=spec((nb * BUCKET,), jnp.int32),
        filter_keys=spec((0,)),
        filter_count=spec((0,), jnp.int32),
        filter_last=spec((0,), jnp.int32),
        stats=spec((1, len(hx.STAT_NAMES)), jnp.int32),
    )
    at, valid = spec((u,), jnp.int32), spec((u,), jnp.bool_)
    flat = spec((nb * BUCKET,))
    keys = spec((nb * 2 * BUCKET,))

    def find_two_arrays(hi_flat, lo_flat, hi, lo, lb):
        # `find` as it was before the keys were interleaved: a 64-word window of each array.
        k_hi, k_lo = hx._rows(hi_flat, lb * BUCKET, BUCKET), hx._rows(lo_flat, lb * BUCKET, BUCKET)
        match = (k_hi == hi[:, None]) & (k_lo == lo[:, None])
        lane = jnp.max(jnp.where(match, lax.broadcasted_iota(jnp.int32, match.shape, 1), -1), 1)
        return jnp.where(lane >= 0, lb * BUCKET + lane, -1)

    def two_windows(hi_flat, lo_flat, lb):
        k_hi = hx._rows(hi_flat, lb * BUCKET, BUCKET)
        return (k_hi ^ hx._rows(lo_flat, lb * BUCKET, BUCKET)).sum(1)

    def window_scores(s, lb, lane, hit):
        # `sighted`'s writes of its hits without the kernel: one window per run of a bucket.
        groups = min(u, nb + 1)
        group, group_bucket = hx._runs(lb, groups, nb)
        first = jnp.minimum(group_bucket, nb - 1) * BUCKET
        hits = hx._spread(groups, BUCKET, group, lane, {}, hit)["set"]
        write = hits.any(1) & (group_bucket < nb)
        last = hx._put_rows(s.last, first, jnp.where(hits, 5, -(2**31)), write, "max")
        return last, hx._put_rows(s.count, first, hits.astype(jnp.int32), write, "add")

    dn = lax.ScatterDimensionNumbers(
        update_window_dims=(1,), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,)
    )
    cases = [
        (
            "find (whole)",
            lambda s, h, lo, b: hx.find(config, s, h, lo, b, 5),
            (state, words, words, at),
            (),
        ),
        (
            "find (Pallas, `_hashindex_tpu`)",
            lambda s, h, lo, b: _hashindex_tpu.find(config, s, h, lo, b, 5),
            (state, words, words, at),
            (),
        ),
        (
            "find (Pallas), ids sorted by bucket (an update's)",
            lambda s, h, lo, b: _hashindex_tpu.find(config, s, h, lo, b, 5, grouped=True),
            (state, words, words, at),
            (),
        ),
        (
            "score writes (windowed scatters)",
            lambda s, b, lane, h: window_scores(s, b, lane, h),
            (state, at, at, valid),
            (0,),
        ),
        (
            "score writes (Pallas, ids sorted by bucket)",
            lambda s, b, lane, h: _hashindex_tpu.scores(config, s, b, lane, h, 5),
            (state, at, at, valid),
            (0,),
        ),
        (
            "place (XLA)",
            lambda s, h, lo, b, v: hx.place(config, s, h, lo, b, v, 5),
            (state, words, words, at, valid),
            (0,),
        ),
        (
            "place (Pallas, ids sorted by bucket and priority)",
            lambda s, h, lo, b, v: _hashindex_tpu.place(config, s, h, lo, b, v, 5),
            (state, words, words, at, valid),
            (0,),
        ),
        (
            "update (whole)",
            lambda s, h, lo, b, v: hx.update(config, s, h, lo, b, v, 5),
            (state, words, words, at, valid),
            (0,),
        ),
        (
            "find, keys in two arrays (hi, lo: as before)",
            find_two_arrays,
            (flat, flat, words, words, at),
            (),
        ),
        ("two 64-word windows combined lane by lane", two_windows, (flat, flat, at), ()),
        (
            "one 128-word window, summed",
            lambda a, i: hx._rows(a, i * 2 * BUCKET, 2 * BUCKET).sum(1),
            (keys, at),
            (),
        ),
        ("(U, 64) row gather of a (buckets, 64) array", lambda a, i: a[i], (rows, at), ()),
        (
            "point scatter into a donated (buckets, 64) array",
            lambda a, i, v: a.reshape(-1).at[i].set(v, mode="drop"),
            (rows, at, words),
            (0,),
        ),
        ("1-D gather", lambda a, i: a[i], (flat, at), ()),
        (
            "64-word window gather of a flat array",
            lambda a, i: jax.vmap(lambda s: lax.dynamic_slice(a, (s,), (BUCKET,)))(i),
            (flat, at),
            (),
        ),
        (
            "64-word window scatter into a donated flat array",
            lambda a, i, v: lax.scatter(a, i[:, None], v, dn, mode="drop", unique_indices=True),
            (flat, at, spec((u, BUCKET))),
            (0,),
        ),
        (
            "scatter into a fresh zero array",
            lambda i, v: jnp.zeros(nb * BUCKET, jnp.uint32).at[i].set(v, mode="drop"),
            (at, words),
            (),
        ),
        (
            "sort of (U,) x 4 operands",
            lambda a, b, c, d: lax.sort((a, b, c, d), num_keys=3),
            (words, words, words, at),
            (),
        ),
        ("nonzero (size U / 2)", lambda v: jnp.nonzero(v, size=u // 2)[0], (valid,), ()),
    ]
    out = []
    for name, fn, args, donate in cases:
        b = cost(fn, *args, donate=donate)
        out.append({"op": name, "bytes_accessed": b, "bytes_per_id": b / u})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--ids", type=int, default=20_480)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = measure(args.topology, args.ids)
    print(f"{args.topology}, one device, {args.ids} ids, buckets of {BUCKET} uint32 slots")
    for r in rows:
        print(f"  {r['op']:52s} {r['bytes_per_id'] / 1024:8.2f} KiB per id")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"topology": args.topology, "ids": args.ids, "ops": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
