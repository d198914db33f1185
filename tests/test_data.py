"""jte.data.criteo: Criteo TSV (plain and gzip) to batches, against a line-by-line Python
reference; malformed lines named by file and line, or skipped and counted; global arrays."""

import math

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_tpu_embed as jte
from conftest import make_mesh
from criteo_files import write_criteo

# Small and odd vocabularies: ids collide, and "mod" and "hash" differ.
VOCAB = [7, 13, 50, 1, 1000, 97, 2**20, 3] + [31 + i for i in range(18)]


def _splitmix(x):
    mask = 2**64 - 1
    z = x & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def reference(rows, mapping="mod", vocab=VOCAB):
    """One example at a time, in plain Python: labels, dense (n, 13), ids (n, 26)."""
    labels, dense, ids = [], [], []
    for row in rows:
        labels.append(float(row[0]))
        dense.append([math.log1p(max(int(x or 0), 0)) for x in row[1:14]])
        out = []
        for f, (x, v) in enumerate(zip(row[14:], vocab)):
            value = int(x or "0", 16)
            if mapping == "hash":
                value = _splitmix(value + 0x9E3779B97F4A7C15 * (f + 1))
            out.append(value % v)
        ids.append(out)
    return np.array(labels), np.array(dense), np.array(ids)


def collect(batches):
    """Concatenates every batch: labels (n,), dense (n, 13), ids (n, 26)."""
    got = list(batches)
    labels = np.concatenate([np.asarray(b["labels"]) for b in got])
    dense = np.concatenate([np.asarray(b["dense"]) for b in got])
    ids = np.stack(
        [np.concatenate([np.asarray(b["sparse"][f"C{j + 1}"]) for b in got]) for j in range(26)],
        axis=1,
    )
    for b in got:
        assert b["dense"].dtype == np.float32 and b["labels"].dtype == np.float32
        assert all(b["sparse"][f"C{j + 1}"].dtype == np.int32 for j in range(26))
    return labels, dense, ids


def assert_matches(got, want, *, ordered=True):
    if not ordered:  # Compare as multisets of whole examples.
        key = lambda t: np.lexsort(np.column_stack([t[0], t[1], t[2]]).T)
        got = tuple(x[key(got)] for x in got)
        want = tuple(x[key(want)] for x in want)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    np.testing.assert_array_equal(got[2], want[2])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("criteo")
    a = write_criteo(d / "day_0", 300, seed=1)  # No extension: the 1TB day files' names.
    b = write_criteo(d / "train.txt.gz", 170, seed=2, gz=True)
    return [str(d / "day_0"), str(d / "train.txt.gz")], a + b


@pytest.mark.parametrize("mapping", ["mod", "hash"])
def test_batches_match_reference(files, mapping):
    paths, rows = files
    batches = jte.data.criteo(
        paths, 64, VOCAB, id_mapping=mapping, drop_remainder=False, num_threads=1
    )
    got = collect(batches)
    assert_matches(got, reference(rows, mapping))
    # Empty fields and negative counts are in the data, and every id is in range.
    assert any(r[5] == "" for r in rows) and any(r[3].startswith("-") for r in rows)
    assert (got[2] >= 0).all() and (got[2] < np.array(VOCAB)).all()
    assert (got[2][:, 3] == 0).all()  # V = 1.


def test_raw_ids_are_the_hex_values(tmp_path, files):
    """id_mapping="raw": each value itself as an int64 id (beyond int32 too), -1 where empty,
    vocabulary_sizes unused; with a sharding, jte.SplitIds of global uint32 arrays."""
    paths, rows = files
    batches = jte.data.criteo(paths, 64, None, id_mapping="raw", drop_remainder=False)
    got = list(batches)
    assert all(b["sparse"][f"C{j + 1}"].dtype == np.int64 for b in got for j in range(26))
    ids = np.stack([np.concatenate([b["sparse"][f"C{j + 1}"] for b in got]) for j in range(26)], 1)
    want = np.array([[int(x, 16) if x else -1 for x in r[14:]] for r in rows], np.int64)
    np.testing.assert_array_equal(ids, want)
    assert (ids == -1).any() and (ids > np.iinfo(np.int32).max).any()  # Empty; beyond int32.
    # Not the value 0's id: an empty field is missing, not a category.
    path = tmp_path / "edges.tsv"
    values = ["", "0", "ffffffff", "7fffffffffffffff", "8000000000000000", "FFFFFFFFFFFFFFFE"]
    path.write_text("\t".join(["1"] + [""] * 13 + values + ["1"] * 20) + "\n")
    (b,) = list(jte.data.criteo([str(path)], 1, None, id_mapping="raw"))
    want_edges = [-1, 0, 2**32 - 1, 2**63 - 1, -(2**63), -2]
    assert [int(b["sparse"][f"C{j + 1}"][0]) for j in range(6)] == want_edges
    # With a sharding: split on the host into global uint32 halves that join to the ids.
    sharding = NamedSharding(make_mesh(8), P("shard"))
    batches = jte.data.criteo(paths, 64, None, id_mapping="raw", sharding=sharding)
    first = next(iter(batches))["sparse"]["C1"]
    assert isinstance(first, jte.SplitIds) and first.hi.sharding == sharding
    assert first.hi.dtype == first.lo.dtype == np.uint32
    np.testing.assert_array_equal(jte.join_ids(jte.SplitIds(*map(np.asarray, first))), want[:64, 0])


