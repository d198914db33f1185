"""Timing harness: one subprocess per engine, results as dicts, a table, JSON and a PNG chart.

Per engine and workload the worker process
  1. generates the workload (deterministic, identical in every process),
  2. imports the engine's framework (a missing package gives status "skipped" with a message),
  3. times ``setup`` (tables, slots, batches on the device), ``compile`` (ahead-of-time compile
     where the engine has one: the JAX engines) and the first step separately,
  4. runs ``warmup`` untimed steps, then ``steps`` timed steps (each one synchronous), cycling
     through the 4 pre-generated batches; an optional time budget stops the timed loop early
     (never before ``min_steps``), and the result records how many steps were timed,
  5. reports median/min/max/mean ms per step, steps/s, examples/s, essential GB/s (mean
     essential bytes of the 4 batches / median step time), peak RSS (``ru_maxrss``), the RSS
     after the framework import and after setup (psutil), and the bytes of tables + slots that
     the engine holds, so peak RSS can be compared with the state it must hold.

Ratios are computed only between results of the same run (same invocation, same machine
state): ``speedup vs X`` = median ms of baseline X / median ms of the engine (> 1: faster).

Worker entry point: ``python benchmarks/harness.py --worker SPEC.json RESULT.json``.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import engines as engines_mod  # noqa: E402
import workloads as workloads_mod  # noqa: E402

GB = 1e9


def _rss_now() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _ForeignLoad:
    """CPU time used by *other* processes during a window, in cores (noise indicator)."""

    def __enter__(self):
        try:
            import psutil

            self._ps = psutil
            self._sys0 = psutil.cpu_times()
            self._own0 = psutil.Process().cpu_times()
        except Exception:
            self._ps = None
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.cores = None
        if self._ps is None:
            return False
        s1, o1 = self._ps.cpu_times(), self._ps.Process().cpu_times()
        wall = time.perf_counter() - self._t0
        busy = lambda c: sum(c) - c.idle - getattr(c, "iowait", 0.0)  # noqa: E731
        own = (o1.user + o1.system) - (self._own0.user + self._own0.system)
        self.cores = max(0.0, (busy(s1) - busy(self._sys0) - own) / max(wall, 1e-9))
        return False


def _peak_rss() -> int:
    # Linux: ru_maxrss in KiB.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# ==========================================================================================
# in-process measurement (runs inside the worker subprocess)
# ==========================================================================================


def measure(
    engine_name: str,
    cfg: workloads_mod.WorkloadConfig,
    *,
    steps: int = 20,
    warmup: int = 3,
    max_seconds: float | None = None,
    min_steps: int = 5,
    engine_kwargs: dict | None = None,
) -> dict:
    cls = engines_mod.ENGINES[engine_name]
    engine = cls(**(engine_kwargs or {}))
    res = {
        "engine": engine_name,
        "workload": cfg.to_dict(),
        "status": "ok",
        "message": "",
        "engine_info": engine.info(),
        "pid": os.getpid(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "state_bytes_expected": cfg.state_bytes(engine.optimizer),
    }
    res["rss_start_bytes"] = _rss_now()
    res["loadavg_start"] = os.getloadavg()[0]
    wl = workloads_mod.generate(cfg)
    res["workload_gen_s"] = wl.gen_seconds
    res["unique_rows_per_step"] = wl.mean_unique_rows()
    res["essential_bytes_per_step"] = wl.mean_essential_bytes()

    msg = engine.check_available()
    if msg:
        res.update(status="skipped", message=msg)
        return res
    res["versions"] = engine.versions()
    res["rss_after_import_bytes"] = _rss_now()

    t = time.perf_counter()
    engine.setup(wl)
    res["setup_s"] = time.perf_counter() - t
    res["rss_after_setup_bytes"] = _rss_now()
    res["state_bytes"] = engine.state_bytes()

    t = time.perf_counter()
    engine.compile()
    res["compile_s"] = time.perf_counter() - t

    nb = wl.num_batches
    t = time.perf_counter()
    engine.step(0)
    res["first_step_ms"] = (time.perf_counter() - t) * 1e3
    i = 1
    for _ in range(warmup):
        engine.step(i % nb)
        i += 1

    times = []
    t_loop = time.perf_counter()
    foreign = _ForeignLoad().__enter__()
    for n in range(steps):
        t = time.perf_counter()
        engine.step(i % nb)
        times.append(time.perf_counter() - t)
        i += 1
        if (
            max_seconds is not None
            and n + 1 >= min_steps
            and time.perf_counter() - t_loop > max_seconds
        ):
            res["message"] = (
                f"time budget {max_seconds:g} s reached: {n + 1} of {steps} steps timed"
            )
            break
    foreign.__exit__(None, None, None)
    res["other_processes_cores"] = foreign.cores
    ms = np.array(times) * 1e3
    med = float(np.median(ms))
    res.update(
        steps_requested=steps,
        steps_timed=len(times),
        warmup=warmup,
        times_ms=ms.tolist(),
        median_ms=med,
        min_ms=float(ms.min()),
        max_ms=float(ms.max()),
        mean_ms=float(ms.mean()),
        steps_per_s=1e3 / med,
        examples_per_s=cfg.batch * 1e3 / med,
        essential_gb_per_s=wl.mean_essential_bytes() / (med / 1e3) / GB,
        peak_rss_bytes=_peak_rss(),
        rss_end_bytes=_rss_now(),
        loadavg_end=os.getloadavg()[0],
    )
    res["peak_rss_over_state"] = res["peak_rss_bytes"] / max(res["state_bytes"], 1)
    return res


def worker_main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    cfg = workloads_mod.WorkloadConfig(**spec["workload"])
    try:
        res = measure(spec["engine"], cfg, **spec.get("options", {}))
    except Exception as e:
        res = {
            "engine": spec["engine"],
            "workload": cfg.to_dict(),
            "status": "error",
            "message": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-4000:],
            "peak_rss_bytes": _peak_rss(),
        }
    with open(out_path, "w") as f:
        json.dump(res, f)
    return 0


# ==========================================================================================
# parent side: subprocesses, memory guard
# ==========================================================================================

ENV_KEYS = ("XLA_FLAGS", "JAX_PLATFORMS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY")


def engine_env(engine_name: str, overrides: dict | None = None) -> dict:
    """The subprocess environment of an engine: its XLA device count, CPU platform, OpenMP
    threads; ``overrides`` (e.g. {"OMP_WAIT_POLICY": "PASSIVE"}) last, None values unset."""
    cls = engines_mod.ENGINES[engine_name]
    env = dict(os.environ)
    env["XLA_FLAGS"] = engines_mod.xla_flags_for(cls)
    env.setdefault("JAX_PLATFORMS", "cpu")  # never probe for TPU/GPU plugins
    env["OMP_NUM_THREADS"] = str(cls.threads)
    env["PYTHONUNBUFFERED"] = "1"
    for k, v in (overrides or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


def memory_guard(engine_name: str, cfg, fraction: float = 0.85) -> str | None:
    """A skip message if the engine's estimated peak would not fit in available memory."""
    cls = engines_mod.ENGINES[engine_name]
    need = cfg.state_bytes(cls.optimizer) * cls.memory_factor
    try:
        import psutil

        avail = psutil.virtual_memory().available
    except Exception:
        return None
    if need > fraction * avail:
        return (
            f"estimated peak {need / GB:.1f} GB (tables+slots "
            f"{cfg.state_bytes(cls.optimizer) / GB:.1f} GB × {cls.memory_factor}) exceeds "
            f"{fraction:.0%} of available memory {avail / GB:.1f} GB; skipped"
        )
    return None


