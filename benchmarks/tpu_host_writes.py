"""Which forms of a host-memory write the TPU compiler accepts in place: the facts a
write-back cache for `HostCached` tables must be built on.

    python benchmarks/tpu_host_writes.py               # v5p:2x2x1, prints a table
    python benchmarks/tpu_host_writes.py --json out.json

No TPU needed (shared/TPU_AOT.md). A write-back cache writes to host memory only the rows
it evicts, a number known at run time, so it needs a host write whose size depends on the
data: rounds in a `while` loop, or a `cond` / `switch` between sizes. For one (V, 128) f32
`pinned_host` array, donated, and N rows to write on one device of the topology, each form
below is compiled, and the table reports whether it compiles, whether the host array is
aliased (written in place, not copied) and how many host computations it makes:

- one plain `compute_on("device_host")` scatter of all N rows (what a write-through
  update does), and two in a row;
- rounds of M rows in a `while_loop` carrying the host array;
- `cond`s, one per round, carrying the host array (the false branch returns it, or runs
  a host computation of its own);
- one `switch` over sizes (0, M or N rows), alone, twice in a row, after a plain
  scatter, and for two arrays at once.
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
from jax import lax  # noqa: E402
from jax.experimental.compute_on import compute_on  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from jax_tpu_embed import _aot  # noqa: E402

V, D, N, M = 100_000, 128, 4096, 512


def _store(h, i, r):
    return h.at[i].set(r, mode="drop")


def _write(h, i, r):
    """One host computation writing rows `r` at `i` (moved to the host first)."""
    i, r = (jax.device_put(x, jax.memory.Space.Host) for x in (i, r))
    return compute_on("device_host")(jax.jit(_store))(h, i, r)


def _touch(h):
    """A host computation that writes nothing new (a branch that must stay on the host)."""
    return compute_on("device_host")(jax.jit(lambda h: h.at[0].set(h[0])))(h)


def _switch(h, i, r, total):
    """Nothing, M rows or N rows, by the count to write."""
    which = jnp.where(total == 0, 0, jnp.where(total <= M, 1, 2))
    branches = [_touch, lambda h: _write(h, i[:M], r[:M]), lambda h: _write(h, i, r)]
    return lax.switch(which, branches, h)


def _forms() -> dict:
    def while_rounds(h, i, r, total):
        def body(state):
            start, h = state
            rows = (lax.dynamic_slice_in_dim(x, start, M) for x in (i, r))
            return start + M, _write(h, *rows)

        return lax.while_loop(lambda s: s[0] < total, body, (jnp.int32(0), h))[1]

    def cond_rounds(false_branch):
        def fn(h, i, r, total):
            for k in range(N // M):
                rows = (i[k * M : (k + 1) * M], r[k * M : (k + 1) * M])
                h = lax.cond(k * M < total, lambda h, rows=rows: _write(h, *rows), false_branch, h)
            return h

        return fn

    def switch_two_arrays(hs, i, r, total):
        which = jnp.where(total == 0, 0, jnp.where(total <= M, 1, 2))

        def branch(size):
            def fn(hs):
                if size == 0:
                    return [_touch(h) for h in hs]
                rows = [jax.device_put(x[:size], jax.memory.Space.Host) for x in (i, r)]
                both = jax.jit(lambda hs, i, r: [_store(h, i, r) for h in hs])
                return compute_on("device_host")(both)(hs, *rows)

            return fn

        return lax.switch(which, [branch(0), branch(M), branch(N)], list(hs))

    return {
        "plain scatter of N rows": (lambda h, i, r, t: _write(h, i, r), 1),
        "two plain scatters": (lambda h, i, r, t: _write(_write(h, i, r), i + 1, r), 1),
        "while loop of M-row rounds": (while_rounds, 1),
        "cond per round, identity else": (cond_rounds(lambda h: h), 1),
        "cond per round, host touch else": (cond_rounds(_touch), 1),
        "one switch (0 / M / N rows)": (_switch, 1),
        "two switches in a row": (lambda h, i, r, t: _switch(_switch(h, i, r, t), i + 1, r, t), 1),
        "plain scatter, then a switch": (lambda h, i, r, t: _switch(_write(h, i, r), i, r, t), 1),
        "one switch for two arrays": (switch_two_arrays, 2),
    }


def measure(topology: str) -> list[dict]:
    device = _aot.topology(topology).devices[0]
    on = lambda kind=None: SingleDeviceSharding(device, memory_kind=kind)
    host = jax.ShapeDtypeStruct((V, D), jnp.float32, sharding=on("pinned_host"))
    ids = jax.ShapeDtypeStruct((N,), jnp.int32, sharding=on())
    rows = jax.ShapeDtypeStruct((N, D), jnp.float32, sharding=on())
    total = jax.ShapeDtypeStruct((), jnp.int32, sharding=on())
    out = []
    for name, (fn, arrays) in _forms().items():
        arg = host if arrays == 1 else (host,) * arrays
        row = {"form": name, "compiles": False, "aliased": False, "host_calls": 0, "error": ""}
        try:
            compiled = jax.jit(fn, donate_argnums=0).lower(arg, ids, rows, total).compile()
        except Exception as e:  # The compiler's refusal is the finding.
            row["error"] = str(e).strip().splitlines()[0][:160]
        else:
            memory = compiled.memory_analysis()
            alias = int(getattr(memory, "host_alias_size_in_bytes", 0))
            row.update(
                compiles=True,
                aliased=alias == arrays * V * D * 4,
                host_calls=(compiled.as_text() or "").count("HostExecute"),
            )
        out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = measure(args.topology)
    print(f"{args.topology}, one device: a ({V}, {D}) f32 host array, N = {N}, M = {M}")
    for r in rows:
        state = (
            f"in place, {r['host_calls']} host calls"
            if r["aliased"]
            else (f"NOT in place, {r['host_calls']} host calls" if r["compiles"] else "refused")
        )
        print(f"  {r['form']:<34} {state}  {r['error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"topology": args.topology, "forms": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
