"""Train a Keras model data-parallel on Ray (Ray Train + MultiWorkerMirroredStrategy), or locally.

    python jobs/train.py                         # local Ray, 2 CPU workers, embedded digits
    python jobs/train.py --model my_example.py:build_model --dataset my_example.py:load_data
    python jobs/train.py --config my.yaml --num-workers 4 --dry-run
    RAY_ADDRESS=... python jobs/train.py ...     # join an existing cluster (ray job submit sets it)
"""

import time

STARTED_AT = time.time()  # for time-to-first-step, before the heavy imports

import _bootstrap  # noqa: E402,F401
from app import cli  # noqa: E402


def main() -> None:
    args = cli.train_args(__doc__)

    def body() -> None:
        from app.run import api

        if args.dry_run:
            print("\n".join(api.dry_run(args.config)))
            return
        result = api.run_training(args.config, started_at=STARTED_AT)
        print(api.result_line(result))
        print(f"outputs written to {args.config.output_dir()}")

    cli.main(body)


if __name__ == "__main__":
    main()