def run_engine(
    engine_name: str,
    cfg,
    *,
    options: dict | None = None,
    timeout: float = 1800,
    verbose: bool = True,
    env_overrides: dict | None = None,
) -> dict:
    """Runs one engine on one workload in a fresh subprocess and returns its result dict."""
    msg = memory_guard(engine_name, cfg)
    if msg:
        return {
            "engine": engine_name,
            "workload": cfg.to_dict(),
            "status": "skipped",
            "message": msg,
        }
    with tempfile.TemporaryDirectory(prefix="jte_bench_") as d:
        spec_path, out_path = os.path.join(d, "spec.json"), os.path.join(d, "result.json")
        with open(spec_path, "w") as f:
            json.dump(
                {"engine": engine_name, "workload": cfg.to_dict(), "options": options or {}}, f
            )
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", spec_path, out_path]
        t = time.perf_counter()
        if verbose:
            print(f"  [{cfg.name}] {engine_name} ...", end="", flush=True)
        try:
            env = engine_env(engine_name, env_overrides)
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            rc, log = p.returncode, (p.stdout + p.stderr)
        except subprocess.TimeoutExpired as e:
            rc, log = None, f"timeout after {timeout:g} s"
            out = (e.stdout or b"") + (e.stderr or b"")
            log += "\n" + (out.decode(errors="replace") if isinstance(out, bytes) else out)
        wall = time.perf_counter() - t
        if os.path.exists(out_path):
            with open(out_path) as f:
                res = json.load(f)
        else:
            res = {
                "engine": engine_name,
                "workload": cfg.to_dict(),
                "status": "error",
                "message": (f"worker exited with {rc}" if rc is not None else log.split("\n")[0])
                + (" (killed: out of memory?)" if rc in (-9, 137) else ""),
            }
        res["wall_s"] = wall
        res["env"] = {k: env.get(k) for k in ENV_KEYS}
        if res["status"] != "ok":
            res["log_tail"] = log[-3000:]
    if verbose:
        if res["status"] == "ok":
            print(
                f" {res['median_ms']:.2f} ms/step (min {res['min_ms']:.2f}, "
                f"{res['steps_timed']} steps), peak RSS {res['peak_rss_bytes'] / GB:.2f} GB, "
                f"{wall:.0f} s"
            )
        else:
            print(f" {res['status'].upper()}: {res['message']}")
    return res


