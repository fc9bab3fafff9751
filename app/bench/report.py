"""The suites' tables and the scaling plot: text for the console, a PNG for BENCHMARKS.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path, report: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return path


def throughput_table(rows: list[dict]) -> str:
    lines = [f"{'run':<28}{'workers':>8}{'samples/s':>12}{'speedup':>9}{'efficiency':>12}{'vs baseline':>13}"]
    for r in rows:
        lines.append(
            f"{r['run']:<28}{r['workers']:>8}{r['samples_per_second']:>12,.0f}{r['speedup']:>9.2f}"
            f"{r['efficiency']:>12.1%}{r['vs_baseline']:>13.3f}"
        )
    return "\n".join(lines)


def throughput_summary(report: dict[str, Any]) -> str:
    pipeline, startup = report["input_pipeline"], report["startup"]
    lines = [
        throughput_table(report["table"]),
        f"input pipeline alone (rank 0 of {pipeline['workers_sharing']}): {pipeline['samples_per_second']:,.0f} "
        f"samples/s ({pipeline['vs_one_worker_consumption']:.1f}x what one worker consumes)",
    ]
    lines += [f"time to first step, {where} ({s['source']}): median {s['time_to_first_step_seconds']:.1f} s of "
              f"{', '.join(f'{x:.1f}' for x in s['runs'])}" for where, s in startup.items()]
    for goal, value in report["goals"].items():
        lines.append(f"  {goal:<58} {'n/a' if value is None else f'{value:.3g}'}")
    return "\n".join(lines)


def scaling_plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baseline = rows[0]["samples_per_second"]
    ray_rows = [r for r in rows if r["run"].startswith("ray")]
    workers = [r["workers"] for r in ray_rows]
    one = ray_rows[0]["samples_per_second"] / ray_rows[0]["workers"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(workers, [r["samples_per_second"] for r in ray_rows], marker="o", label="Ray Train, N workers x 1 CPU")
    ax.plot(workers, [one * w for w in workers], linestyle="--", color="grey", label="ideal (N x 1 worker)")
    ceilings = [r for r in rows if r["run"].startswith("plain TF x")]
    if ceilings:
        ax.plot([r["workers"] for r in ceilings], [r["samples_per_second"] for r in ceilings], marker="s",
                linestyle="none", color="tab:green", label="plain TF loops, N processes at once (ceiling)")
    ax.axhline(baseline, color="tab:red", linestyle=":", label="plain TF loop, 1 thread (baseline)")
    for r in ray_rows:
        ax.annotate(f"{r['efficiency']:.0%}", (r["workers"], r["samples_per_second"]), textcoords="offset points",
                    xytext=(6, -12))
    ax.set_xticks(workers)
    ax.set_xlabel("workers")
    ax.set_ylabel("training samples/s (steady state)")
    ax.set_title("CNN on synthetic 32x32x3 images: scaling efficiency labelled")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def checkpoint_summary(r: dict[str, Any]) -> str:
    return (
        f"model {r['model']}, {r['parameters']:,} parameters, {r['steps_per_epoch']} steps/epoch\n"
        f"median epoch {r['median_epoch_ms']:.1f} ms, median checkpoint write {r['median_checkpoint_ms']:.1f} ms "
        f"({r['checkpoint_vs_epoch']:.1%} of an epoch), over {r['repeats']} epochs"
    )


MEMORY_KEYS = ("parquet_mib", "seconds", "driver_peak_mib", "train_worker_peak_mib", "train_worker_anon_peak_mib",
               "train_worker_uss_peak_mib", "ray_data_process_peak_mib", "ray_data_process_anon_peak_mib",
               "object_store_pages_peak_mib", "train_controller_peak_mib", "ray_daemon_peak_mib")


def memory_table(small: dict[str, Any], large: dict[str, Any], scale: int) -> str:
    lines = [f"{'':32}{'1x':>10}{f'{scale}x':>10}{'ratio':>8}"]
    for key in MEMORY_KEYS:
        if key in small and key in large:  # results merged from an older version may lack a key
            ratio = large[key] / small[key] if small[key] else float("nan")
            lines.append(f"{key:32}{small[key]:>10,.1f}{large[key]:>10,.1f}{ratio:>8.3f}")
    return "\n".join(lines)
