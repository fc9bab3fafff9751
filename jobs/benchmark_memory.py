"""Peak memory with a streamed parquet dataset at 1x and at 10x its size.

    python jobs/benchmark_memory.py [--rows 12000] [--scale 10] [--dir runs/benchmark-memory]
    python jobs/benchmark_memory.py --only write|1x|scaled   # one phase at a time (a shared machine)

Writes a synthetic parquet dataset (``--rows`` rows of 32x32x3 float32 as a
flat list column, ~12 KB a row: ~150 MB at 1x) and the same at ``--scale``
times the rows, then trains one epoch of a small mlp on each with 2 Ray
workers, ``--data-cache stream`` (read and preprocess block by block, never
the whole set in one place). Each run is a fresh process with its own local
Ray, so every peak below belongs to that run only:

- driver: this run's process (``ru_maxrss``);
- train worker: the largest ``ru_maxrss`` of the Ray Train workers (they report it);
- other Ray processes: the largest peak (``VmHWM``, sampled from /proc every
  0.5 s) of Ray Data's read/preprocess tasks, the split coordinator, the
  Train controller and Ray's own daemons;
- "own" figures: the largest ``RssAnon`` seen, a process's private memory.
  RSS also counts the pages of Ray's shared-memory object store that a
  process wrote or read, and those pages belong to the store;
- the object store's pages: the machine's ``Shmem`` (/dev/shm) above its
  level at the start. Every page is counted once, however many processes
  map it.

The data is written in files of ``--rows-per-file`` rows, so writing it never
holds more than one file in memory either.

Measured on the 2-core development machine (2026-11-22, 2 workers, defaults:
16 MiB blocks, --stream-buffer-mib 256):

    python jobs/benchmark_memory.py --rows 24000      # 1x = 290 MB, 10x = 2.9 GB, two runs
                                     1x (MiB)      10x (MiB)     ratio
    driver                          277 / 277      281 / 280     1.014 / 1.010
    train worker, own (RssAnon)     450 / 454      473 / 464     1.051 / 1.021
    Ray Data task, own (RssAnon)  1,033 / 826    1,026 / 942     0.993 / 1.141
    object store's pages            411 / 411      491 / 534     1.195 / 1.301
    train worker, RSS               988 / 996    1,331 / 1,372   1.347 / 1.377

    python jobs/benchmark_memory.py                   # 1x = 145 MB, 10x = 1.45 GB
    driver                          274 MiB      279 MiB   1.017
    train worker, own (RssAnon)     448 MiB      460 MiB   1.028
    Ray Data task, own (RssAnon)    863 MiB      962 MiB   1.115
    object store's pages            216 MiB      455 MiB   2.104
    train worker, RSS               931 MiB    1,207 MiB   1.297

What bounds it (app/sources.py, ``_streaming``): streamed datasets read
16 MiB blocks instead of Ray Data's 128 MiB, and may hold at most
``--stream-buffer-mib`` of the object store each. Before, Ray Data's default
budget was half the store: reads ran far ahead of training and filled it.
Before, from 145 MB: a worker's own memory went 439 -> 520 MiB (1.185), a
Ray Data task's 882 -> 1,090 MiB (1.235), a worker's RSS 925 -> 1,573 MiB.

The driver's and a train worker's own memory stay within 5% in every run.
A Ray Data task's own memory lies between 800 and 1,040 MiB at either size
(the parquet reader reads 128 MiB of row groups per task): its ratio is the
luck of the 1x run, 0.99 to 1.14. The object store's pages grow until the
budgets are full: from 145 MB (less than the 2 x 256 MiB budget for train
and val) they double, from 290 MB they grow 20-30%. A worker's RSS maps
those shared pages as it reads blocks from all over the store, hence 1.3x.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = (32, 32, 3)


def write_dataset(directory: Path, rows: int, rows_per_file: int, seed: int) -> int:
    """Learnable rows (a class pattern under noise), file by file; returns the bytes written."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    width = int(np.prod(SHAPE))
    patterns = np.random.default_rng(seed).normal(size=(10, width)).astype(np.float32)
    for i, start in enumerate(range(0, rows, rows_per_file)):
        n = min(rows_per_file, rows - start)
        rng = np.random.default_rng([seed, i])
        y = rng.integers(0, 10, n)
        x = rng.normal(size=(n, width)).astype(np.float32) + 0.5 * patterns[y]
        pixels = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), width)
        pq.write_table(pa.table({"pixels": pixels, "label": y}), directory / f"part-{i:05d}.parquet")
    return sum(f.stat().st_size for f in directory.glob("*.parquet"))


