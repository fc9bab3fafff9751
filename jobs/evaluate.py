"""Evaluate an exported model or a checkpoint in a plain process (no Ray needed).

    python jobs/evaluate.py --model runs/train-20261122-101500/model.keras
    python jobs/evaluate.py --checkpoint runs/train-.../ray/train-.../checkpoint_2026-...
    python jobs/evaluate.py --model model.keras --dataset digits --val-fraction 0.2 --seed 0

The data split comes from the run's config.yaml next to the model (or the
checkpoint's own state); --dataset / --val-fraction / --seed override it.
Prints the metrics as JSON and writes them to eval.json next to the model.
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from app import cli  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="A .keras file written by jobs/train.py.")
    what.add_argument("--checkpoint", help="A checkpoint directory (model.keras + state.json).")
    what.add_argument("--run", help="A run directory: shorthand for --model <run>/model.keras.")
    parser.add_argument("--dataset", help="Dataset to evaluate on (default: the run's).")
    parser.add_argument("--val-fraction", type=float, help="Validation fraction (default: the run's).")
    parser.add_argument("--seed", type=int, help="Seed of the train/val split (default: the run's).")
    args = parser.parse_args()

    def body() -> None:
        from app import evaluate

        overrides = {k: v for k, v in {"dataset": args.dataset, "val_fraction": args.val_fraction,
                                        "seed": args.seed}.items() if v is not None}
        if args.checkpoint:
            metrics, out_file = evaluate.evaluate_checkpoint(args.checkpoint, overrides)
        else:
            model = Path(args.model) if args.model else Path(args.run) / "model.keras"
            out_file = model.parent / "eval.json"
            metrics = evaluate.evaluate_and_write(model, evaluate.config_for(model, overrides), out_file)
        print(json.dumps(metrics))
        print(f"metrics written to {out_file}")

    cli.main(body)


if __name__ == "__main__":
    main()
