"""Which tests of a tier run only lines of the package that other tests of the tier run too.

The fast tier (`make test`) must stay under 6 minutes on 2 cores, and its time is XLA:CPU
compiling each test's programs. A test can move to the slow tier without the fast tier
losing a line of `jax_tpu_embed` that it runs (traced or eager) when every line it runs is
run by a test that stays. This module records, per test, the package's lines (coverage.py,
each test a context) and the test's seconds, and lists such tests, dearest first:

    make test ARGS="--tier-coverage=/tmp/tiers"     # loaded by conftest.py
    .venv/bin/python tests/tier_coverage.py /tmp/tiers [--min-seconds 3]

A listed test may still be the only one that checks its property (bit-identity across
meshes, a past bug's regression): the list is where to look, not what to move.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import time

import pytest

_PACKAGE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jax_tpu_embed"
)
_COVERAGE = pytest.StashKey[object]()
_START = pytest.StashKey[float]()


def pytest_addoption(parser):
    parser.addoption(
        "--tier-coverage",
        metavar="DIR",
        default=None,
        help="record each test's lines of jax_tpu_embed and seconds in DIR",
    )


def pytest_configure(config):
    """One coverage.py data file a process (pytest-xdist workers each write their own), each
    test's lines under its node id as the coverage context."""
    out = config.getoption("--tier-coverage")
    controller = getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")
    if not out or controller:  # pytest-xdist's controller runs no test.
        return
    import coverage  # The `test` extra's; only this option needs it.

    os.makedirs(out, exist_ok=True)
    cov = coverage.Coverage(
        data_file=os.path.join(out, f"lines.{os.getpid()}"), source=[_PACKAGE], data_suffix=False
    )
    cov.start()
    config.stash[_COVERAGE] = cov


def pytest_unconfigure(config):
    cov = config.stash.get(_COVERAGE, None)
    if cov is not None:
        cov.stop()
        cov.save()


def pytest_runtest_setup(item):
    cov = item.config.stash.get(_COVERAGE, None)
    if cov is not None:
        cov.switch_context(item.nodeid)
        item.stash[_START] = time.perf_counter()


def pytest_runtest_teardown(item, nextitem):
    cov = item.config.stash.get(_COVERAGE, None)
    if cov is None:
        return
    seconds = time.perf_counter() - item.stash[_START]
    cov.switch_context("")  # Lines between tests are no test's.
    out = item.config.getoption("--tier-coverage")
    with open(os.path.join(out, f"seconds.{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"test": item.nodeid, "seconds": seconds}) + "\n")


def read(out: str) -> dict:
    """{test: {"seconds": s, "lines": [file:line, ...]}} of a `--tier-coverage` directory."""
    import coverage

    records = {}
    for name in glob.glob(os.path.join(out, "seconds.*.jsonl")):
        with open(name) as f:
            for line in f:
                r = json.loads(line)
                records[r["test"]] = {"seconds": r["seconds"], "lines": []}
    for name in glob.glob(os.path.join(out, "lines.*")):
        data = coverage.CoverageData(basename=name)
        data.read()
        for path in data.measured_files():
            for number, tests in data.contexts_by_lineno(path).items():
                for test in tests:
                    if test in records:
                        records[test]["lines"].append(f"{os.path.basename(path)}:{number}")
    return records


def redundant(records: dict, min_seconds: float) -> list[tuple[float, str]]:
    """(seconds, test) of tests that can leave together, dearest first: each runs only lines
    that the tests left run (greedy, so the list is one such set, not the only one)."""
    count = collections.Counter()
    for r in records.values():
        count.update(r["lines"])
    leaving = []
    for test in sorted(records, key=lambda t: -records[t]["seconds"]):
        r = records[test]
        if r["seconds"] < min_seconds:
            break
        if all(count[line] > 1 for line in r["lines"]):
            leaving.append((r["seconds"], test))
            count.subtract(r["lines"])
    return leaving


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description="Tests of a tier whose lines other tests of the tier run."
    )
    parser.add_argument("dir", help="the --tier-coverage directory of a run")
    parser.add_argument("--min-seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    records = read(args.dir)
    leaving = redundant(records, args.min_seconds)
    total = sum(r["seconds"] for r in records.values())
    lines = set().union(*(r["lines"] for r in records.values()))
    print(f"{len(records)} tests, {total:.0f} s, {len(lines)} lines of jax_tpu_embed")
    print(
        f"{len(leaving)} tests of {sum(s for s, _ in leaving):.0f} s run no line the others do not:"
    )
    for seconds, test in leaving:
        print(f"{seconds:6.1f}  {test}")


if __name__ == "__main__":
    main()