class ProcessPeaks:
    """Peak RSS (VmHWM) of every descendant process, sampled from /proc."""

    def __init__(self, interval: float = 0.5):
        self.interval = interval
        self.peaks: dict[int, tuple[str, float]] = {}  # pid -> (name, VmHWM: peak of all resident pages)
        # pid -> (name, largest RssAnon seen): the process's own memory, without the pages of Ray's
        # shared-memory object store that it mapped to read objects (VmHWM counts those too).
        self.anon: dict[int, tuple[str, float]] = {}
        # The machine's shared memory in use (/dev/shm, where Ray's object store lives), above what it was at
        # the start: the store's pages that blocks have touched, counted once however many processes map them.
        self.shmem_peak = 0.0
        self._shmem_start = self._shmem()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _shmem() -> float:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Shmem:")) / 1024

    def _run(self):
        me = os.getpid()
        while not self._stop.is_set():
            self.shmem_peak = max(self.shmem_peak, self._shmem() - self._shmem_start)
            parents = {}
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    try:
                        with open(f"/proc/{entry}/stat") as f:
                            parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
                    except OSError:
                        pass
            for pid in parents:
                p, seen = pid, 0
                while p in parents and p != me and seen < 50:
                    p, seen = parents[p], seen + 1
                if p != me or pid == me:
                    continue
                try:
                    with open(f"/proc/{pid}/status") as f:
                        status = dict(line.split(":", 1) for line in f if ":" in line)
                    with open(f"/proc/{pid}/cmdline") as f:
                        name = f.read().split("\0")[0]
                except OSError:
                    continue
                hwm = int(status.get("VmHWM", "0 kB").split()[0]) / 1024
                anon = int(status.get("RssAnon", "0 kB").split()[0]) / 1024
                if hwm > self.peaks.get(pid, ("", 0))[1]:
                    self.peaks[pid] = (name, hwm)
                if anon > self.anon.get(pid, ("", 0))[1]:
                    self.anon[pid] = (name, anon)
            self._stop.wait(self.interval)


