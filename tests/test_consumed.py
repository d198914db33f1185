"""A consumed (donated) state is a clear ValueError at every entry point, never a crash.

Issue 26, item 1. Calling a donating program again with the arrays it deleted crashed the
process (SIGSEGV in XLA: eager `apply_gradients` and train steps); those cases run in a
subprocess (`_consumed_worker.py`), so that a crash fails the test instead of pytest. The
other entry points raised a bare `RuntimeError: Array has been deleted`.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_tpu_embed as jte
from conftest import make_mesh

B = 8
CONSUMED = "consumed by an earlier call"


def _emb(backend="auto", stacking=True, routing="auto"):
    t = jte.TableConfig(10, 4, combiner="sum", name="t")
    s = jte.TableConfig(12, 4, combiner="sum", name="s")
    spec = jte.EmbeddingSpec(
        {"a": jte.FeatureConfig(t), "b": jte.FeatureConfig(s)}, jte.Adagrad(0.1)
    )
    return jte.Embedding(spec, make_mesh(4), backend=backend, stacking=stacking, routing=routing)


def _features():
    ids = np.arange(B, dtype=np.int32).reshape(B, 1) % 10
    return {"a": ids, "b": ids + 1}


def _grads():
    return {"a": np.ones((B, 4), np.float32), "b": np.ones((B, 4), np.float32)}


@pytest.fixture(scope="module")
def consumed():
    """(emb, a state consumed by apply_gradients, the state it returned)."""
    emb = _emb()
    st0 = emb.init(jax.random.key(0))
    st1 = emb.apply_gradients(st0, _features(), _grads())
    return emb, st0, st1


@pytest.mark.parametrize(
    "call",
    [
        lambda emb, st: emb.lookup(st, _features()),
        lambda emb, st: emb.export(st),
        lambda emb, st: emb.export_slots(st),
        lambda emb, st: emb.shard_rows(st, "t", 0),
        lambda emb, st: jte.serving.Server.from_embedding(emb, st),
        # Eager reductions of the state's arrays: on a deleted one, once the same reduction
        # had run on a live state, XLA crashed the process (jax 0.10.2).
        lambda emb, st: emb.dynamic_stats(st),
        lambda emb, st: emb.dynamic_counters(st),
        lambda emb, st: emb.cache_stats(st),
        lambda emb, st: emb.table_arrays(st),
    ],
    ids=[
        "lookup",
        "export",
        "export_slots",
        "shard_rows",
        "Server.from_embedding",
        "dynamic_stats",
        "dynamic_counters",
        "cache_stats",
        "table_arrays",
    ],
)
def test_consumed_state_is_a_value_error(consumed, call):
    emb, st0, st1 = consumed
    with pytest.raises(ValueError, match=CONSUMED) as e:
        call(emb, st0)
    assert "jnp.copy" in str(e.value) and "deleted array" in str(e.value)
    call(emb, st1)  # The returned state works.


def test_serving_of_deleted_tables(consumed):
    emb = consumed[0]
    tables = {n: jnp.asarray(x) for n, x in emb.export(consumed[2]).items()}
    tables["t"].delete()
    for call in (
        lambda: jte.serving.Server(emb.spec, tables),
        lambda: jte.serving.export(emb.spec, tables, _features(), include_tables=True),
    ):
        with pytest.raises(ValueError, match=r"the tables were consumed.*tables\['t'\]"):
            call()


def test_checkpoint_save_of_consumed_state(consumed, tmp_path):
    emb, st0, st1 = consumed
    with pytest.raises(ValueError, match=f"checkpoint.save: the state was {CONSUMED}"):
        jte.checkpoint.save(tmp_path, emb, st0)
    dense = {"w": jnp.ones(3)}
    dense["w"].delete()
    with pytest.raises(ValueError, match=r"dense state was consumed.*dense\['w'\]"):
        jte.checkpoint.save(tmp_path, emb, st1, dense=dense)
    assert not jte.checkpoint.all_steps(tmp_path)


def test_train_step_init_from_consumed_state(consumed):
    emb, st0, _ = consumed
    step = jte.make_train_step(emb, lambda p, a, b: jnp.sum(a["a"]) * p["w"], jax_opt())
    with pytest.raises(ValueError, match=f"TrainStep.init: the embedding state was {CONSUMED}"):
        step.init(None, {"w": jnp.ones(())}, embedding_state=st0)


def jax_opt():
    import optax

    return optax.sgd(0.1)


def test_tracers_are_not_checked():
    """Inside jit the leaves are tracers: nothing to check, nothing raised."""
    emb = _emb()
    st = emb.init(jax.random.key(0))
    feats = jax.tree.map(jnp.asarray, _features())
    out = jax.jit(emb.lookup)(st, feats)
    assert out["a"].shape == (B, 4)


@pytest.mark.parametrize(
    "cases",
    [
        ("apply_gradients_cpu", "apply_gradients_xla"),
        pytest.param(("train_step", "flax_step", "nnx_step"), marks=pytest.mark.slow),
    ],
    ids=["apply_gradients", "steps"],
)
def test_donating_calls_again_raise_instead_of_crashing(cases):
    script = Path(__file__).with_name("_consumed_worker.py")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(jte.__file__).parent.parent), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, str(script), *cases],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, (
        f"exit status {proc.returncode} (-11 is SIGSEGV)\n{proc.stdout}\n{proc.stderr[-3000:]}"
    )
    assert proc.stdout.count("CONSUMED-OK") == len(cases), proc.stdout
