"""bfloat16 tables on CPU meshes: the C++ kernels against the XLA passes, and against float32.

Times one jitted train step (lookup -> vjp -> apply_gradients, state donated) and
apply_gradients alone on a workload's batches (W0: 8 tables of 1e5 x 32, B=1024, L=10), on
2 host devices, for each variant:

    float32 tables, backend="cpu" | bfloat16 tables, backend="cpu" | bfloat16, backend="xla"

Variants run interleaved, round after round, so that load from other processes hits all of
them alike; each prints its median ms per step over all rounds.

    python benchmarks/bf16_cpu.py --workload W0 --optimizer adagrad --steps 10 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import workloads  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_tpu_embed as jte  # noqa: E402

VARIANTS = [("float32", "cpu"), ("bfloat16", "cpu"), ("bfloat16", "xla")]


class Variant:
    def __init__(self, wl, dtype: str, backend: str, optimizer: str):
        c = wl.config
        mesh = jax.make_mesh((len(jax.devices()),), ("shard",))
        opt = (
            jte.RowwiseAdagrad(0.01, initial_accumulator_value=0.1)
            if optimizer == "rowwise"
            else jte.Adagrad(0.01, initial_accumulator_value=0.1)
        )
        feats = [f"f{i}" for i in range(c.tables)]
        features = {
            f: jte.FeatureConfig(
                jte.TableConfig(
                    c.vocabulary_size, c.dim, combiner="sum", name=n, dtype=jnp.dtype(dtype)
                )
            )
            for f, n in zip(feats, wl.table_names)
        }
        emb = jte.Embedding(jte.EmbeddingSpec(features, opt), mesh, backend=backend)
        assert set(emb.backends.values()) == {backend}, emb.backends
        put = lambda x: jax.device_put(x, NamedSharding(mesh, P("shard")))
        self.batches = [{f: put(b[i]) for i, f in enumerate(feats)} for b in wl.ids]
        self.R = {f: put(wl.R[i]) for i, f in enumerate(feats)}
        self.state = emb.init(jax.random.key(0))

        def train_step(state, features, R):
            acts = emb.lookup(state, features)
            loss, grads = workloads.jax_loss(acts, R)
            return emb.apply_gradients(state, features, grads), loss

        self.train = jax.jit(train_step, donate_argnums=0)
        self.apply = jax.jit(emb.apply_gradients, donate_argnums=0)
        self.name = f"{dtype} {backend}"
        self.times = {"train_step": [], "apply_gradients": []}

    def run(self, steps: int):
        for what, fn in (("train_step", self.train), ("apply_gradients", self.apply)):
            for k in range(steps + 1):  # The first step of a round compiles or warms up.
                b = self.batches[k % len(self.batches)]
                t0 = time.perf_counter()
                out = fn(self.state, b, self.R)
                self.state = out[0] if what == "train_step" else out
                jax.block_until_ready(out)
                if k:
                    self.times[what].append(time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="bfloat16 tables on CPU meshes: cpu vs xla backend.")
    p.add_argument("--workload", default="W0")
    p.add_argument("--optimizer", choices=["adagrad", "rowwise"], default="adagrad")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round and variant")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    wl = workloads.generate(workloads.load_config(a.workload))
    variants = [Variant(wl, d, b, a.optimizer) for d, b in VARIANTS]
    for _ in range(a.rounds):
        for v in variants:
            v.run(a.steps)
    c = wl.config
    print(
        f"{a.workload} ({c.tables} tables {c.vocabulary_size} x {c.dim}, B={c.batch}, "
        f"L={c.ids_per_example}), {a.optimizer}, {len(jax.devices())} devices, "
        f"median ms over {a.rounds} x {a.steps} steps"
    )
    print(f"{'variant':<18}{'train_step':>12}{'apply_gradients':>17}")
    for v in variants:
        ms = {k: 1e3 * float(np.median(t)) for k, t in v.times.items()}
        print(f"{v.name:<18}{ms['train_step']:>12.2f}{ms['apply_gradients']:>17.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
