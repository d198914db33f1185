"""Cases of the differential fuzzer (`tests/fuzz.py`) kept in the suite.

The fuzzer draws whole configurations (tables static or dynamic, in device or host memory or
cached; routing, stacking, TPU layouts, round limits; accumulation, pipelining, prefetch;
most optimizers) and trains each against an oracle that must agree: the same mesh with every
table in device memory, or one device. Campaigns run by hand (`python tests/fuzz.py --help`);
the cases below, drawn from them, cover what the fuzzer mixes and run in the slow tier.
"""

import json

import pytest

import fuzz

# (oracle, seed, case), each with what it mixes.
CASES = [
    # 2 devices, owner routing: a cached dynamic table that never evicts, full; round
    # limits, accumulation, prefetch, weighted ids.
    ("mesh", 4, 7),
    # 8 devices, the C++ kernels and index: a cached dynamic table with an admission filter,
    # accumulation, prefetch, sequence features.
    ("mesh", 4, 5),
    # 8 devices, owner routing on TPU layouts: a cached dynamic table stacked with a static
    # one, round limits, accumulation.
    ("mesh", 4, 31),
    # 8 devices: a dynamic table in host memory admitting with a probability, with TTL,
    # a custom optimizer, global-array inputs, prefetch, sequence and weighted features.
    ("mesh", 4, 24),
    # 8 devices: dynamic tables in host memory with a filter and TTL, stacked, round limits.
    ("mesh", 4, 13),
    # 2 devices: a bf16 dynamic table in host memory with a filter and a probability,
    # eviction "none", accumulation, global-array inputs.
    ("placement", 4, 28),
    # 8 devices, TPU layouts: a cached dynamic table with a filter, a custom optimizer,
    # accumulation, prefetch.
    ("placement", 4, 21),
    # 4 devices, TPU layouts: bf16 static tables cached and stacked, pipelined, prefetch,
    # accumulation (bit for bit).
    ("placement", 3, 19),
]


@pytest.mark.slow
@pytest.mark.parametrize("oracle, seed, case", CASES)
def test_case_agrees_with_its_oracle(oracle, seed, case):
    result = fuzz.run(fuzz.draw(seed, case, oracle))
    assert result["status"] == "ok", json.dumps(result, indent=1, default=str)


@pytest.mark.parametrize("oracle", fuzz.ORACLES)
def test_draws_are_configurations_the_library_accepts(oracle):
    """Every draw is JSON, the same on every call, and builds on both sides: a campaign's
    cases train rather than stop at a refusal."""
    for case in range(24):
        c = fuzz.draw(5, case, oracle)
        assert json.loads(json.dumps(c)) == c == fuzz.draw(5, case, oracle)
        for side in (False, True):
            fuzz.embedding(c, side)