def wait_quiet(max_wait: float, threshold_cores: float = 0.3, window: float = 1.0) -> float | None:
    """Waits (at most max_wait s) until other processes use < threshold cores; returns the
    last measured load in cores (None without psutil)."""
    try:
        import psutil
    except Exception:
        return None
    t0 = time.perf_counter()
    ncpu = psutil.cpu_count() or 1
    while True:
        load = psutil.cpu_percent(interval=window) / 100 * ncpu
        if load < threshold_cores or time.perf_counter() - t0 >= max_wait:
            return load


def run_suite(
    cfgs,
    engine_names,
    *,
    options=None,
    timeout=1800,
    verbose=True,
    repeat=1,
    quiet_wait=0.0,
    env_overrides=None,
) -> list[dict]:
    """Runs every engine on every config, ``repeat`` rounds (engines interleaved, so a burst
    of foreign load hits one round, not one engine); keeps per engine and config the round with
    the lowest median and records all rounds' medians."""
    best: dict[tuple, dict] = {}
    order = []
    for rnd in range(repeat):
        if repeat > 1 and verbose:
            print(f" round {rnd + 1}/{repeat}")
        for cfg in cfgs:
            for name in engine_names:
                key = (cfg.name, name)
                if key not in order:
                    order.append(key)
                prev = best.get(key)
                if prev is not None and prev["status"] != "ok":
                    continue  # skipped / failed: no point in repeating
                if quiet_wait > 0:
                    load = wait_quiet(quiet_wait)
                    if verbose and load is not None and load >= 0.3:
                        print(f"  (machine busy: other processes use {load:.1f} cores)")
                r = run_engine(
                    name,
                    cfg,
                    options=options,
                    timeout=timeout,
                    verbose=verbose,
                    env_overrides=env_overrides,
                )
                medians = (prev or {}).get("round_medians_ms", [])
                if r["status"] == "ok":
                    medians = medians + [r["median_ms"]]
                    r["round_medians_ms"] = medians
                    if prev is None or r["median_ms"] < prev["median_ms"]:
                        best[key] = r
                    else:
                        prev["round_medians_ms"] = medians
                elif prev is None:
                    best[key] = r
    return [best[k] for k in order]


