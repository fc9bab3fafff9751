"""Evaluate an exported model or a checkpoint in a plain process (no Ray needed for in-memory data).

    python jobs/evaluate.py --model runs/train-20261122-101500/model.keras
    python jobs/evaluate.py --checkpoint runs/train-.../ray/train-.../checkpoint_2026-...   # a Ray Train run's
    python jobs/evaluate.py --checkpoint runs/train-.../checkpoint/epoch-3   # a local or parameter-server run's
    python jobs/evaluate.py --run runs/train-... --dataset data/val.parquet --val-fraction 0.2 --seed 0

The data split comes from the run's config.yaml next to the model (or the
checkpoint's own state); data flags (--dataset, --val-fraction, --seed, ...) override it.
Prints the metrics as JSON and writes them to eval.json next to the model.
"""

import json

import _bootstrap  # noqa: F401
from app import cli


def main() -> None:
    args = cli.evaluate_args(__doc__)

    def body() -> None:
        from app.tools import evaluate, trained

        if args.checkpoint:
            metrics, out_file = evaluate.evaluate_checkpoint(args.checkpoint, args.overrides)
        else:
            found = trained.located(args.model, None, args.run, args.overrides)
            out_file = found.model_file.parent / "eval.json"
            metrics = evaluate.evaluate_and_write(found.model_file, found.config, out_file)
        print(json.dumps(metrics))
        print(f"metrics written to {out_file}")

    cli.main(body)


if __name__ == "__main__":
    main()
