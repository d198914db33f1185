"""Which tests of a tier run only lines of the package that other tests of the tier run too.

The fast tier (`make test`) must stay under 6 minutes on 2 cores, and its time is XLA:CPU
compiling each test's programs. A test can move to the slow tier without the fast tier
losing a line of `jax_tpu_embed` that it runs (traced or eager) when every line it runs is
run by a test that stays. This module records, per test, the package's lines and the
test's seconds, and lists such tests, dearest first:

    make test ARGS="--tier-coverage=/tmp/tiers"     # loaded by conftest.py; traces every line
    .venv/bin/python tests/tier_coverage.py /tmp/tiers [--min-seconds 3]

A listed test may still be the only one that checks its property (bit-identity across
meshes, a past bug's regression): the list is where to look, not what to move.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time

import pytest

_PACKAGE = os.sep + "jax_tpu_embed" + os.sep
_lines: set = set()
_ours: dict = {}
_START = pytest.StashKey[float]()


def _line(frame, event, arg):
    if event == "line":
        _lines.add((frame.f_code.co_filename, frame.f_lineno))
    return _line


def _call(frame, event, arg):
    name = frame.f_code.co_filename
    ours = _ours.get(name)
    if ours is None:  # The package's own files, not a copy installed in site-packages.
        ours = _ours[name] = _PACKAGE in name and "site-packages" not in name
    if not ours:
        return None
    _lines.add((name, frame.f_lineno))
    return _line


def pytest_addoption(parser):
    parser.addoption(
        "--tier-coverage",
        metavar="DIR",
        default=None,
        help="record each test's lines of jax_tpu_embed and seconds in DIR",
    )


def pytest_runtest_setup(item):
    if item.config.getoption("--tier-coverage"):
        _lines.clear()
        item.stash[_START] = time.perf_counter()
        sys.settrace(_call)
        threading.settrace(_call)


def pytest_runtest_teardown(item, nextitem):
    out = item.config.getoption("--tier-coverage")
    if not out:
        return
    sys.settrace(None)
    threading.settrace(None)
    os.makedirs(out, exist_ok=True)
    record = {
        "test": item.nodeid,
        "seconds": time.perf_counter() - item.stash[_START],
        "lines": sorted(f"{os.path.basename(f)}:{n}" for f, n in _lines),
    }
    with open(os.path.join(out, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


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
    records = {}
    for name in sorted(os.listdir(args.dir)):
        with open(os.path.join(args.dir, name)) as f:
            for line in f:
                r = json.loads(line)
                records[r["test"]] = r
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