def test_raw_ids_bad_values(tmp_path, files):
    paths, rows = files
    path = tmp_path / "minus_one.tsv"
    fields = list(rows[0])
    fields[20] = "ffffffffffffffff"  # C7: the id -1, padding.
    path.write_text("\t".join(fields) + "\n")
    with pytest.raises(ValueError, match=r"line 1: field C7 is 'ffffffffffffffff', which is -1"):
        list(jte.data.criteo([str(path)], 1, None, id_mapping="raw"))
    assert len(list(jte.data.criteo([str(path)], 1, VOCAB))) == 1  # A value as any other.
    with pytest.raises(ValueError, match="id_mapping='mod' needs vocabulary_sizes"):
        jte.data.criteo(paths, 8, None)
    with pytest.raises(ValueError, match="vocabulary_sizes must be 26 positive ints"):
        jte.data.criteo(paths, 8, VOCAB[:25], id_mapping="raw")


def test_threads_and_epochs_and_remainder(files):
    paths, rows = files
    want = reference(rows)
    # Two files read in two threads: the same examples, interleaved.
    got = collect(jte.data.criteo(paths, 10, VOCAB, drop_remainder=False, num_threads=2))
    assert_matches(got, want, ordered=False)
    # 470 lines, B = 64: 7 full batches; the 22 rows left are dropped by default.
    assert len(list(jte.data.criteo(paths, 64, VOCAB))) == 7
    # Repeating forever; each iter() starts again.
    batches = jte.data.criteo(paths, 64, VOCAB, num_epochs=None, num_threads=1)
    for _ in range(2):
        it = iter(batches)
        first = [next(it) for _ in range(16)]  # More than one epoch.
        np.testing.assert_array_equal(first[0]["labels"], want[0][:64])


def test_select_lines_splits_the_file(files):
    paths, rows = files

    def read(select):
        return collect(
            jte.data.criteo(
                paths[:1], 8, VOCAB, select_lines=select, drop_remainder=False, num_threads=1
            )
        )

    train, held = read(lambda n: n % 5 != 0), read(lambda n: n % 5 == 0)
    want = reference(rows[:300])
    assert_matches(train, tuple(x[np.arange(300) % 5 != 4] for x in want))
    assert_matches(held, tuple(x[np.arange(300) % 5 == 4] for x in want))


def test_global_arrays_on_a_mesh(files):
    paths, rows = files
    sharding = NamedSharding(make_mesh(8), P("shard"))
    batches = jte.data.criteo(paths, 64, VOCAB, sharding=sharding, num_threads=1)
    got = list(batches)
    for leaf in jax.tree.leaves(got[0]):
        assert isinstance(leaf, jax.Array) and leaf.sharding == sharding
        assert leaf.shape[0] == 64
    assert_matches(collect(got), tuple(x[: 7 * 64] for x in reference(rows)))


BAD_LINES = {
    # line number (1-based) -> (how the line is broken, the error text expected)
    3: ("drop_tab", r"line 3: 39 tab-separated fields, expected 40"),
    5: ("extra_tab", r"line 5: 41 tab-separated fields"),
    8: ("int_word", r"line 8: field I4 is 'abc', expected an integer"),
    11: ("int_float", r"line 11: field I13 is '1.5', expected an integer"),
    14: ("label", r"line 14: label is '2', expected 0 or 1"),
    17: ("hex", r"line 17: field C2 is 'zz12', expected at most 16 hexadecimal"),
}


def _break(fields, how):
    fields = list(fields)
    if how == "drop_tab":  # Two fields run together: columns would shift.
        fields[20:22] = [fields[20] + fields[21]]
    elif how == "extra_tab":
        fields.insert(30, "1f")
    elif how == "int_word":
        fields[4] = "abc"
    elif how == "int_float":
        fields[13] = "1.5"
    elif how == "label":
        fields[0] = "2"
    elif how == "hex":
        fields[15] = "zz12"
    return fields


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "day_1.gz"
    rows = write_criteo(path.with_suffix(".txt"), 40, seed=3)
    lines = [
        "\t".join(_break(r, BAD_LINES[i + 1][0]) if i + 1 in BAD_LINES else r)
        for i, r in enumerate(rows)
    ]
    import gzip

    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return str(path), rows


@pytest.mark.parametrize("line", sorted(BAD_LINES))
def test_malformed_line_names_file_and_line(tmp_path, broken, line):
    path, rows = broken
    how, message = BAD_LINES[line]
    one = tmp_path / "one.tsv"
    good = rows[: line - 1] + [_break(rows[line - 1], how)] + rows[line:]
    one.write_text("".join("\t".join(r) + "\n" for r in good))
    with pytest.raises(ValueError, match=f"Criteo file '{one}', {message}"):
        list(jte.data.criteo([str(one)], 8, VOCAB))


def test_malformed_lines_skipped_and_counted(broken):
    path, rows = broken
    batches = jte.data.criteo([path], 8, VOCAB, on_error="skip", drop_remainder=False)
    got = collect(batches)
    assert batches.skipped == len(BAD_LINES)
    assert len(batches.skipped_examples) == len(BAD_LINES)
    assert all(
        f"{path!r}, line {n}:" in e for e, n in zip(batches.skipped_examples, sorted(BAD_LINES))
    )
    keep = [r for i, r in enumerate(rows) if i + 1 not in BAD_LINES]
    assert_matches(got, reference(keep))  # The good lines, none shifted.
    with pytest.raises(ValueError, match="line 3: 39 tab-separated"):
        list(jte.data.criteo([path], 8, VOCAB))


def test_bad_arguments(files):
    paths, _ = files
    with pytest.raises(ValueError, match="vocabulary_sizes must be 26 positive ints"):
        jte.data.criteo(paths, 8, VOCAB[:25])
    with pytest.raises(ValueError, match='id_mapping must be "mod", "hash" or "raw", got \'md5\''):
        jte.data.criteo(paths, 8, VOCAB, id_mapping="md5")  # pyright: ignore[reportArgumentType]
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        jte.data.criteo(paths + ["nope.tsv"], 8, VOCAB)
