"""Will this config fit that TPU slice? Compile its train step for the slice and ask libtpu.

    python -m jax_tpu_embed.plan --config configs/criteo_1tb_dcnv2.yaml --topology v5p:4x4x4
    python -m jax_tpu_embed.plan --config CONFIG --topology v5e:4x8 --batch 16384 --json

No TPU is needed: libtpu's compiler builds the per-device program of the train step (lookup,
a tiny dense layer, loss, gradients, `apply_gradients`, state donated) from shapes alone, and
reports per chip: table and slot bytes, temporaries, the total against the chip's HBM, and the
compiler's "bytes accessed" and flops per step. Exit status: 0 if it fits, 1 if it does not
(DOES NOT FIT, with the per-chip need and a slice to try; also when one table's shard alone is
larger than a chip's HBM, which the compiler cannot place at all: then the figures are the
state's own), 2 for bad input (unknown topology, batch not a multiple of the device count or
contradicting a feature's output_shape, bad config).

The config is the project's config file (`jte.load_config`, see jax_tpu_embed/_config_file.py)
with an optional `inputs` section, read only here:

    inputs:
      batch: 65536                 # global batch B (--batch overrides it)
      ids_per_example:             # L per feature path (default 1); sequence features use
        cat_0: 3                   # their max_sequence_length
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # Plan on the CPU; never probe for a TPU.

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

from . import _aot, _config, _config_file, _embedding, _inputs, _routing  # noqa: E402

# Slice shapes to suggest when a config does not fit, smallest first.
_CUBES = (
    "2x2x1",
    "2x2x2",
    "2x2x4",
    "2x4x4",
    "4x4x4",
    "4x4x8",
    "4x8x8",
    "8x8x8",
    "8x8x16",
    "8x16x16",
)
_PLANES = ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
_SLICES = {
    "v4": _CUBES,
    "v5p": _CUBES + ("16x16x16",),
    "v5e": _PLANES,
    "v6e": _PLANES,
}


class PlanError(ValueError):
    """Bad input: the message names the value and the limit."""


def read_inputs(config: _config_file.ConfigFile) -> tuple[int | None, dict[str, int]]:
    """(batch or None, {feature path: ids per example}) from the config's `inputs` section."""
    raw = config.extra.get("inputs") or {}
    where = f"{config.path}: inputs"
    if not isinstance(raw, Mapping):
        raise PlanError(
            f"{where}: must be a mapping with `batch` and `ids_per_example`, got {raw!r}."
        )
    unknown = sorted(set(raw) - {"batch", "ids_per_example"})
    if unknown:
        raise PlanError(f"{where}.{unknown[0]}: unknown key; allowed: batch, ids_per_example.")
    batch = raw.get("batch")
    if batch is not None and (not _config.is_int(batch) or batch <= 0):
        raise PlanError(f"{where}.batch: must be an int > 0, got {batch!r}.")
    lengths = raw.get("ids_per_example") or {}
    if not isinstance(lengths, Mapping):
        raise PlanError(
            f"{where}.ids_per_example: must be a mapping {{feature path: L}}, got {lengths!r}."
        )
    paths = [p for p, _ in config.spec.flat_features]
    out = {}
    for path, length in lengths.items():
        if path not in paths:
            raise PlanError(
                f"{where}.ids_per_example.{path}: no such feature; the features are {paths}."
            )
        if not _config.is_int(length) or length <= 0:
            raise PlanError(f"{where}.ids_per_example.{path}: must be an int > 0, got {length!r}.")
        out[path] = int(length)
    return (int(batch) if batch is not None else None), out


