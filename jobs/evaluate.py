"""Evaluate a finished run's exported model in a plain process (no Ray needed).

    python jobs/evaluate.py --run runs/train-20261122-101500
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
    parser.add_argument("--run", required=True, help="Run directory written by jobs/train.py.")
    args = parser.parse_args()

    def body() -> None:
        from app.evaluate import evaluate_run

        metrics = evaluate_run(args.run)
        print(json.dumps(metrics))
        print(f"metrics written to {Path(args.run) / 'eval.json'}")

    cli.main(body)


if __name__ == "__main__":
    main()
