"""Runs one of the library's loops for many steps without waiting, on N simulated CPU devices.

    python tests/_inflight_worker.py LOOP DEVICES STEPS [VOCAB]

LOOP: train (jte.make_train_step), flax, nnx, apply (eager Embedding.apply_gradients).
The environment (XLA_FLAGS with the device count, JAX_PLATFORMS=cpu) is set here, before
jax is imported; JTE_MAX_STEPS_IN_FLIGHT passes through. Prints "ok <steps/s>" at the end.
On XLA:CPU an unbounded loop like these can deadlock in a collective (see _inflight.py);
test_inflight.py runs this in a subprocess under a timeout.
"""

import os
import sys
import time

LOOP, N, STEPS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
VOCAB = int(sys.argv[4]) if len(sys.argv) > 4 else 4096
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + [f"--xla_force_host_platform_device_count={N}"]
)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jax_tpu_embed as jte  # noqa: E402

B, D = 64, 16
assert jax.device_count() == N, jax.devices()
mesh = jax.make_mesh((N,), ("shard",))
spec = jte.EmbeddingSpec(
    {"a": jte.FeatureConfig(jte.TableConfig(VOCAB, D, combiner="sum", name="t"))},
    jte.Adagrad(learning_rate=0.1),
)
rng = np.random.default_rng(0)
batches = [
    {
        "features": {"a": rng.integers(0, VOCAB, (B, 4)).astype(np.int32)},
        "y": rng.normal(size=B).astype(np.float32),
    }
    for _ in range(8)
]


def loss_fn(params, acts, batch):
    return jnp.mean((acts["a"] @ params["w"] - batch["y"]) ** 2)


class LinenModel(nn.Module):
    embed: jte.flax.Embed

    @nn.compact
    def __call__(self, batch):
        return nn.Dense(1)(self.embed(batch["features"])["a"])[:, 0]


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.embed = jte.nnx.Embed(spec, mesh=mesh, rngs=rngs)
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, features):
        return self.head(self.embed(features)["a"])[:, 0]


def make_loop():
    """(one step on batch k, what to wait for at the end)."""
    if LOOP == "train":
        emb = jte.Embedding(spec, mesh)
        step = jte.make_train_step(emb, loss_fn, optax.sgd(0.01))
        box = [step.init(jax.random.key(0), {"w": np.ones(D, np.float32)}, batches[0])]

        def one(k):
            box[0], _ = step(box[0], batches[k % 8])

        return one, lambda: box[0]
    if LOOP == "flax":
        model = LinenModel(jte.flax.Embed(spec, mesh))
        step = jte.flax.make_train_step(
            model, lambda out, b: jnp.mean((out - b["y"]) ** 2), optax.sgd(0.01)
        )
        box = [step.init(jax.random.key(0), batches[0])]

        def one(k):
            box[0], _ = step(box[0], batches[k % 8])

        return one, lambda: box[0]
    if LOOP == "nnx":
        model = NnxModel(nnx.Rngs(0))
        step = jte.nnx.make_train_step(
            model, lambda m, b: jnp.mean((m(b["features"]) - b["y"]) ** 2), optax.sgd(0.01)
        )
        return lambda k: step(batches[k % 8]), lambda: nnx.state(model)
    if LOOP == "apply":
        emb = jte.Embedding(spec, mesh)
        box = [emb.init(jax.random.key(0))]
        grads = {"a": np.full((B, D), 0.01, np.float32)}

        def one(k):
            box[0] = emb.apply_gradients(box[0], batches[k % 8]["features"], grads)

        return one, lambda: box[0]
    raise SystemExit(f"unknown loop {LOOP!r}")


one, result = make_loop()
one(0)
jax.block_until_ready(result())
t0 = time.perf_counter()
for k in range(1, STEPS + 1):
    one(k)
jax.block_until_ready(result())
print(f"ok {STEPS / (time.perf_counter() - t0):.0f}", flush=True)
