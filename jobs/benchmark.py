"""Training throughput of the Ray path against a plain TensorFlow loop, on a compute-bound model.

    python jobs/benchmark.py                 # full: CNN on synthetic 32x32x3 images (~6 min here)
    python jobs/benchmark.py --quick         # small and short: checks that the benchmark works (<3 min)
    python jobs/benchmark.py --workers 1 2 4 --rows 16384 --epochs 5

In one run, each in a fresh process, on the same model, data and thread count:

  (a) baseline: a plain single-process tf.function loop, no Ray, no strategy
  (b) the Ray path (jobs/train.py) with 1 worker x 1 CPU
  (c) the Ray path with 2 workers x 1 CPU, and more where the machine has them
  (d) for each N > 1: N plain loops at once, each on 1/N of the data, no
      communication: what N single-threaded processes reach on this machine,
      the ceiling for (c)
  plus the input pipeline alone (Ray Data -> tf.data, no model) and the time
  from starting jobs/train.py (2 local workers, its defaults) to its first step.

Prints the table, writes benchmark.json and scaling.png to --output. Figures are
ratios within this run (speedup, efficiency, overhead), because absolute
seconds on a shared machine are noise.
"""

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from app import cli  # noqa: E402
from app.benchmark import steady  # noqa: E402
from app.errors import RunFailed, UserError  # noqa: E402

log = logging.getLogger("benchmark")

FULL = {"rows": 8192, "epochs": 4, "conv_filters": [32, 64, 128]}
QUICK = {"rows": 768, "epochs": 2, "conv_filters": [8, 16]}


def workload(args) -> dict:
    size = QUICK if args.quick else FULL
    return {
        "dataset": "synthetic",
        "synthetic_rows": args.rows or size["rows"],
        "synthetic_shape": [32, 32, 3],
        "model": "cnn",
        "conv_filters": size["conv_filters"],
        "per_replica_batch": args.per_replica_batch,
        "epochs": args.epochs or size["epochs"],
        "cpus_per_worker": 1.0,
        "val_fraction": 0.05,  # evaluation is not what is measured: keep it small
        "seed": 0,
    }


def _local_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # always a local Ray of its own


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=REPO, env=_local_env(), capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RunFailed(f"{' '.join(cmd[:4])} ... failed:\n{p.stderr[-3000:]}")
    return p