def run_once(data_dir: str, out: str, workers: int, overrides: dict) -> dict:
    """One training run in this process (called in a fresh subprocess per dataset size)."""
    import csv

    import ray

    from app import ray_train, report
    from app.config import build_config

    config = build_config(None, {
        "dataset": data_dir, "output": out, "overwrite": True, "num_workers": workers, "epochs": 1,
        "model": "mlp", "hidden_units": [64], "per_replica_batch": 256, "data_cache": "stream",
        "warmup_epochs": 0, "base_lr": 0.01, **overrides,
    })
    started = time.time()
    with ProcessPeaks() as peaks:
        ray_train.connect(config)  # the local Ray that jobs/train.py would start, shut down below
        try:
            result = ray_train.run(config)
        finally:
            ray.shutdown()
    with open(Path(out) / "history.csv") as f:
        last = list(csv.DictReader(f))[-1]
    def largest(match, table=peaks.peaks) -> float:
        return round(max((mib for name, mib in table.values() if match(name)), default=0.0), 1)

    is_task = lambda name: name.startswith("ray::") and not name.startswith(("ray::RayTrainWorker", "ray::TrainController"))
    return {
        "rows_trained": int(last["train_samples"]),
        "val_rows": int(last["val_samples"]),
        "seconds": round(time.time() - started, 1),
        "driver_peak_mib": round(report.peak_rss_mib(), 1),
        "train_worker_peak_mib": round(float(last["worker_peak_rss_mib"]), 1),
        "train_worker_anon_peak_mib": largest(lambda name: name.startswith("ray::RayTrainWorker"), peaks.anon),
        # Ray Data's read/preprocess tasks and the split coordinator run in these worker processes.
        "ray_data_process_peak_mib": largest(is_task),
        "ray_data_process_anon_peak_mib": largest(is_task, peaks.anon),
        "object_store_pages_peak_mib": round(peaks.shmem_peak, 1),
        "train_controller_peak_mib": largest(lambda name: name.startswith("ray::TrainController")),
        "ray_daemon_peak_mib": largest(lambda name: not name.startswith("ray::")),
        "val_accuracy": result["metrics"]["val_accuracy"],
        # The four largest processes by own memory, for a look at where it went.
        "largest_processes": [
            [name[:60], round(mib, 1), round(peaks.peaks.get(pid, ("", 0))[1], 1)]
            for pid, (name, mib) in sorted(peaks.anon.items(), key=lambda item: -item[1][1])[:4]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=12_000, help="rows at 1x (12 KB each)")
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--rows-per-file", type=int, default=1_500)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dir", default="runs/benchmark-memory")
    parser.add_argument("--stream-buffer-mib", type=int, help="the training option (default: its default)")
    parser.add_argument("--only", choices=["write", "1x", "scaled"], help="one phase (results merge into memory.json)")
    parser.add_argument("--run-one", nargs=2, metavar=("DATA", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    overrides = {} if args.stream_buffer_mib is None else {"stream_buffer_mib": args.stream_buffer_mib}
    if args.run_one:  # the child: one run, one JSON line
        print("RESULT " + json.dumps(run_once(*args.run_one, args.workers, overrides)), flush=True)
        return

    root = Path(args.dir).resolve()
    rows = {"1x": args.rows, f"{args.scale}x": args.rows * args.scale}
    summary = root / "memory.json"
    results = json.loads(summary.read_text()) if args.only and summary.exists() else {}
    for label, n in rows.items():
        data_dir = root / f"data-{n}"
        if not (data_dir / "_complete").exists():
            size = write_dataset(data_dir, n, args.rows_per_file, seed=0)
            (data_dir / "_complete").write_text(str(size))
        size = int((data_dir / "_complete").read_text())
        if args.only == "write" or (args.only == "1x" and label != "1x") or (args.only == "scaled" and label == "1x"):
            continue
        p = subprocess.run(
            [sys.executable, __file__, "--workers", str(args.workers), "--run-one", str(data_dir), str(root / f"run-{label}"),
             *([] if args.stream_buffer_mib is None else ["--stream-buffer-mib", str(args.stream_buffer_mib)])],
            capture_output=True, text=True,
        )
        line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
        if p.returncode or line is None:
            sys.exit(f"{label} run failed:\n{p.stderr[-3000:]}")
        results[label] = {"rows": n, "parquet_mib": round(size / 2**20, 1), **json.loads(line[len("RESULT "):])}
        print(f"{label}: {json.dumps(results[label])}", flush=True)
        root.mkdir(parents=True, exist_ok=True)
        summary.write_text(json.dumps(results, indent=2))
    if "1x" not in results or f"{args.scale}x" not in results:
        return
    small, large = results["1x"], results[f"{args.scale}x"]
    print(f"\n{'':28}{'1x':>10}{f'{args.scale}x':>10}{'ratio':>8}")
    for key in ("parquet_mib", "seconds", "driver_peak_mib", "train_worker_peak_mib", "train_worker_anon_peak_mib",
                "ray_data_process_peak_mib", "ray_data_process_anon_peak_mib", "object_store_pages_peak_mib",
                "train_controller_peak_mib", "ray_daemon_peak_mib"):
        if key in small and key in large:  # results merged from an older version may lack a key
            print(f"{key:28}{small[key]:>10,.1f}{large[key]:>10,.1f}{large[key] / small[key]:>8.3f}")
    print(f"\nwritten to {summary}")


if __name__ == "__main__":
    main()
