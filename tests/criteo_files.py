"""Criteo-format TSV files for tests: empty fields, negative counts, a planted signal."""

import gzip

import numpy as np


def write_criteo(path, n, seed=0, *, gz=False, empty=0.2, signal=True):
    """Writes n lines of Criteo's 40-field TSV; returns the fields as written (strings).

    The label depends on C1's value (half of its 50 values click far more often), on I1 and on
    C2 x C3, so a model can learn it. About `empty` of the feature fields are empty.
    """
    rng = np.random.default_rng(seed)
    c1 = rng.integers(0, 50, n)
    c2, c3 = rng.integers(0, 8, n), rng.integers(0, 8, n)
    i1 = rng.integers(0, 30, n)
    logit = np.where(c1 % 2 == 0, 1.5, -1.5) + 0.1 * (i1 - 15) + np.where(c2 == c3, 1.0, 0.0)
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))) if signal else rng.random(n) < 0.3
    # Hex forms of the categorical values: 32-bit hashes, as in Criteo's files.
    salt = rng.integers(0, 2**32, 26, dtype=np.uint64)
    rows = []
    for k in range(n):
        ints = [str(i1[k])] + [str(x) for x in rng.integers(-3, 200, 12)]
        raw = [c1[k], c2[k], c3[k]] + list(rng.integers(0, 20, 23))
        cats = ["%08x" % ((int(v) * 2654435761 + int(s)) % 2**32) for v, s in zip(raw, salt)]
        fields = ints + cats
        for j in range(39):
            if rng.random() < empty:
                fields[j] = ""
        rows.append([str(int(labels[k]))] + fields)
    text = "".join("\t".join(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)
    return rows