@_inputs.x32()
def plan(
    config_path: str,
    topology: str,
    batch: int | None = None,
    *,
    max_ids_per_shard: int | None = None,
    max_unique_ids_per_shard: int | None = None,
) -> dict[str, Any]:
    """Compiles the config's train step for `topology`; the per-chip figures as a dict.

    max_ids_per_shard and max_unique_ids_per_shard go to `jte.Embedding` for every table.

    Raises:
        PlanError (a ValueError): unknown topology, bad config or inputs, or a batch that is
            not a multiple of the slice's device count.
    """
    try:
        config = _config_file.load_config(config_path)
    except FileNotFoundError as e:
        raise PlanError(str(e)) from None
    except ValueError as e:
        raise PlanError(str(e)) from None
    config_batch, lengths = read_inputs(config)
    batch = batch if batch is not None else config_batch
    if batch is None:
        raise PlanError(f"no batch: pass --batch B or set inputs.batch in {config_path}.")
    if batch <= 0:
        raise PlanError(f"--batch must be > 0, got {batch}.")
    _check_output_shapes(config.spec, batch, config_path)
    try:
        topo = _aot.topology(topology)
    except ValueError as e:
        raise PlanError(str(e)) from None
    n = len(topo.devices)
    if batch % n:
        lower, upper = batch // n * n, -(-batch // n) * n
        choices = " or ".join(str(b) for b in (lower, upper) if b > 0)
        raise PlanError(
            f"batch {batch} is not a multiple of the {n} devices of {topology} "
            f"(the batch is split evenly over every device); use {choices}."
        )
    try:
        emb = _embedding.Embedding(
            config.spec,
            _aot.mesh(topo),
            max_ids_per_shard=max_ids_per_shard,
            max_unique_ids_per_shard=max_unique_ids_per_shard,
        )
    except ValueError as e:
        raise PlanError(f"{config_path} on {topology}: {e}") from None
    report = _aot.compile_train_step(emb, batch, lengths, topo=topo, allow_oom=True)
    init_temps = _aot.init_temp_bytes(emb)
    return _result(config_path, config.spec, emb, topo, batch, lengths, report, init_temps)


def _check_output_shapes(spec: _config.EmbeddingSpec, batch: int, config_path: str) -> None:
    """A feature's output_shape fixes its number of outputs: the batch (times T for a sequence
    feature) must give that many."""
    problems = []
    for path, f in spec.flat_features:
        if f.output_shape is None:
            continue
        outputs = batch * (f.max_sequence_length or 1)
        want = math.prod(f.output_shape)
        if want != outputs:
            seq = f" x max_sequence_length {f.max_sequence_length}" if f.is_sequence else ""
            fitting = want // (f.max_sequence_length or 1)
            problems.append(
                f"feature {path!r}: output_shape {tuple(f.output_shape)} has {want} outputs, "
                f"but batch {batch}{seq} gives {outputs}"
                + (f" (its output_shape needs batch {fitting})" if fitting > 0 else "")
            )
    if problems:
        raise PlanError(f"{config_path}: " + "; ".join(problems) + ".")


