"""Benchmarks: throughput (default), breakdown, checkpoint, memory, exit, ps, sweep, keras, input, predict, elastic.

    python jobs/benchmark.py                        # throughput: Ray path vs a plain TF loop (~13 min here)
    python jobs/benchmark.py --quick                # small and short: checks that it works (<3 min)
    python jobs/benchmark.py breakdown --config runs/benchmark-.../ray-1.yaml   # strategy x input, 1 process
    python jobs/benchmark.py checkpoint --repeats 10 --set model=cnn            # checkpoint write vs epoch
    python jobs/benchmark.py memory --only 1x --set stream_buffer_mib=512       # streamed parquet, 1x vs 10x
    python jobs/benchmark.py exit --runs 3 [--checkout ../old-worktree]         # last epoch line -> exit
    python jobs/benchmark.py ps --workers 2 --num-ps 1                          # parameter servers vs MWMS
    python jobs/benchmark.py sweep --space tune_spaces/asha_vs_grid.yaml         # ASHA vs the full grid

Each suite reads its section of a preset (app/bench/presets/full.yaml; --quick: quick.yaml; --preset FILE): params
(flags override them) and a workload of TrainConfig fields (--config FILE, --set FIELD=VALUE override). Results go
to --output (default: under runs/). BENCHMARKS.md has figures.
"""

import argparse
import sys

import _bootstrap  # noqa: F401
from app import cli
from app.bench import suites  # light: no TensorFlow, no Ray (they are imported by the suite that runs)


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quick", action="store_true", help="The quick preset: small and short, checks it works.")
    common.add_argument("--preset", help="A preset YAML file, or a bundled preset's name (full, quick).")
    common.add_argument("--config", help="A TrainConfig YAML over the preset's workload (e.g. a run's ray-1.yaml).")
    common.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="A TrainConfig field of the workload (repeatable), e.g. --set epochs=3.")
    common.add_argument("--output", help="Directory for the results (default: under runs/).")
    top = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="suite", metavar="{" + ",".join(suites.SUITES) + "}", help="default: throughput")
    add = lambda name, text: sub.add_parser(name, parents=[common], help=text, description=text)  # noqa: E731
    t = add("throughput", "The Ray path vs a plain TF loop, 1..N workers, the N-process ceiling, input, start-up.")
    t.add_argument("--workers", type=int, nargs="+", help="Ray worker counts (default: 1 2, more with the CPUs).")
    add("breakdown", "Strategy (none, MWMS) x input (arrays, Ray Data) in one process, no Ray Train.")
    add("checkpoint", "The time to write one checkpoint against one epoch, no Ray.").add_argument(
        "--repeats", type=int, help="Epochs timed, each followed by a checkpoint write.")
    m = add("memory", "Peak memory training on streamed parquet at 1x and at --scale x its size.")
    m.add_argument("--rows", type=int, help="Parquet rows at 1x.")
    m.add_argument("--scale", type=int, help="The second dataset's size, in times --rows.")
    m.add_argument("--rows-per-file", type=int), m.add_argument("--workers", type=int)
    m.add_argument("--only", choices=["write", "1x", "scaled"], help="One phase (results merge into memory.json).")
    e = add("exit", "The time from a run's last epoch line to its exit, in-memory and streamed.")
    e.add_argument("--runs", type=int, help="Runs per data path."), e.add_argument(
        "--checkout", help="Run another checkout's jobs/train.py (a worktree of an older commit).")
    p = add("ps", "Parameter-server training against MWMS: same model, same CPUs reserved.")
    p.add_argument("--workers", type=int, help="Workers in both runs."), p.add_argument(
        "--num-ps", type=int, help="Parameter servers beside them.")
    p.add_argument("--cpus", type=float, help="CPUs both runs reserve in all.")
    add("sweep", "ASHA against the full grid (fifo) on one search space: worker-seconds, best accuracy.").add_argument(
        "--space", help="The search space YAML (jobs/tune.py --space).")
    add("keras", "A compiled model (two metrics): this product's loop, local and on 1 Ray worker, vs model.fit.")
    add("input", "The same rows as parquet (streamed, cached), TFRecord and tf.data, against arrays in memory.")
    add("predict", "Batch prediction: Ray Data's actor pool (1, 2 actors) vs model.predict; memory at 1x and --scale x.")
    el = add("elastic", "Ray Train's elastic resize, 1 -> 2 -> 1 workers as a node joins and stops (TF_CONFIG backend).")
    el.add_argument("--monitor-s", type=float, help="How often Ray looks for room to grow."), el.add_argument(
        "--start-timeout-s", type=float, help="Ray Train's bound on a worker group's start.")
    return top


def main() -> None:
    argv = sys.argv[1:]
    if not argv or argv[0] not in (*suites.SUITES, "-h", "--help"):
        argv = ["throughput", *argv]  # the default suite
    args = parser().parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in {"suite", "quick", "preset", "config", "set", "output"}}

    def body() -> None:
        preset = suites.load_preset(args.suite, args.preset, args.quick, flags, args.config, args.set)
        written = suites.run(preset, args.output, " ".join(["python", "jobs/benchmark.py", *sys.argv[1:]]))
        print(f"results written to {', '.join(map(str, written))}")

    cli.main(body)


if __name__ == "__main__":
    main()