def measure(kind: str, config: dict, processes: int = 1) -> dict:
    """One measurement of app.benchmark; with ``processes`` > 1, that many at once, samples/s summed.

    Plain TF loops in N processes at once, each with its 1/N of the data and no
    communication, are what N single-threaded workers could reach on this
    machine at best: the ceiling for the N-worker Ray run, measured the same way.
    """
    if processes > 1:
        config = {**config, "synthetic_rows": config["synthetic_rows"] // processes}
    cmd = [sys.executable, "-m", "app.benchmark", kind, json.dumps(config)]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=_local_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(processes)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=1200)
            if p.returncode != 0:
                raise RunFailed(f"app.benchmark {kind} failed:\n{err[-3000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:  # one failed or timed out: stop the others we started
            if p.poll() is None:
                p.kill()
                p.wait()
    if processes == 1:
        return results[0]
    return {"samples_per_second": sum(r["samples_per_second"] for r in results), "processes": results}


def train_run(config: dict, workers: int, out: Path) -> dict:
    """jobs/train.py as a user runs it; steady-state samples/s from its history.csv."""
    import csv

    import yaml

    # The workload as a --config file: jobs/train.py reads it exactly as a user's YAML.
    config_file = out.parent / f"{out.name}.yaml"
    config_file.write_text(yaml.safe_dump(config))
    run([sys.executable, "jobs/train.py", "--config", str(config_file), "--num-workers", str(workers),
         "--output", str(out), "--overwrite"], timeout=1800)
    result = json.loads((out / "result.json").read_text())
    with open(out / "history.csv") as f:
        per_epoch = [float(row["samples_per_second"]) for row in csv.DictReader(f)]
    return {
        "samples_per_second": steady(per_epoch),
        "per_epoch": per_epoch,
        "time_to_first_step_seconds": result["time_to_first_step_seconds"],
        "wall_seconds": result["wall_seconds"],
    }


def table(rows: list[dict]) -> str:
    lines = [f"{'run':<22}{'workers':>8}{'samples/s':>12}{'speedup':>9}{'efficiency':>12}{'vs baseline':>13}"]
    for r in rows:
        lines.append(
            f"{r['run']:<22}{r['workers']:>8}{r['samples_per_second']:>12,.0f}{r['speedup']:>9.2f}"
            f"{r['efficiency']:>12.1%}{r['vs_baseline']:>13.3f}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], baseline: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ray_rows = [r for r in rows if r["run"].startswith("ray")]
    workers = [r["workers"] for r in ray_rows]
    one = next(r["samples_per_second"] for r in ray_rows if r["workers"] == 1)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Small model and data, 2 epochs: checks it works.")
    parser.add_argument("--workers", type=int, nargs="+", default=None,
                        help="Worker counts for the Ray path (default: 1 and 2, more if the machine has the CPUs).")
    parser.add_argument("--rows", type=int, default=None, help="Synthetic training images (default 8192; quick 1024).")
    parser.add_argument("--epochs", type=int, default=None, help="Epochs per run (default 4; quick 2).")
    parser.add_argument("--per-replica-batch", type=int, default=64)
    parser.add_argument("--output", default=None, help="Directory for benchmark.json and scaling.png.")
    args = parser.parse_args()

    def body() -> None:
        cpus = os.cpu_count() or 1
        workers = args.workers or sorted({1, 2, *([4] if cpus >= 4 else []), *([cpus] if cpus >= 8 else [])})
        if max(workers) > cpus:
            raise UserError(f"--workers {max(workers)} needs {max(workers)} CPUs, this machine has {cpus}")
        out = Path(args.output or f"runs/benchmark-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
        out.mkdir(parents=True, exist_ok=True)
        config = workload(args)
        log.info("workload: %s", json.dumps(config))

        log.info("(a) plain TensorFlow loop, 1 thread ...")
        baseline = measure("plain", config)
        log.info("    %.0f samples/s", baseline["samples_per_second"])
        ceilings = {}
        for w in (w for w in workers if w > 1):
            log.info("plain TensorFlow loops in %d processes at once, no communication (the %d-worker ceiling) ...",
                     w, w)
            ceilings[w] = measure("plain", config, processes=w)
            log.info("    %.0f samples/s", ceilings[w]["samples_per_second"])
        log.info("input pipeline alone (Ray Data -> tf.data, one worker's shard) ...")
        pipeline = measure("input", {**config, "num_workers": 1})
        log.info("    %.0f samples/s", pipeline["samples_per_second"])
        runs = {}
        for w in workers:
            log.info("Ray path, %d worker(s) x 1 CPU ...", w)
            runs[w] = train_run(config, w, out / f"ray-{w}")
            log.info("    %.0f samples/s", runs[w]["samples_per_second"])
        if args.quick:
            startup = {"time_to_first_step_seconds": runs[max(workers)]["time_to_first_step_seconds"],
                       "source": f"the {max(workers)}-worker run above"}
        else:
            log.info("start-up: python jobs/train.py --epochs 1 (2 workers, digits) ...")
            started = train_run({"epochs": 1}, 2, out / "startup")
            startup = {"time_to_first_step_seconds": started["time_to_first_step_seconds"],
                       "source": "python jobs/train.py --epochs 1"}

        one = runs[min(workers)]["samples_per_second"] / min(workers)
        rows = [{"run": "plain TF (baseline)", "workers": 1, "samples_per_second": baseline["samples_per_second"],
                 "speedup": baseline["samples_per_second"] / one, "efficiency": 1.0, "vs_baseline": 1.0}]
        for w in workers:
            sps = runs[w]["samples_per_second"]
            rows.append({"run": f"ray {w} worker(s)", "workers": w, "samples_per_second": sps,
                         "speedup": sps / one, "efficiency": sps / (one * w),
                         "vs_baseline": sps / baseline["samples_per_second"]})
        for w, ceiling in ceilings.items():
            sps = ceiling["samples_per_second"]
            rows.append({"run": f"plain TF x{w} processes", "workers": w, "samples_per_second": sps,
                         "speedup": sps / one, "efficiency": sps / (one * w),
                         "vs_baseline": sps / baseline["samples_per_second"]})
        one_worker_consumes = runs[min(workers)]["samples_per_second"] / min(workers)
        report = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": {"cpus": cpus, "platform": sys.platform},
            "command": " ".join(["python", "jobs/benchmark.py", *sys.argv[1:]]),
            "workload": config,
            "table": rows,
            "baseline": baseline,
            "ray_runs": {str(w): r for w, r in runs.items()},
            "plain_processes_at_once": {str(w): c for w, c in ceilings.items()},
            "input_pipeline": {**pipeline, "vs_one_worker_consumption": pipeline["samples_per_second"]
                               / one_worker_consumes},
            "startup": startup,
            "goals": {
                "one_worker_vs_baseline >= 0.97": runs[1]["samples_per_second"] / baseline["samples_per_second"]
                if 1 in runs else None,
                "two_workers_vs_one >= 1.8": runs[2]["samples_per_second"] / runs[1]["samples_per_second"]
                if {1, 2} <= runs.keys() else None,
                **{f"{w}_workers_vs_{w}_plain_processes": runs[w]["samples_per_second"] / c["samples_per_second"]
                   for w, c in ceilings.items()},
                "input_vs_consumption >= 5": pipeline["samples_per_second"] / one_worker_consumes,
                "first_step_seconds <= 15": startup["time_to_first_step_seconds"],
            },
        }
        (out / "benchmark.json").write_text(json.dumps(report, indent=2))
        plot(rows, baseline["samples_per_second"], out / "scaling.png")
        print(table(rows))
        print(f"input pipeline alone: {pipeline['samples_per_second']:,.0f} samples/s "
              f"({report['input_pipeline']['vs_one_worker_consumption']:.1f}x what one worker consumes)")
        print(f"time to first step ({startup['source']}): {startup['time_to_first_step_seconds']:.1f} s")
        for goal, value in report["goals"].items():
            print(f"  {goal:<36} {'n/a' if value is None else f'{value:.3g}'}")
        print(f"wrote {out / 'benchmark.json'} and {out / 'scaling.png'}")

    cli.main(body)


if __name__ == "__main__":
    main()