def _result(
    path, spec, emb, topo, batch, lengths, r: _aot.CompileReport, init_temps: dict[str, int]
) -> dict[str, Any]:
    per_chip = topo.devices_per_chip
    tables = []
    index_shapes = emb.abstract_state().index

    def row_sharded(tree) -> int:
        """Bytes per device of the row-sharded arrays of `tree` (the replicated left out)."""
        return sum(
            math.prod(x.shape) * x.dtype.itemsize // emb.num_shards
            for x in jax.tree.leaves(tree)
            if len(x.shape) and x.shape[0] % emb.num_shards == 0
        )

    for name, table in spec.tables().items():
        plan_ = emb.table_plans[name]
        entry = {
            "name": name,
            "vocabulary_size": table.vocabulary_size,
            "dim": table.dim,
            "optimizer": type(plan_.optimizer).__name__,
            "rows_per_shard": plan_.layout.rows_per_shard,
            "placement": "host_cached" if table.cache else table.placement,
            "table_bytes_per_chip": r.table_bytes[name] * per_chip,
            "slot_bytes_per_chip": r.slot_bytes[name] * per_chip,
            "index_bytes_per_chip": 0,
            "cache_bytes_per_chip": 0,
        }
        state = index_shapes.get(name)  # A DynamicState, a HostCached table's caches, or None.
        if name in emb.dynamic:  # Rows of its capacity, and its index (ids, scores, filter).
            entry["capacity"] = emb.dynamic[name].rows
            entry["index_bytes_per_chip"] = per_chip * row_sharded(state.index)
        if table.cache:  # Its rows in host memory; a cache of them in HBM.
            cache = state.cache if name in emb.dynamic else state
            entry["cache_rows"] = table.cache.cache_rows
            entry["cache_bytes_per_chip"] = per_chip * row_sharded(cache)
        tables.append(entry)
    # Tables with placement "host" or HostCached hold their rows and slots in the hosts'
    # memory.
    in_hbm = [t for t in tables if t["placement"] == "device"]
    host = sum(
        t["table_bytes_per_chip"] + t["slot_bytes_per_chip"]
        for t in tables
        if t["placement"] != "device"
    )
    table_bytes = sum(t["table_bytes_per_chip"] for t in in_hbm)
    slot_bytes = sum(t["slot_bytes_per_chip"] for t in in_hbm)
    state = table_bytes + slot_bytes
    total = r.peak_bytes * per_chip
    hbm = topo.hbm_per_chip
    init_table = max(init_temps, key=lambda n: init_temps[n]) if init_temps else None
    init_peak = state + (init_temps[init_table] * per_chip if init_table else 0)
    every_step = [c for c in r.host_calls if not c.on_miss]
    on_miss = [c for c in r.host_calls if c.on_miss]
    out = {
        "config": path,
        "topology": topo.name,
        "chips": topo.chips,
        "devices": len(topo.devices),
        "devices_per_chip": per_chip,
        "batch": batch,
        "max_ids_per_shard": {n: p_.max_ids for n, p_ in emb.table_plans.items()},
        "max_unique_ids_per_shard": {n: p_.max_unique for n, p_ in emb.table_plans.items()},
        "ids_per_example": {
            p: lengths.get(p, f.max_sequence_length or 1) for p, f in spec.flat_features
        },
        "tables": tables,
        "per_chip": {
            "table_bytes": table_bytes,
            "slot_bytes": slot_bytes,
            "index_bytes": sum(t["index_bytes_per_chip"] for t in tables),
            "cache_bytes": sum(t["cache_bytes_per_chip"] for t in tables),
            "other_argument_bytes": r.argument_bytes * per_chip - state,
            # And the bytes the step moves between host and device (rows and their
            # indices, each host call counted once, as bytes accessed counts one pass);
            # reads of rows not in HBM (cache or staging misses) apart, per round.
            "host_bytes": host,
            "host_device_bytes_per_step": sum(c.crossing_bytes for c in every_step) * per_chip,
            "host_calls": len(every_step),
            "host_miss_calls": len(on_miss),
            "host_miss_bytes_per_round": sum(c.crossing_bytes for c in on_miss) * per_chip,
            "temp_bytes": r.temp_bytes * per_chip,
            "total_bytes": total,
            "hbm_bytes": hbm,
            "bytes_accessed": r.bytes_accessed * per_chip,
            "flops": r.flops * per_chip,
            # `init` fills the tables one after another (in row blocks, or one program per
            # table with its own initializer): the state plus one table's temporaries.
            "init_peak_bytes": init_peak,
            "init_temp_bytes": {n: t * per_chip for n, t in init_temps.items()},
        },
        "fits": max(total, init_peak) <= hbm,
        "largest_temps": [
            {
                "bytes": t.bytes,
                "shape": t.shape,
                "op": t.name,
                "source": t.op_name,
                "memory": t.space,
            }
            for t in r.largest_temps[:3]
        ],
        "collectives": {
            "count": len(r.collectives),
            "bytes": sum(c.bytes for c in r.collectives) * per_chip,
            "largest": str(max(r.collectives, key=lambda c: c.bytes)) if r.collectives else None,
        },
        "routing": routes(emb, batch, lengths),
        "compile_seconds": round(r.compile_seconds, 1),
        "compiler_oom": r.oom,
    }
    if not out["fits"]:
        out["over_by_bytes"] = max(total, init_peak) - hbm
        out["suggestion"] = _suggest(topo, state, max(total, init_peak))
    return out


