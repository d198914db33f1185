"""Run by test_consumed.py in a subprocess: reuses a donated state at the entry points whose
donating call crashed the process before the check (SIGSEGV in XLA, openxla/xla issue 22604).

    python _consumed_worker.py CASE      # prints "CONSUMED-OK <message>" and exits 0

It sets conftest's environment (8 simulated CPU devices) before importing jax.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"  # As conftest, before jax is imported.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jax_tpu_embed as jte  # noqa: E402

B = 8


def _spec():
    t = jte.TableConfig(10, 4, combiner="sum", name="t")
    return jte.EmbeddingSpec({"a": jte.FeatureConfig(t)}, jte.Adagrad(0.1))


def _ids():
    return np.arange(B, dtype=np.int32).reshape(B, 1) % 10


def _expect_consumed(fn) -> None:
    try:
        fn()
    except ValueError as e:
        assert "consumed by an earlier call" in str(e), e
        print("CONSUMED-OK", e, flush=True)
        return
    raise AssertionError("reusing a consumed state raised nothing")


def apply_gradients(backend: str) -> None:
    emb = jte.Embedding(_spec(), backend=backend)
    st0 = emb.init(jax.random.key(0))
    grads = {"a": np.ones((B, 4), np.float32)}
    emb.apply_gradients(st0, {"a": _ids()}, grads)
    _expect_consumed(lambda: emb.apply_gradients(st0, {"a": _ids()}, grads))


def _batch():
    return {"features": {"a": _ids()}, "labels": np.ones((B,), np.float32)}


def train_step() -> None:
    emb = jte.Embedding(_spec())

    def loss_fn(params, acts, batch):
        return jnp.mean((acts["a"] @ params["w"] - batch["labels"]) ** 2)

    step = jte.make_train_step(emb, loss_fn, optax.sgd(0.1))
    s0 = step.init(jax.random.key(0), {"w": jnp.ones((4,))})
    step(s0, _batch())
    _expect_consumed(lambda: step(s0, _batch()))


def flax_step() -> None:
    import flax.linen as nn

    class Model(nn.Module):
        embed: jte.flax.Embed

        @nn.compact
        def __call__(self, batch):
            return nn.Dense(1)(self.embed(batch["features"])["a"])[:, 0]

    model = Model(jte.flax.Embed(_spec()))
    step = jte.flax.make_train_step(
        model, lambda out, b: jnp.mean((out - b["labels"]) ** 2), optax.sgd(0.1)
    )
    s0 = step.init(jax.random.key(0), _batch())
    step(s0, _batch())
    _expect_consumed(lambda: step(s0, _batch()))


def nnx_step() -> None:
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = jte.nnx.Embed(_spec(), rngs=rngs)
            self.head = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, features):
            return self.head(self.embed(features)["a"])[:, 0]

    model = Model(nnx.Rngs(0))
    step = jte.nnx.make_train_step(
        model, lambda m, b: jnp.mean((m(b["features"]) - b["labels"]) ** 2), optax.sgd(0.1)
    )
    # A snapshot of the model's arrays (fresh Variables, the same arrays), held across a
    # step, which donates them, and put back into the model.
    old = jax.tree.map(lambda x: x, nnx.state(model))
    step(_batch())
    nnx.update(model, old)
    _expect_consumed(lambda: step(_batch()))


CASES = {
    "apply_gradients_cpu": lambda: apply_gradients("cpu"),
    "apply_gradients_xla": lambda: apply_gradients("xla"),
    "train_step": train_step,
    "flax_step": flax_step,
    "nnx_step": nnx_step,
}

if __name__ == "__main__":
    for case in sys.argv[1:]:
        CASES[case]()
