"""Ids to rows: the one step between a feature's ids and the rows of its table's arrays.

Every consumer of ids inside the step (the all-gather streams, owner routing) and on the
host (`id_counts`) asks a table's `RowIndex` where an id lives: the shard that owns it, its
row in that shard's array (a stack's arrays included), and whether it has a row at all. The
ids reaching it are normalized (`_inputs.normalize`): -1 for "nothing here", else valid.

`Arithmetic`, the first implementation, is TensorFlow's "div"/"mod" ownership of a fixed
vocabulary (`_layout.TableLayout`), offset by each table's first row in its stack: it holds
no state, and every valid id has a row. A table whose index holds state (a hash table that
admits new ids inside the step) is a second implementation of the same interface; the row
kernels only ever see local rows.

The sentinels of the int32 keys the engine sorts live here, with the widths they bound.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from . import _layout

# Local rows are < 2**30 (`MAX_LOCAL_ROWS`, checked when a plan is built); keys at or above
# NOT_MINE mark "no row of this shard". A sort of such keys puts them after every row.
NOT_MINE = 1 << 30
MAX_LOCAL_ROWS = NOT_MINE
# Owner routing's sort key of "no row" (padding): after every owner·S + local key, so N·S
# must stay below it (`fits_owner_keys`).
NONE = int(np.iinfo(np.int32).max)


def fits_owner_keys(num_shards: int, rows_per_shard: int) -> bool:
    """Whether owner·S + local keys of N shards of S rows stay below NONE (int32)."""
    return num_shards * rows_per_shard < NONE


class RowIndex(Protocol):
    """Where the ids of the tables stored in one array live."""

    def locate(self, table: str, ids):
        """(owner shard, local row in the array, found) of the normalized ids (jnp or np)
        of table `table`; where not found, owner and local are meaningless."""
        ...


@dataclasses.dataclass(frozen=True)
class Arithmetic:
    """div/mod ownership of each table's fixed vocabulary: `tables` holds (name, layout,
    first local row) per table stored in the array; `stacked`: the array is a stack's
    (local rows offset by the table's first row), else it holds one table alone."""

    tables: tuple[tuple[str, _layout.TableLayout, int], ...]
    stacked: bool = False

    def locate(self, table: str, ids):
        for name, layout, offset in self.tables:
            if name == table or not self.stacked:
                owner, local = layout.owner_and_local(ids)
                return owner, (local + offset if self.stacked else local), ids >= 0
        raise KeyError(f"table {table!r} is not stored in this array")
