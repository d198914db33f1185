"""Steps in flight on multi-device CPU meshes (issue 27, jax_tpu_embed/_inflight.py).

XLA:CPU deadlocks in a collective when a loop runs far enough ahead of N CPU devices; the
library's loops wait for step i - k after dispatching step i. The slow tests run each loop for
1,000 undisturbed steps on 4 and 8 devices in a subprocess (`_inflight_worker.py`) under a
timeout, so a hang fails the test instead of hanging the suite.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_tpu_embed as jte
from conftest import make_mesh
from jax_tpu_embed import _inflight


@pytest.fixture
def limit():
    """Restores the bound a test changes."""
    before = jte.max_steps_in_flight()
    yield
    jte.set_max_steps_in_flight(before)


def _arrays(num_devices: int, n: int) -> list[jax.Array]:
    sharding = NamedSharding(make_mesh(num_devices), P())
    return [jax.device_put(jnp.float32(i), sharding) for i in range(n)]


def test_default_and_setting(limit):
    assert jte.max_steps_in_flight() == _inflight.DEFAULT == 4
    jte.set_max_steps_in_flight(16)
    assert jte.max_steps_in_flight() == 16
    for off in (None, 0):
        jte.set_max_steps_in_flight(off)
        assert jte.max_steps_in_flight() is None
    for bad in (-1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="set_max_steps_in_flight"):
            jte.set_max_steps_in_flight(bad)  # pyright: ignore[reportArgumentType]


def test_env(monkeypatch):
    for raw, want in (("", 4), ("8", 8), ("0", None)):
        monkeypatch.setenv(_inflight._ENV, raw)
        assert _inflight._from_env() == want
    monkeypatch.setenv(_inflight._ENV, "many")
    with pytest.raises(ValueError, match=_inflight._ENV):
        _inflight._from_env()


def test_window_keeps_k_steps_on_a_cpu_mesh(limit):
    jte.set_max_steps_in_flight(3)
    w = _inflight.Window()
    for x in _arrays(4, 10):
        w.push(x)
        assert len(w._handles) <= 3
    assert w._cpu is True and len(w._handles) == 3
    jte.set_max_steps_in_flight(None)  # Disabled: nothing is kept (or waited for).
    w.push(_arrays(4, 1)[0])
    assert len(w._handles) == 0


def test_window_never_waits_on_one_device_or_in_a_trace(limit):
    w = _inflight.Window()
    for x in _arrays(1, 10):
        w.push(x)
    assert w._cpu is False and len(w._handles) == 0
    traced = _inflight.Window()
    jax.jit(lambda x: traced.push(x) or x)(jnp.float32(1))
    assert traced._cpu is None and len(traced._handles) == 0


def test_library_loops_use_a_window():
    """Each loop owns a window and pushes a handle that is never donated."""
    spec = jte.EmbeddingSpec(
        {"a": jte.FeatureConfig(jte.TableConfig(64, 4, name="t"))}, jte.SGD(learning_rate=0.1)
    )
    emb = jte.Embedding(spec, make_mesh(4))
    state = emb.init(jax.random.key(0))
    ids = jnp.zeros((8,), jnp.int32)
    for _ in range(6):
        state = emb.apply_gradients(state, {"a": ids}, {"a": jnp.ones((8, 4))})
    assert emb._in_flight._cpu is True and len(emb._in_flight._handles) == 4
    jax.block_until_ready(state)


def _run_worker(loop: str, devices: int, steps: int) -> str:
    env = {k: v for k, v in os.environ.items() if k != _inflight._ENV}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
    script = Path(__file__).with_name("_inflight_worker.py")
    try:
        done = subprocess.run(
            [sys.executable, str(script), loop, str(devices), str(steps)],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,  # XLA aborts a stuck rendezvous after 40 s; this is the backstop.
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{loop} on {devices} devices hung: {str(e.stderr)[-2000:]}")
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "loop,devices",
    [("train", 4), ("train", 8), ("apply", 4), ("apply", 8), ("flax", 4), ("nnx", 4)],
)
def test_1000_undisturbed_steps_finish(loop, devices):
    assert "ok" in _run_worker(loop, devices, 1000)
