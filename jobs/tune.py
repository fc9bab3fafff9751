"""Sweep training hyperparameters with Ray Tune; every trial is a multi-worker TensorflowTrainer run.

    python jobs/tune.py --space tune_spaces/lr_scaling.yaml
    python jobs/tune.py --space tune_spaces/smoke.yaml --scheduler fifo --output runs/tune-smoke
    python jobs/tune.py --space my_space.yaml --num-workers 4 --epochs 10 --max-concurrent 2

Flags of jobs/train.py (--num-workers, --epochs, --dataset, ...) fix that value for every trial.
Re-running with the same --output resumes an interrupted sweep.
"""

import argparse
import datetime
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app import cli  # noqa: E402
from app.config import TrainConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--space", required=True, help="Search space YAML (see tune_spaces/).")
    parser.add_argument("--num-samples", type=int, default=1, help="Samples of the space (grids multiply).")
    parser.add_argument("--scheduler", choices=["asha", "fifo"], default="asha",
                        help="asha stops weak trials early (default); fifo runs every trial to the end.")
    parser.add_argument("--metric", default="val_accuracy", help="Metric the scheduler and 'best' use.")
    parser.add_argument("--mode", choices=["max", "min"], default="max")
    parser.add_argument("--max-concurrent", type=int, help="At most this many trials at once.")
    parser.add_argument("--output", help="Sweep directory (default: runs/tune-<timestamp>); re-run it to resume.")
    fixed = parser.add_argument_group("fixed for every trial (jobs/train.py flags)")
    cli.add_config_flags(fixed, exclude={"output", "overwrite", "resume", "config", "backend", "strategy", "devices",
                                         "storage_path"})
    args = parser.parse_args()

    def body() -> None:
        from app import tune

        values = {name: getattr(args, name, None) for name in TrainConfig.model_fields if name != "output"}
        fixed_values = {k: v for k, v in values.items() if v is not None}
        output = args.output or f"runs/tune-{datetime.datetime.now():%Y%m%d-%H%M%S}"
        summary = tune.sweep(args.space, fixed_values, output, num_samples=args.num_samples,
                             scheduler=args.scheduler, metric=args.metric, mode=args.mode,
                             max_concurrent=args.max_concurrent)
        print(f"best {args.metric}: {summary['best'][args.metric]:.4f} with {summary['best']['config']}")
        print(f"outputs written to {Path(output).resolve()}")

    cli.main(body)


if __name__ == "__main__":
    main()
