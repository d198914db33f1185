"""Importing the package on a machine without a TPU prints nothing from libtpu."""

import importlib.util
import os
import subprocess
import sys

import pytest

from jax_tpu_embed import _platforms

SCRIPT = """
import jax_tpu_embed as jte, jax, numpy as np
t = jte.TableConfig(100, 8, combiner="sum")
emb = jte.Embedding(jte.EmbeddingSpec({"f": jte.FeatureConfig(t)}, jte.SGD(0.1)))
state = emb.init(jax.random.key(0))
acts = emb.lookup(state, {"f": np.arange(8) % 100})
print("platform", jax.devices()[0].platform, "acts", acts["f"].shape)
"""


@pytest.mark.slow  # Two subprocesses of their own.
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu installed")
@pytest.mark.skipif(_platforms._tpu_chips() > 0, reason="a TPU is attached")
def test_no_libtpu_noise_without_a_tpu():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_FORCE_TPU_INIT")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "platform cpu acts (8, 8)" in out.stdout
    for noise in ("unexpected worker hostname", "INVALID_ARGUMENT", "TPU accelerator type"):
        assert noise not in out.stderr + out.stdout, out.stderr
    # A platform chosen by the user is left alone.
    env["JAX_PLATFORMS"] = "cpu"
    code = "import jax_tpu_embed._platforms as p; print(p.skip_tpu_probe_without_chips())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.stdout.strip() == "False", out.stderr
