"""jobs/benchmark.py's command line: a subcommand per suite, the flags every suite takes, and each suite's own.

Here rather than in the script so that the reference (app.cli_reference) and the tests that check BENCHMARKS.md's
commands read the very parser the script runs.
"""

from __future__ import annotations

import argparse

from app.bench import suites  # light: no TensorFlow, no Ray (they are imported by the suite that runs)

# Fields of the parsed namespace that are not a suite's own parameters.
COMMON = ("suite", "quick", "preset", "config", "set", "output")


def parser(description: str = "") -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quick", action="store_true", help="The quick preset: small and short, checks it works.")
    common.add_argument("--preset", help="A preset YAML file, or a bundled preset's name (full, quick).")
    common.add_argument("--config", help="A TrainConfig YAML over the preset's workload (e.g. a run's ray-1.yaml).")
    common.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="A TrainConfig field of the workload (repeatable), e.g. --set epochs=3.")
    common.add_argument("--output", help="Directory for the results (default: under runs/).")
    top = argparse.ArgumentParser(prog="benchmark.py", description=description,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="suite", metavar="{" + ",".join(suites.SUITES) + "}", help="default: throughput")
    add = lambda name, text: sub.add_parser(name, parents=[common], help=text, description=text)  # noqa: E731
    t = add("throughput", "The Ray path vs a plain TF loop, 1..N workers, the N-process ceiling, input, start-up.")
    t.add_argument("--workers", type=int, nargs="+", help="Ray worker counts (default: 1 2, more with the CPUs).")
    add("checkpoint", "The time to write one checkpoint against one epoch, no Ray.").add_argument(
        "--repeats", type=int, help="Epochs timed, each followed by a checkpoint write.")
    m = add("memory", "Peak memory training on streamed parquet at 1x and at --scale x its size.")
    m.add_argument("--rows", type=int, help="Parquet rows at 1x.")
    m.add_argument("--scale", type=int, help="The second dataset's size, in times --rows.")
    m.add_argument("--rows-per-file", type=int, help="Rows in each parquet file written (one file in memory at a time).")
    m.add_argument("--workers", type=int, help="Ray Train workers of both runs.")
    m.add_argument("--only", choices=["write", "1x", "scaled"], help="One phase (results merge into memory.json).")
    s = add("start", "jobs/train.py and app.fit against a plain Keras script: first step and whole command, "
            "medians of interleaved rounds.")
    s.add_argument("--rounds", type=int, help="Interleaved rounds (each runs the three commands once).")
    s.add_argument("--epochs", type=int, help="Epochs of every command.")
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
    en = add("engine", "app.fit by Keras's fit on 1 and 2 Ray workers vs plain model.fit processes and local runs: "
             "three ratios.")
    en.add_argument("--runs", type=int, help="Times the whole set runs (each row's best counts).")
    en.add_argument("--model", choices=["pooled", "dense-head"], help="The CNN: few weights (pooled) or many.")
    en.add_argument("--batch-size", type=int, help="The global batch (a pair's processes each take half).")
    add("input", "The same rows as parquet (streamed, cached), TFRecord and tf.data, against arrays in memory.")
    add("predict", "Batch prediction: Ray Data's actor pool (1, 2 actors) vs model.predict; memory at 1x and --scale x.")
    el = add("elastic", "Ray Train's elastic resize, 1 -> 2 -> 1 workers as a node joins and stops (TF_CONFIG backend).")
    el.add_argument("--monitor-s", type=float, help="How often Ray looks for room to grow."), el.add_argument(
        "--start-timeout-s", type=float, help="Ray Train's bound on a worker group's start.")
    add("tensor-parallel", "The transformer's feed-forward pairs split over N devices of one process, vs one device."
        ).add_argument("--degrees", type=int, nargs="+", help="Devices to split over (1: no split, the baseline).")
    st = add("streaming", "One compiled model by Keras's fit on 2 Ray workers from arrays, parquet and TFRecord "
             "files: samples/s, and the streamed inputs' memory at 1x and --scale x the rows.")
    st.add_argument("--rows", type=int, help="Rows at 1x."), st.add_argument(
        "--scale", type=int, help="The second data set's size, in times --rows.")
    st.add_argument("--epochs", type=int, help="Epochs of every run (the first one's rate is left out).")
    st.add_argument("--runs", type=int, help="Rounds of the 1x set, each input once a round (each ratio: the rounds' median).")
    so = add("shard-optimizer", "Adam's state sharded over 2 Ray workers vs unsharded: samples/s, and each worker's "
             "state and peak memory on a model with a large state.")
    so.add_argument("--epochs", type=int, help="Epochs of every run (the first one's rate is left out).")
    return top


def parse(argv: list[str], description: str = "") -> argparse.Namespace:
    """The arguments as jobs/benchmark.py reads them: no suite named is the default suite, throughput."""
    if not argv or argv[0] not in (*suites.SUITES, "-h", "--help"):
        argv = ["throughput", *argv]
    return parser(description).parse_args(argv)


def suite_flags(args: argparse.Namespace) -> dict:
    """The suite's own parameters given as flags (None where not given: the preset's value stays)."""
    return {k: v for k, v in vars(args).items() if k not in COMMON}
