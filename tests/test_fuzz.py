"""Cases of the differential fuzzer (`tests/fuzz.py`) kept in the suite.

The fuzzer draws whole configurations (tables static or dynamic, in device or host memory or
cached; routing, stacking, TPU layouts, round limits; accumulation, pipelining, prefetch;
most optimizers; the core, flax.linen or flax.nnx front end) and trains each against an
oracle that must agree: the same mesh with every table in device memory, or one device,
or the same mesh by the plainest path (XLA, all-gather, nothing stacked, no TPU layout),
through `jte.make_train_step`; or the run on two processes against one. Campaigns run by
hand (`python tests/fuzz.py --help`); the cases below, drawn from them, cover what the fuzzer
mixes and run in the slow tier.
"""

import json

import pytest

import fuzz

# (oracle, seed, case, the run's front end), each with what it mixes.
CASES = [
    # 4 devices, owner routing on TPU layouts, the Pallas kernels: a dynamic table in HBM
    # (LFU, buckets of 64: the Pallas index kernels) beside two cached static tables.
    ("mesh", 12, 10, "core"),
    # 8 devices, TPU layouts, the Pallas kernels, pipelined: a dynamic table with an
    # admission filter and a probability, round limits, accumulation, prefetch, global arrays.
    ("mesh", 12, 376, "core"),
    # 8 devices, the C++ kernels and index, pipelined: dynamic tables in HBM and in host
    # memory, accumulation, weighted and sequence features, FTRL.
    ("mesh", 12, 328, "core"),
    # 4 devices, the C++ kernels: a dynamic table with TTL 1, a cached dynamic table
    # admitting with a probability, a cached static table, round limits, prefetch.
    ("mesh", 12, 355, "core"),
    # 2 devices, the Pallas kernels: a dynamic table that never evicts, with a filter and
    # a probability; a dynamic table in host memory with a filter and TTL; prefetch.
    ("mesh", 12, 53, "core"),
    # 2 devices: a bf16 dynamic table in host memory with a filter and a probability,
    # eviction "none", accumulation, global-array inputs.
    ("placement", 4, 28, "core"),
    # 8 devices, TPU layouts: a cached dynamic table with a filter, a custom optimizer,
    # accumulation, prefetch.
    ("placement", 4, 21, "core"),
    # 4 devices, TPU layouts: bf16 static tables cached and stacked, pipelined, prefetch,
    # accumulation (bit for bit).
    ("placement", 3, 19, "core"),
    # The flax.linen front end, one device, TPU layouts, pipelined: a cached dynamic table
    # and a dynamic table in host memory beside a static table in HBM.
    ("placement", 21, 12, "linen"),
    # The flax.linen front end under jax_enable_x64, TPU layouts: a bf16 static table, a
    # cached dynamic table with a row initializer (its model once made float64 params).
    ("placement", 48, 11, "linen"),
    # The flax.nnx front end, 2 devices, owner routing, accumulation: a cached dynamic table.
    ("placement", 21, 19, "nnx"),
    # The flax.nnx front end, 4 devices, accumulation, pipelined, prefetch: a cached table.
    ("mesh", 22, 1, "nnx"),
    # 2 processes of 4 devices against one of 8: global-array inputs fed per process,
    # accumulation, a cached dynamic table beside a cached static one; both processes'
    # checkpoints restored on one.
    ("processes", 30, 6, "core"),
    # 4 devices, owner routing, TPU layouts, the Pallas kernels, stacking, pipelined, two
    # micro-batches (the oracle one batch): a static table in HBM, a dynamic one and a
    # cached static one, against the plainest path on the same mesh.
    ("paths", 36, 5, "core"),
]


@pytest.mark.slow
@pytest.mark.parametrize("oracle, seed, case, front", CASES)
def test_case_agrees_with_its_oracle(oracle, seed, case, front):
    result = fuzz.run(fuzz.draw(seed, case, oracle, front))
    assert result["status"] == "ok", json.dumps(result, indent=1, default=str)


@pytest.mark.parametrize("oracle", fuzz.ORACLES)
def test_draws_are_configurations_the_library_accepts(oracle):
    """Every draw is JSON, the same on every call, and builds on both sides: a campaign's
    cases train rather than stop at a refusal."""
    for case in range(16):
        c = fuzz.draw(5, case, oracle)
        assert json.loads(json.dumps(c)) == c == fuzz.draw(5, case, oracle)
        for side in (False, True):
            fuzz.embedding(c, side)
