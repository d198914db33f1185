"""Criteo click logs as training batches, read with grain.

    batches = jte.data.criteo(["day_0.gz", "day_1.gz"], batch_size=8192,
                              vocabulary_sizes=[...26 ints...], sharding=batch_sharding)
    for batch in batches:    # {"dense": (B, 13), "sparse": {"C1".."C26": (B,)}, "labels": (B,)}
        state, metrics = step(state, batch)
    batches.skipped          # malformed lines skipped (on_error="skip")

    # Dynamic tables: the raw values as int64 ids (jte.SplitIds halves with a sharding).
    batches = jte.data.criteo(paths, 8192, None, id_mapping="raw", sharding=batch_sharding)

The format is Criteo's click-log TSV, the same in the Kaggle display-advertising file
(`train.txt`) and the Criteo 1TB day files (`day_0` .. `day_23`, usually gzipped): one example
per line, 40 tab-separated fields: the label (0 or 1), 13 integer features I1..I13 and 26
categorical features C1..C26 written as hexadecimal strings (32-bit hashes in Criteo's files).
Any feature field may be empty. Files are read as plain text or gzip, told apart by their first
bytes, not by their names.

Transforms, fixed so that a model trained here sees what the DLRM reference preprocessing
gives:

- dense: log(1 + max(x, 0)) as float32. An empty field is 0. Negative counts (Criteo's I2 has a
  few, down to -3) are clamped to 0 first, as the DLRM reference does, so log stays defined.
- sparse: the hex string's value x (at most 16 hex digits) becomes a row id of the feature's
  table of V rows: `id_mapping="mod"` (default) is x mod V, MLPerf's DLRM rule, so rows match
  the reference implementation's; `"hash"` is a 64-bit mix of x (splitmix64's finalizer,
  seeded per feature) mod V, which spreads values evenly over V rows whatever their
  distribution (use it for data whose categorical values are not already hashes). An empty
  field is x = 0, as in the reference preprocessing, so it shares a row with the value 0.
  `"raw"` keeps x itself as an int64 id, for dynamic tables (`jte.DynamicTable`): no
  vocabulary, no collisions; an empty field is -1, the padding id (no row, a zero vector
  under every combiner), so it never shares a row with the value 0. Values of 16 hex digits
  from 8000000000000000 up are read as 64-bit two's complement (negative ids, which dynamic
  tables take), except ffffffffffffffff: that would be -1, so such a line is malformed.
- labels: float32 0. or 1.

A malformed line (not 40 fields, a label other than 0/1, an integer field that is not an
integer, a categorical field that is not hexadecimal) raises ValueError naming the file, the
line number (1-based) and the field; with `on_error="skip"` such lines are dropped and counted
(`.skipped`, `.skipped_examples` for the first few reasons). Fields are never re-aligned: a
line is taken whole or not at all.

Pipeline: each process takes every `jax.process_count()`-th file (its own share); per file, a
grain dataset reads chunks of lines and parses them with NumPy (vectorised: per line only a
`bytes.split`); a grain interleave reads `num_threads` files at once, each in its own thread;
a rebatch makes batches of exactly B / process_count rows; a grain thread prefetch keeps
`prefetch` batches ready (and builds the global `jax.Array`s there when a sharding is given),
so parsing overlaps the training step.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import jax
import numpy as np

from . import _inputs

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_NAMES = tuple(f"I{i + 1}" for i in range(NUM_DENSE))
SPARSE_NAMES = tuple(f"C{i + 1}" for i in range(NUM_SPARSE))
_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
_FIELD_NAMES = ("label",) + DENSE_NAMES + SPARSE_NAMES
_MAX_HEX_DIGITS = 16  # A uint64.
_KEPT_REASONS = 10
_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)

# Hex digit of each byte; -1 for the NUL padding of NumPy's fixed-width bytes, -2 for others.
_HEX = np.full(256, -2, np.int8)
_HEX[0] = -1
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


def _grain():
    """grain, imported on first use: most users of the package never read Criteo files."""
    import grain

    return grain


ID_MAPPINGS = ("mod", "hash", "raw")


def hash_ids(
    values: np.ndarray, vocabulary_sizes: Sequence[int] | None, mapping: str
) -> np.ndarray:
    """Row ids of categorical values: (n, F) uint64 values -> (n, F) int32 ids in [0, V_f).

    "mod": value mod V_f. "hash": splitmix64's finalizer of (value + golden * (f + 1)),
    mod V_f, so each feature hashes differently. "raw": the values themselves as int64 ids
    (64-bit two's complement; vocabulary_sizes unused, may be None), for dynamic tables;
    empty fields are the caller's to set to -1.
    """
    values = np.asarray(values, np.uint64)
    if mapping == "raw":
        return values.view(np.int64)
    if vocabulary_sizes is None:
        raise ValueError(f"hash_ids: mapping {mapping!r} needs vocabulary_sizes (V_f).")
    v = np.asarray(vocabulary_sizes, np.uint64)
    if mapping == "hash":
        # splitmix64 finalizer; uint64 arithmetic wraps, which the mix relies on.
        seeds = np.uint64(0x9E3779B97F4A7C15) * np.arange(1, len(v) + 1, dtype=np.uint64)
        z = values + seeds
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        values = z ^ (z >> np.uint64(31))
    return (values % v).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """Raw lines of one file: lines[i] is line first_line + i (1-based)."""

    path: str
    first_line: int
    lines: list[bytes]


def _open(path: str):
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def _read_chunks(path: str, chunk_lines: int) -> Iterator[_Chunk]:
    line = 1
    with _open(path) as f:
        while True:
            try:
                lines = f.readlines(chunk_lines * 160)  # Size hint: ~160 bytes per line.
            except (EOFError, OSError, zlib.error) as e:  # gzip's errors of a cut file.
                raise ValueError(
                    f"Criteo file {path!r}: reading after line {line - 1} failed with "
                    f"{type(e).__name__}: {e} (a truncated or corrupt gzip file?)."
                ) from e
            if not lines:
                return
            yield _Chunk(path, line, lines)
            line += len(lines)


class _Parser:
    """Parses chunks into arrays; counts the lines it skips (shared by reader threads)."""

    def __init__(self, vocabulary_sizes, id_mapping, on_error, select_lines, files=()):
        self.files = list(files)
        self.examples = 0  # Examples parsed, over every file and pass.
        self.ended: set[str] = set()  # Files read to their end at least once.
        self.select_lines = select_lines
        self.vocabulary_sizes = vocabulary_sizes
        self.id_mapping = id_mapping
        self.on_error = on_error
        self.lock = threading.Lock()
        self.skipped = 0
        self.skipped_examples: list[str] = []

    def __call__(self, chunk: _Chunk) -> dict[str, np.ndarray]:
        lines = chunk.lines
        if self.select_lines is not None:
            numbers = chunk.first_line + np.arange(len(lines), dtype=np.int64)
            selected = np.flatnonzero(np.asarray(self.select_lines(numbers), bool))
            lines = [lines[i] for i in selected]
            where = chunk.first_line + selected  # Line number of each kept line.
        else:
            where = chunk.first_line + np.arange(len(lines), dtype=np.int64)
        rows = [line.rstrip(b"\r\n").split(b"\t") for line in lines]
        problems: dict[int, str] = {}
        for i, row in enumerate(rows):
            if len(row) != _FIELDS:
                problems[i] = (
                    f"{len(row)} tab-separated fields, expected {_FIELDS} (label, I1..I13, "
                    f"C1..C26; empty fields are allowed, missing tabs are not)"
                )
        keep = [i for i in range(len(rows)) if i not in problems]
        fields = np.array([rows[i] for i in keep], dtype=bytes).reshape(len(keep), _FIELDS)
        labels, dense, values, empty, bad = _convert(fields, self.id_mapping)
        for k, message in bad.items():
            problems[keep[k]] = message
        if problems:
            self._report(chunk.path, where, problems)
            ok = np.ones(len(keep), bool)
            ok[list(bad)] = False
            labels, dense, values, empty = labels[ok], dense[ok], values[ok], empty[ok]
        with self.lock:
            self.examples += len(labels)
        ids = hash_ids(values, self.vocabulary_sizes, self.id_mapping)
        if self.id_mapping == "raw":
            ids[empty] = -1  # Padding: no row. (mod and hash: an empty field is the value 0.)
        return {"dense": dense, "sparse": ids, "labels": labels}

    def file_ended(self, path: str) -> None:
        """Called when a file is read to its end (every chunk of it parsed). Once every
        file has been, no example means none will ever come: an error, instead of zero
        batches (num_epochs=1) or a pipeline that spins forever (num_epochs=None)."""
        with self.lock:
            self.ended.add(path)
            if self.examples or not self.ended.issuperset(self.files):
                return
        raise ValueError(
            f"data.criteo: the files {self.files} hold no example: they are empty, or every "
            f"line was left out by select_lines or skipped as malformed "
            f"(on_error={self.on_error!r}; skipped {self.skipped})."
        )

    def _report(self, path: str, where: np.ndarray, problems: dict[int, str]) -> None:
        messages = [
            f"Criteo file {path!r}, line {where[i]}: {problems[i]}" for i in sorted(problems)
        ]
        if self.on_error == "raise":
            more = (
                f" (and {len(messages) - 1} more lines in this chunk)" if len(messages) > 1 else ""
            )
            raise ValueError(
                messages[0] + more + '. Pass on_error="skip" to drop and count such lines.'
            )
        with self.lock:
            self.skipped += len(messages)
            room = _KEPT_REASONS - len(self.skipped_examples)
            self.skipped_examples.extend(messages[: max(room, 0)])


def _text(field) -> str:
    return bytes(field).decode("utf-8", "replace")


def _convert(
    fields: np.ndarray, id_mapping: str = "mod"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, str]]:
    """(n, 40) bytes fields -> labels (n,) f32, dense (n, 13) f32, values (n, 26) u64 (0
    where empty), empty (n, 26) bool, and {row: problem} for rows that are malformed (their
    outputs are garbage)."""
    n = fields.shape[0]
    bad: dict[int, str] = {}
    label_field = fields[:, 0]
    labels = (label_field == b"1").astype(np.float32)
    for i in np.flatnonzero((label_field != b"0") & (label_field != b"1")):
        bad[int(i)] = f"label is {_text(label_field[i])!r}, expected 0 or 1"

    ints = fields[:, 1 : 1 + NUM_DENSE]
    ints = np.where(ints == b"", b"0", ints)
    try:
        counts = ints.astype(np.int64)
    except (ValueError, OverflowError):  # Not an integer, or one beyond int64.
        counts = np.zeros(ints.shape, np.int64)
        for i, j in np.ndindex(*ints.shape):
            try:
                value = int(ints[i, j])
            except ValueError:
                bad.setdefault(
                    i,
                    f"field {DENSE_NAMES[j]} is {_text(ints[i, j])!r}, expected an integer "
                    f"(or empty)",
                )
                continue
            if not _INT64_MIN <= value <= _INT64_MAX:
                bad.setdefault(
                    i,
                    f"field {DENSE_NAMES[j]} is {_text(ints[i, j])!r}, beyond the int64 "
                    f"range of an integer feature",
                )
                continue
            counts[i, j] = value
    dense = np.log1p(np.maximum(counts, 0).astype(np.float32))

    cats = np.ascontiguousarray(fields[:, 1 + NUM_DENSE :])  # (n, 26) S<w>
    width = cats.dtype.itemsize
    digits = _HEX[cats.view(np.uint8).reshape(n, NUM_SPARSE, width)]  # (n, 26, w)
    invalid = (digits == -2).any(-1)
    if width > _MAX_HEX_DIGITS:
        invalid |= (digits[..., _MAX_HEX_DIGITS:] != -1).any(-1)
    for i, j in zip(*np.nonzero(invalid)):
        bad.setdefault(
            int(i),
            f"field {SPARSE_NAMES[j]} is {_text(cats[i, j])!r}, expected at most "
            f"{_MAX_HEX_DIGITS} hexadecimal digits (or empty)",
        )
    values = np.zeros((n, NUM_SPARSE), np.uint64)
    for k in range(min(width, _MAX_HEX_DIGITS)):
        d = digits[..., k]
        values = np.where(d >= 0, values * np.uint64(16) + d.astype(np.uint64), values)
    empty = cats == b""
    if id_mapping == "raw":  # The id -1 is padding: a value that would be it is an error.
        for i, j in zip(*np.nonzero((values == np.uint64(2**64 - 1)) & ~invalid)):
            bad.setdefault(
                int(i),
                f"field {SPARSE_NAMES[j]} is {_text(cats[i, j])!r}, which is -1 as an int64 id "
                f'(id_mapping="raw"), the padding id; leave the field empty for a missing value',
            )
    return labels, dense, values, empty, bad


class CriteoBatches:
    """The iterable `criteo` returns; each `iter()` starts from the first line again.

    Attributes:
        skipped: Malformed lines skipped so far (on_error="skip"), over every iteration.
        skipped_examples: The first few skipped lines' file, line number and problem.
        files: This process's files.
    """

    def __init__(self, dataset, parser: _Parser, files: list[str]):
        self._dataset = dataset
        self._parser = parser
        self.files = files

    @property
    def skipped(self) -> int:
        return self._parser.skipped

    @property
    def skipped_examples(self) -> list[str]:
        return list(self._parser.skipped_examples)

    def __iter__(self) -> Any:
        """A grain DatasetIterator of batches; `.close()` stops its reader threads early."""
        return iter(self._dataset)


def criteo(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    batch_size: int,
    vocabulary_sizes: Sequence[int] | None,
    *,
    id_mapping: Literal["mod", "hash", "raw"] = "mod",
    sharding: jax.sharding.Sharding | None = None,
    on_error: Literal["raise", "skip"] = "raise",
    num_epochs: int | None = 1,
    drop_remainder: bool = True,
    num_threads: int = 2,
    prefetch: int = 4,
    chunk_lines: int = 4096,
    select_lines: Callable[[np.ndarray], np.ndarray] | None = None,
) -> CriteoBatches:
    """Batches of Criteo click-log TSV files (format and transforms: the module docstring).

    Args:
        paths: One file or a list; plain or gzip. Process p of P reads paths[p::P].
        batch_size: Global B; each process yields B / P rows of every batch.
        vocabulary_sizes: V of C1..C26 (26 ints): ids are in [0, V). Unused (may be None)
            with id_mapping="raw".
        id_mapping: "mod" (x mod V, MLPerf's rule), "hash" (64-bit mix, then mod V) or "raw"
            (x itself as an int64 id, -1 where empty: for dynamic tables).
        sharding: For dimension 0 of every leaf, e.g. NamedSharding(mesh, P(axis)): leaves
            become global jax.Arrays (`jax.make_array_from_process_local_data`) built in the
            prefetch thread. None: NumPy arrays (then P must be 1). With id_mapping="raw" the
            int64 ids are split on the host (`jte.split_ids`) first: each feature becomes a
            `jte.SplitIds` of two global uint32 arrays, what a jitted step takes without
            `jax_enable_x64`.
        on_error: "raise" (ValueError naming file and line) or "skip" (count and drop).
        num_epochs: Passes over the files; None repeats forever.
        drop_remainder: Drop the last batch if it is short (keeps shapes fixed for jit).
        num_threads: Files read and parsed at once, each in its own thread.
        prefetch: Batches kept ready ahead of the consumer.
        chunk_lines: About how many lines one parse call takes.
        select_lines: Optional; given int64 (n,) 1-based line numbers of one file, returns a
            bool (n,) mask of the lines to read, e.g. `lambda n: n % 10 != 0` for a training
            split and `lambda n: n % 10 == 0` for its held-out lines. Lines left out are not
            parsed (nor checked).

    Returns:
        An iterable of {"dense": float32 (B, 13), "sparse": {"C1".."C26": int32 (B,)},
        "labels": float32 (B,)}, with `.skipped` and `.skipped_examples`. With
        id_mapping="raw" the sparse leaves are int64 (B,) (NumPy), or `jte.SplitIds` of
        uint32 (B,) halves with a sharding.
    """
    grain = _grain()
    if not isinstance(drop_remainder, bool):
        raise TypeError(f"data.criteo: drop_remainder must be a bool, got {drop_remainder!r}.")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if id_mapping not in ID_MAPPINGS:
        raise ValueError(
            f'data.criteo: id_mapping must be "mod", "hash" or "raw", got {id_mapping!r}.'
        )
    if vocabulary_sizes is None and id_mapping != "raw":
        raise ValueError(
            f"data.criteo: id_mapping={id_mapping!r} needs vocabulary_sizes ({NUM_SPARSE} "
            f'positive ints, C1..C26); only id_mapping="raw" takes None.'
        )
    if vocabulary_sizes is not None:
        vocabulary_sizes = [int(v) for v in vocabulary_sizes]
        if len(vocabulary_sizes) != NUM_SPARSE or min(vocabulary_sizes) < 1:
            raise ValueError(
                f"data.criteo: vocabulary_sizes must be {NUM_SPARSE} positive ints (C1..C26), "
                f"got {vocabulary_sizes!r}."
            )
    if on_error not in ("raise", "skip"):
        raise ValueError(f'data.criteo: on_error must be "raise" or "skip", got {on_error!r}.')
    missing = [p for p in paths if not os.path.isfile(p)]
    if not paths or missing:
        raise FileNotFoundError(f"data.criteo: no such files: {missing or 'none given'}.")
    processes, index = jax.process_count(), jax.process_index()
    if sharding is None and processes > 1:
        raise ValueError(
            f"data.criteo: with {processes} processes pass sharding= (the batch sharding) so "
            f"that each process's rows become global arrays."
        )
    if len(paths) < processes:
        raise ValueError(
            f"data.criteo: {len(paths)} files for {processes} processes; each process reads "
            f"its own files, so give at least one per process (split large files)."
        )
    if batch_size <= 0 or batch_size % processes:
        raise ValueError(
            f"data.criteo: batch_size={batch_size} must be a positive multiple of the "
            f"{processes} processes."
        )
    local_batch = batch_size // processes
    files = paths[index::processes]
    parser = _Parser(vocabulary_sizes, id_mapping, on_error, select_lines, files)

    def file_dataset(path: str):
        source = _file_chunks_class()(path, chunk_lines, parser.file_ended)
        return source.map(parser).filter(lambda c: c["labels"].shape[0] > 0)

    sources = grain.MapDataset.source(files)
    if num_epochs != 1:
        sources = sources.repeat(num_epochs)
    per_file: Any = sources.map(file_dataset)  # A MapDataset of IterDatasets.
    ds = grain.experimental.InterleaveIterDataset(
        per_file, cycle_length=max(1, num_threads), iter_buffer_size=2
    )
    ds = grain.experimental.RebatchIterDataset(ds, local_batch, drop_remainder=drop_remainder)

    def finish(batch):
        out = {
            "dense": batch["dense"],
            "sparse": {name: batch["sparse"][:, j] for j, name in enumerate(SPARSE_NAMES)},
            "labels": batch["labels"],
        }
        if sharding is not None:
            if id_mapping == "raw":  # No global int64 arrays without x64: uint32 halves.
                out["sparse"] = {k: _inputs.split_ids(v) for k, v in out["sparse"].items()}
            out = jax.tree.map(
                lambda x: jax.make_array_from_process_local_data(
                    sharding, np.ascontiguousarray(x), (x.shape[0] * processes, *x.shape[1:])
                ),
                out,
            )
        return out

    ds = ds.map(finish)
    if prefetch > 0:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
    return CriteoBatches(ds, parser, files)


@functools.cache
def _file_chunks_class():
    """A grain IterDataset over the chunks of one file; made on first use so that importing
    jax_tpu_embed does not import grain."""
    grain = _grain()

    class FileChunksIterator(grain.DatasetIterator):
        def __init__(self, path: str, chunk_lines: int, on_end: Callable[[str], None]):
            super().__init__()
            self._path, self._on_end = path, on_end
            self._chunks = _read_chunks(path, chunk_lines)
            self._next_line = 1

        def __next__(self) -> _Chunk:
            try:
                chunk = next(self._chunks)
            except StopIteration:
                self._on_end(self._path)  # The chunks before were parsed: map is lazy.
                raise
            self._next_line = chunk.first_line + len(chunk.lines)
            return chunk

        def get_state(self):
            return {"next_line": self._next_line}

        def set_state(self, state):
            raise NotImplementedError("data.criteo: resuming mid-file is not supported.")

    class FileChunks(grain.IterDataset):
        def __init__(self, path: str, chunk_lines: int, on_end: Callable[[str], None]):
            super().__init__()
            self.path, self.chunk_lines, self.on_end = path, chunk_lines, on_end

        def __iter__(self):
            return FileChunksIterator(self.path, self.chunk_lines, self.on_end)

    return FileChunks
