"""Predict with a trained model on a dataset: Ray Data and a pool of actors holding the model, parquet out.

    python jobs/predict.py --run runs/train-... --dataset data/new/ --output runs/predictions --keep-columns id
    python jobs/predict.py --model runs/train-.../model.keras --dataset my_data.py:load_data --output preds/
    python jobs/predict.py --checkpoint runs/train-.../checkpoint --dataset data/new/ --output preds/ --backend local

--dataset takes what jobs/train.py takes; the run's config.yaml (or the checkpoint's own state) gives the
features (columns, text, image size), and the data flags override it. One row out per row in, in order:
prediction (the class, or the value), probabilities (classification), and the --keep-columns.
"""

import json

import _bootstrap  # noqa: F401
from app import cli


def main() -> None:
    args = cli.predict_args(__doc__)

    def body() -> None:
        from app.tools import predict, trained

        found = trained.located(args.model, args.checkpoint, args.run, args.overrides)
        summary = predict.predict(found, args.options)
        print(json.dumps({k: summary[k] for k in ("rows", "columns", "seconds")}))
        print(f"predictions written to {summary['output']}")

    cli.main(body)


if __name__ == "__main__":
    main()
