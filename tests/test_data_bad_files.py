"""jte.data.criteo on files that cannot give batches (issue 26, item 3): empty files, a
truncated gzip file, an integer beyond int64. Each is an error naming the file (and line and
field), or a counted skip; never a hang, a bare EOFError or OverflowError."""

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jax_tpu_embed as jte
from criteo_files import write_criteo
from test_data import VOCAB

B = 4


def _read(paths, **kwargs):
    return [b for b in jte.data.criteo(paths, B, VOCAB, prefetch=0, **kwargs)]


def _empty_gzip(path):
    with gzip.open(path, "wb"):
        pass


@pytest.mark.parametrize("kind", ["plain", "gzip", "two"])
def test_empty_files_are_an_error_naming_them(tmp_path, kind):
    paths = [tmp_path / "a.tsv"]
    if kind == "gzip":
        _empty_gzip(paths[0])
    else:
        paths[0].write_bytes(b"")
    if kind == "two":
        paths.append(tmp_path / "b.gz")
        _empty_gzip(paths[1])
    with pytest.raises(ValueError, match=r"hold no example") as e:
        _read([str(p) for p in paths])
    for p in paths:
        assert str(p) in str(e.value)


def test_every_line_skipped_or_left_out_is_the_same_error(tmp_path):
    path = tmp_path / "a.tsv"
    path.write_text("garbage\n" * 10)
    with pytest.raises(ValueError, match=r"hold no example.*skipped 10"):
        _read([str(path)], on_error="skip")
    good = tmp_path / "g.tsv"
    write_criteo(good, 20)
    with pytest.raises(ValueError, match="hold no example"):
        _read([str(good)], select_lines=lambda n: n < 0)


def test_an_empty_file_next_to_a_good_one_is_fine(tmp_path):
    empty, good = tmp_path / "e.tsv", tmp_path / "g.tsv"
    empty.write_bytes(b"")
    write_criteo(good, 8)
    assert len(_read([str(empty), str(good)])) == 2


_HANG_SCRIPT = """
import sys
import jax_tpu_embed as jte
VOCAB = [10] * 26
it = iter(jte.data.criteo([sys.argv[1]], 4, VOCAB, num_epochs=None, prefetch=2))
try:
    next(it)
except ValueError as e:
    print("RAISED", e)
"""


def test_empty_file_repeated_forever_raises_instead_of_hanging(tmp_path):
    """grain's interleave spun forever over an empty file with num_epochs=None."""
    path = tmp_path / "empty.tsv"
    path.write_bytes(b"")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(jte.__file__).parent.parent), env.get("PYTHONPATH", "")]
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _HANG_SCRIPT, str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("jte.data.criteo on an empty file with num_epochs=None hangs")
    assert "RAISED" in proc.stdout and str(path) in proc.stdout, proc.stdout + proc.stderr


def test_truncated_gzip_names_the_file(tmp_path):
    full = tmp_path / "full.gz"
    write_criteo(full, 400, gz=True)
    cut = tmp_path / "cut.gz"
    data = full.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"Criteo file '.*cut\.gz'.*truncated or corrupt gzip"):
        _read([str(cut)])


def test_integer_beyond_int64(tmp_path):
    rows = write_criteo(tmp_path / "ok.tsv", 8, empty=0.0)
    rows[5][4] = "99999999999999999999"  # I4 of line 6.
    path = tmp_path / "big.tsv"
    path.write_text("".join("\t".join(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"big\.tsv', line 6: field I4 is '99999999999999999999'"):
        _read([str(path)])
    batches = jte.data.criteo([str(path)], B, VOCAB, prefetch=0, on_error="skip")
    assert len(list(batches)) == 1  # 7 good lines: one batch of 4.
    assert batches.skipped == 1 and "line 6: field I4" in batches.skipped_examples[0]
    # The largest int64 itself is fine.
    rows[5][4] = str(2**63 - 1)
    path.write_text("".join("\t".join(r) + "\n" for r in rows))
    assert len(_read([str(path)])) == 2