# ==========================================================================================
# reporting
# ==========================================================================================


def _fmt(x, f="{:.2f}"):
    return "-" if x is None else f.format(x)


def format_table(results: list[dict]) -> str:
    """One table per workload: timings, throughput, memory, and speedups vs each baseline."""
    lines = []
    by_wl: dict[str, list[dict]] = {}
    for r in results:
        by_wl.setdefault(r["workload"]["name"], []).append(r)
    for wl_name, rs in by_wl.items():
        w = rs[0]["workload"]
        base = [
            r
            for r in rs
            if r["status"] == "ok"
            and engines_mod.ENGINES.get(r["engine"]) is not None
            and engines_mod.ENGINES[r["engine"]].kind == "baseline"
        ]
        ess = next(
            (r.get("essential_bytes_per_step") for r in rs if r.get("essential_bytes_per_step")),
            None,
        )
        uniq = next(
            (r.get("unique_rows_per_step") for r in rs if r.get("unique_rows_per_step")), None
        )
        lines.append(
            f"\n== {wl_name}: T={w['tables']} V={w['vocabulary_size']:,} D={w['dim']} "
            f"B={w['batch']} L={w['ids_per_example']}; unique rows/step "
            f"{_fmt(uniq, '{:,.0f}')}, essential {_fmt(ess and ess / 1e6, '{:.1f}')} "
            f"MB/step"
        )
        hdr = [
            "engine",
            "median ms",
            "min",
            "max",
            "steps/s",
            "ex/s",
            "ess GB/s",
            "compile s",
            "1st ms",
            "peak RSS GB",
            "state GB",
            "RSS/state",
            "others",
        ]
        hdr += [f"x vs {b['engine']}" for b in base]
        rows = []
        for r in rs:
            if r["status"] != "ok":
                rows.append([r["engine"], r["status"].upper() + ": " + r.get("message", "")])
                continue
            row = [
                r["engine"],
                _fmt(r["median_ms"]),
                _fmt(r["min_ms"]),
                _fmt(r["max_ms"]),
                _fmt(r["steps_per_s"], "{:.1f}"),
                _fmt(r["examples_per_s"], "{:,.0f}"),
                _fmt(r["essential_gb_per_s"]),
                _fmt(r.get("compile_s")),
                _fmt(r.get("first_step_ms"), "{:.1f}"),
                _fmt(r["peak_rss_bytes"] / GB),
                _fmt(r["state_bytes"] / GB, "{:.3f}"),
                _fmt(r["peak_rss_over_state"], "{:.1f}"),
                _fmt(r.get("other_processes_cores"), "{:.2f}"),
            ]
            row += [_fmt(b["median_ms"] / r["median_ms"], "{:.2f}x") for b in base]
            rows.append(row)
        widths = [
            max(len(hdr[i]), *(len(row[i]) for row in rows if len(row) > 2))
            if any(len(row) > 2 for row in rows)
            else len(hdr[i])
            for i in range(len(hdr))
        ]
        lines.append(
            "  ".join(
                h.rjust(wd) if i else h.ljust(wd) for i, (h, wd) in enumerate(zip(hdr, widths))
            )
        )
        for row in rows:
            if len(row) == 2:
                lines.append(row[0].ljust(widths[0]) + "  " + row[1])
            else:
                lines.append(
                    "  ".join(
                        c.rjust(wd) if i else c.ljust(wd)
                        for i, (c, wd) in enumerate(zip(row, widths))
                    )
                )
        if base:
            lines.append(
                "(x vs B = median ms of baseline B / median ms of the engine, same run; "
                "> 1 means faster than B)"
            )
        lines.append(
            "(others = CPU cores used by other processes during the timed steps; "
            "> ~0.2 means the numbers are disturbed)"
        )
        for r in rs:
            if r["status"] == "ok" and r.get("message"):
                lines.append(f"note {r['engine']}: {r['message']}")
    return "\n".join(lines)


