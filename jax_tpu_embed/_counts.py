"""`Embedding.id_counts` on the host: how a global batch loads the shards, per table.

Counts in NumPy what the step would do with the batch: the pairs, the most owned pairs and
distinct rows of any shard, and the passes (or owner routing's rounds) of the call that
serves each table, read from the same call plans the step runs (`_exchange.plan_calls`).
"""

from __future__ import annotations

import jax
import numpy as np

from . import _exchange, _inputs, _plan, _routing, _streams


def id_counts(plan: _plan.EmbeddingPlan, flat: dict) -> dict:
    """{table name: {"pairs", "owned_pairs", "unique_rows", "passes"}} (see
    `Embedding.id_counts`) for the flat features `flat` of a global batch."""
    num_shards = plan.num_shards
    ids_by_table: dict[str, list] = {}
    shapes = {}
    for f in plan.features:
        leaf = flat[f.path]
        for x in jax.tree.leaves(leaf):
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                raise ValueError(
                    f"id_counts: feature {f.path!r} is a jax.Array spanning "
                    f"several processes; pass the global batch as NumPy."
                )
        ids, _ = _inputs.normalize(f.config, leaf)
        shapes[f.path] = (ids.shape[0] // num_shards, ids.shape[1])
        # (N, b·L): each device's pairs, for owner routing's rounds.
        ids_by_table.setdefault(f.table, []).append(np.asarray(ids).reshape(num_shards, -1))
    out = {}
    for name, parts in ids_by_table.items():
        table = plan.tables[name]
        ids = np.concatenate(parts, axis=1).reshape(-1)
        valid = ids[(ids >= 0) & (ids < table.config.vocabulary_size)]
        owner, _, _ = table.index.locate(name, valid)
        owned = unique = 0
        for p in range(num_shards):
            rows, counts = np.unique(valid[owner == p], return_counts=True)
            owned, unique = max(owned, int(counts.sum())), max(unique, len(rows))
        out[name] = {"pairs": ids.shape[0], "owned_pairs": owned, "unique_rows": unique}
    for call, _ in _exchange.plan_calls(plan, shapes).values():
        names = [n for n in call.tables if n in ids_by_table]
        if not names:
            continue
        owners, locals_ = [], []
        for n in names:
            per_device = np.concatenate(ids_by_table[n], axis=1)
            o, loc, found = call.plan.index.locate(n, np.maximum(per_device, 0))
            owners.append(np.where(found & (per_device >= 0), o, -1))
            locals_.append(loc)
        owner, local = np.concatenate(owners, axis=1), np.concatenate(locals_, axis=1)
        if call.exchange == "owner":
            passes = _routing.rounds_needed(call.capacity, owner, local)
        elif call.single:
            passes = 1
        else:
            passes = 0
            for p in range(num_shards):
                _, counts = np.unique(local[owner == p], return_counts=True)
                passes = max(passes, _streams.passes_needed(counts, call.capacity, call.unique))
        for n in names:
            out[n]["passes"] = passes
    return out