@_inputs.x32()
def routes(emb, batch: int, lengths: Mapping[str, int]) -> list[dict[str, Any]]:
    """Per call of the row work (a table alone, a stack, or a part of a stack whose
    activations overflow VMEM): its state key, tables, routing and, routed to owners, the
    distinct rows one device sends each owner per round for the batch's ids per device, as
    the step takes it (`Embedding.call_plans`: capped at what the kernels' VMEM holds
    when they do the row work). A device with more distinct rows for one owner runs more
    rounds; `Embedding.id_counts` counts them on real batches."""
    per_device = batch // emb.num_shards
    shapes = {
        path: (per_device, lengths.get(path, f.max_sequence_length or 1))
        for path, f in emb.spec.flat_features
    }
    out = []
    for key, call in emb.call_plans(shapes).items():
        name = key.split("#")[0]
        entry: dict[str, Any] = {
            "arrays": name,
            "tables": list(call.tables),
            "routing": call.exchange,
            "kernel": call.kernel.name,
        }
        if call.fallback is not None:
            entry["fallback"] = call.fallback
        if call.exchange == "owner":
            entry["ids_per_device"] = call.pairs
            entry["rows_per_owner_and_round"] = call.capacity
            entry["uncapped_rows_per_owner_and_round"] = _routing.capacity(
                call.plan, call.pairs, emb.num_shards, call.k
            )
        out.append(entry)
    return out


def _route_lines(res: dict[str, Any]) -> list[str]:
    gather = sum(len(r["tables"]) for r in res["routing"] if r["routing"] == "gather")
    lines = [f"  routing               all-gather: {gather} table(s)"] if gather else []
    for r in res["routing"]:
        if "fallback" in r:
            lines.append(
                f"  fallback              {', '.join(r['tables'])}: {r['kernel']} ops, since "
                f"{r['fallback']}"
            )
    for r in res["routing"]:
        if r["routing"] != "owner":
            continue
        what = (
            f"{len(r['tables'])} stacked tables"
            if len(r["tables"]) > 1
            else f"table {r['tables'][0]}"
        )
        cap, uncapped = r["rows_per_owner_and_round"], r["uncapped_rows_per_owner_and_round"]
        why = f" ({uncapped:,} without the VMEM cap)" if cap < uncapped else ""
        lines.append(
            f"  routing               to owners, {what}: each device sends each owner up to "
            f"{cap:,} distinct rows per round{why} of its {r['ids_per_device']:,} ids; more "
            f"run more rounds, and bytes accessed counts one"
        )
    return lines


def _suggest(topo: _aot.Topology, state: int, total: int) -> str:
    """A larger slice of the same generation on which the estimate fits. Tables and slots
    shrink with the chip count; the rest (batch-sized temporaries, ids) does not."""
    rest = total - state
    hbm = topo.hbm_per_chip
    if rest >= hbm:
        return (
            f"the non-table part alone ({_aot.format_bytes(rest)} per chip: batch-sized "
            f"temporaries and inputs) exceeds HBM ({_aot.format_bytes(hbm)}); reduce "
            f"the batch."
        )
    for shape in _SLICES.get(topo.generation, ()):
        chips = math.prod(int(x) for x in shape.split("x"))
        if chips <= topo.chips:
            continue
        estimate = state * topo.chips / chips + rest
        if estimate <= 0.9 * hbm:  # Leave room for what the estimate misses.
            return (
                f"try --topology {topo.generation}:{shape} ({chips} chips; estimated "
                f"{_aot.format_bytes(estimate)} per chip of {_aot.format_bytes(hbm)})."
            )
    need = math.ceil(state * topo.chips / (0.9 * hbm - rest))
    return f"needs about {need} chips of {topo.generation}; use a larger slice or generation."


