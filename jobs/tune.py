"""Sweep training hyperparameters with Ray Tune; every trial is a multi-worker Ray Train run.

    python jobs/tune.py --space tune_spaces/lr_scaling.yaml
    python jobs/tune.py --space tune_spaces/smoke.yaml --scheduler fifo --output runs/tune-smoke
    python jobs/tune.py --space my_space.yaml --num-workers 4 --epochs 10 --max-concurrent 2
    python jobs/tune.py --space my_space.yaml --global-batch 256 --dry-run   # every trial's config checked, no Ray

Flags of jobs/train.py (--num-workers, --epochs, --dataset, --model, ...) fix that value for every trial;
--storage-path puts every trial's checkpoints under <storage-path>/<sweep>/<trial>/. The few that make no
sense in a sweep are listed under "sweep options" with the reason. Re-running with the same --output resumes
an interrupted sweep.
"""

import datetime

import _bootstrap  # noqa: F401
from app import cli


def main() -> None:
    args = cli.tune_args(__doc__)

    def body() -> None:
        from app.tools import tune

        # The plan, a line per trial event, the trials by the metric and the best config: said by the sweep.
        output = args.output or f"runs/tune-{datetime.datetime.now():%Y%m%d-%H%M%S}"
        if args.dry_run:
            print("\n".join(tune.dry_run_lines(args.space, args.fixed, output, args.num_samples, args.scheduler,
                                               args.metric, args.max_concurrent)))
            return
        from app.run.trial import run_trial

        tune.sweep(args.space, args.fixed, output, num_samples=args.num_samples, scheduler=args.scheduler,
                   metric=args.metric, mode=args.mode, max_concurrent=args.max_concurrent, trial=run_trial)

    cli.main(body)


if __name__ == "__main__":
    main()
