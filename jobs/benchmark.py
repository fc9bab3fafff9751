"""Benchmarks: throughput (default), checkpoint, memory, exit, ps, sweep, keras, input, predict, elastic,
tensor-parallel, streaming, shard-optimizer.

    python jobs/benchmark.py                        # throughput: Ray path vs a plain TF loop (~13 min here)
    python jobs/benchmark.py --quick                # small and short: checks that it works (<3 min)
    python jobs/benchmark.py checkpoint --repeats 10 --set model=cnn            # checkpoint write vs epoch
    python jobs/benchmark.py memory --only 1x --set stream_buffer_mib=512       # streamed parquet, 1x vs 10x
    python jobs/benchmark.py exit --runs 3 [--checkout ../old-worktree]         # last epoch line -> exit
    python jobs/benchmark.py ps --workers 2 --num-ps 1                          # parameter servers vs MWMS
    python jobs/benchmark.py sweep --space tune_spaces/asha_vs_grid.yaml         # ASHA vs the full grid
    python jobs/benchmark.py tensor-parallel --degrees 1 2 4                    # one layer split over devices
    python jobs/benchmark.py streaming                                          # arrays vs parquet vs TFRecord
    python jobs/benchmark.py shard-optimizer                                    # ZeRO vs unsharded, 2 workers

Each suite reads its section of a preset (app/bench/presets/full.yaml; --quick: quick.yaml; --preset FILE): params
(flags override them) and a workload of TrainConfig fields (--config FILE, --set FIELD=VALUE override). Results go
to --output (default: under runs/). BENCHMARKS.md has figures.
"""

import sys

import _bootstrap  # noqa: F401
from app import cli
from app.bench import flags, suites  # light: no TensorFlow, no Ray (they are imported by the suite that runs)


def main() -> None:
    args = flags.parse(sys.argv[1:], __doc__)

    def body() -> None:
        preset = suites.load_preset(args.suite, args.preset, args.quick, flags.suite_flags(args), args.config, args.set)
        written = suites.run(preset, args.output, " ".join(["python", "jobs/benchmark.py", *sys.argv[1:]]))
        print(f"results written to {', '.join(map(str, written))}")

    cli.main(body)


if __name__ == "__main__":
    main()