def format_table(res: dict[str, Any]) -> str:
    """The human-readable report."""
    fb = _aot.format_bytes
    c = res["per_chip"]
    lines = [
        f"{res['config']} on {res['topology']}: {res['chips']} chips, {res['devices']} "
        f"devices ({res['devices_per_chip']} per chip), global batch {res['batch']}",
        "",
        f"{'table':24s} {'vocabulary':>12s} {'dim':>5s} {'optimizer':>15s} "
        f"{'rows/shard':>11s} {'table/chip':>13s} {'slots/chip':>13s}",
    ]
    for t in res["tables"]:
        rows = (
            f"{t['vocabulary_size']:>12,}"
            if t["vocabulary_size"] is not None
            else f"{'dyn ' + format(t['capacity'], ','):>12s}"
        )
        lines.append(
            f"{t['name'][:24]:24s} {rows} {t['dim']:>5} "
            f"{t['optimizer'][:15]:>15s} {t['rows_per_shard']:>11,} "
            f"{fb(t['table_bytes_per_chip']):>13s} {fb(t['slot_bytes_per_chip']):>13s}"
            + {"device": "", "host": "  (host)", "host_cached": "  (host, cached)"}[t["placement"]]
        )
    pct = 100.0 * c["total_bytes"] / c["hbm_bytes"]
    verdict = (
        "fits"
        if res["fits"]
        else (f"DOES NOT FIT: over by {fb(res['over_by_bytes'])}; {res['suggestion']}")
    )
    temps = (
        ", ".join(f"{t['op']} {t['shape']} {fb(t['bytes'])}" for t in res["largest_temps"])
        or "none"
    )
    init = c["init_temp_bytes"]
    init_largest = f"{max(init, key=init.get)} {fb(max(init.values()))}" if init else "none"
    lines += [
        "",
        "per chip (compiler's memory and cost analysis of one train step):",
        f"  tables                {fb(c['table_bytes']):>13s}",
        f"  optimizer slots       {fb(c['slot_bytes']):>13s}",
        *(
            [f"  dynamic tables' index {fb(c['index_bytes']):>13s}   (ids, scores, filter)"]
            if c["index_bytes"]
            else []
        ),
        *(
            [
                f"  host tables' caches   {fb(c['cache_bytes']):>13s}   (HostCached: rows, "
                f"tags, ages)"
            ]
            if c["cache_bytes"]
            else []
        ),
        f"  other inputs          "
        f"{fb(c['other_argument_bytes'] - c['index_bytes'] - c['cache_bytes']):>13s}   "
        f"(ids, dense layer)",
        *(
            [
                f"  in host memory        {fb(c['host_bytes']):>13s}   (host tables "
                f"and slots; {c['host_calls']} host calls moving "
                f"{fb(c['host_device_bytes_per_step'])} per step, and "
                f"{c['host_miss_calls']} for rows not in HBM, "
                f"{fb(c['host_miss_bytes_per_round'])} a round)"
            ]
            if c["host_bytes"]
            else []
        ),
        f"  temporaries           {fb(c['temp_bytes']):>13s}   largest: {temps}",
        f"  total                 {fb(c['total_bytes']):>13s}   of {fb(c['hbm_bytes'])} HBM "
        f"({pct:.1f}%): {verdict}",
        f"  initialisation peak   {fb(c['init_peak_bytes']):>13s}   (tables and slots, plus "
        f"the largest one-table init temporaries: {init_largest})",
        f"  bytes accessed/step   {c['bytes_accessed'] / 1e9:>10.3f} GB",
        f"  flops/step            {c['flops'] / 1e9:>10.3f} GFLOP",
        f"  collectives           {res['collectives']['count']:>10d}     "
        f"largest: {res['collectives']['largest']}",
        *_route_lines(res),
        f"compiled in {res['compile_seconds']} s",
    ]
    if res["compiler_oom"]:
        lines.append(f"compiler: {res['compiler_oom']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jax_tpu_embed.plan", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--config", required=True, help="YAML or TOML config (jte.load_config)")
    p.add_argument("--topology", required=True, help="TPU slice, e.g. v5p:4x4x4 or v5e:4x8")
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="global batch B (default: the config's inputs.batch)",
    )
    p.add_argument(
        "--max-ids-per-shard",
        type=int,
        default=None,
        help="jte.Embedding's max_ids_per_shard for every table",
    )
    p.add_argument(
        "--max-unique-ids-per-shard",
        type=int,
        default=None,
        help="jte.Embedding's max_unique_ids_per_shard for every table (set it "
        "from Embedding.id_counts on real batches)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    try:  # The environment variable above is too late if jax was imported first.
        jax.config.update("jax_platforms", "cpu")
    except Exception:  # Backends already started: planning works with any of them.
        pass
    try:
        res = plan(
            args.config,
            args.topology,
            args.batch,
            max_ids_per_shard=args.max_ids_per_shard,
            max_unique_ids_per_shard=args.max_unique_ids_per_shard,
        )
    except PlanError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res, indent=2) if args.json else format_table(res))
    return 0 if res["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