def format_sweep(results: list[dict], sweep: str) -> str:
    key = {"vocab": "vocabulary_size", "dim": "dim"}[sweep]
    values = sorted({r["workload"][key] for r in results})
    names = list(dict.fromkeys(r["engine"] for r in results))
    cell = {(r["engine"], r["workload"][key]): r for r in results}
    hdr = ["engine"] + [f"{'V' if sweep == 'vocab' else 'D'}={v:,}" for v in values]
    rows = []
    for n in names:
        row = [n]
        for v in values:
            r = cell.get((n, v))
            row.append(
                "-"
                if r is None
                else (f"{r['median_ms']:.2f}" if r["status"] == "ok" else r["status"])
            )
        rows.append(row)
    widths = [max(len(hdr[i]), *(len(row[i]) for row in rows)) for i in range(len(hdr))]
    out = [f"\n== sweep {sweep}: median ms/step"]
    for row in [hdr, *rows]:
        out.append(
            "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        )
    return "\n".join(out)


def host_info() -> dict:
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        import psutil

        info["memory_total_bytes"] = psutil.virtual_memory().total
    except Exception:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def write_json(results: list[dict], path: str, meta: dict | None = None) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"host": host_info(), "meta": meta or {}, "results": results}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def plot(results: list[dict], path: str, title: str = "", sweep: str | None = None) -> str | None:
    """Bar chart of median ms/step (whiskers: min..max); grouped by sweep value for sweeps."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"(no PNG: matplotlib unavailable: {e})")
        return None
    ok = [r for r in results if r["status"] == "ok"]
    if not ok:
        return None
    names = list(dict.fromkeys(r["engine"] for r in results))
    colors = {n: plt.cm.tab10(i % 10) for i, n in enumerate(names)}
    if sweep:
        key = {"vocab": "vocabulary_size", "dim": "dim"}[sweep]
        groups = sorted({r["workload"][key] for r in results})
        glabel = [(f"V={g:.0e}" if sweep == "vocab" else f"D={g}") for g in groups]
    else:
        groups = list(dict.fromkeys(r["workload"]["name"] for r in results))
        key, glabel = "name", groups
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(groups) * max(1, len(names)) * 0.45 + 2), 4.8))
    width = 0.8 / max(1, len(names))
    for j, n in enumerate(names):
        xs, ys, lo, hi = [], [], [], []
        for gi, g in enumerate(groups):
            r = next((r for r in ok if r["engine"] == n and r["workload"][key] == g), None)
            if r is None:
                continue
            xs.append(gi + (j - (len(names) - 1) / 2) * width)
            ys.append(r["median_ms"])
            lo.append(r["median_ms"] - r["min_ms"])
            hi.append(r["max_ms"] - r["median_ms"])
        if xs:
            bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=n, color=colors[n])
            for b, y in zip(bars, ys):
                ax.annotate(
                    f"{y:.3g}",
                    (b.get_x() + b.get_width() / 2, y),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
    ax.set_xticks(range(len(groups)), glabel)
    ax.set_ylabel("ms / step (median; whiskers min..max)")
    vals = [r["median_ms"] for r in ok]
    if max(vals) / max(min(vals), 1e-9) > 30:
        ax.set_yscale("log")
    ax.set_title(title or "training step time (lower is better)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2], sys.argv[3]))
    print(__doc__)
    sys.exit(2)
