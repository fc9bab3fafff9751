"""Train a model data-parallel on Ray (TensorflowTrainer + MultiWorkerMirroredStrategy).

    python jobs/train.py                         # local Ray, 2 CPU workers, embedded digits
    python jobs/train.py --config my.yaml --num-workers 4
    RAY_ADDRESS=... python jobs/train.py ...     # join an existing cluster (ray job submit sets it)
"""

import argparse
import os
import sys
import time
from pathlib import Path

STARTED_AT = time.time()  # for time-to-first-step, before the heavy imports
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ INFO/WARNING chatter
# The checkout's own code wins over an installed copy: `ray job submit --working-dir`
# ships the code next to this script.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app import cli  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_config_flags(parser)
    args = parser.parse_args()

    def body() -> None:
        config = cli.config_from_args(args)
        if config.backend == "local":
            from app import local_train as backend  # never imports Ray
        else:
            from app import ray_train as backend

        result = backend.run(config, started_at=STARTED_AT)
        m = result["metrics"]
        print(
            f"val_accuracy {m['val_accuracy']:.4f}  val_loss {m['val_loss']:.4f}  "
            f"{result['samples_per_second']:,.0f} samples/s  {result['wall_seconds']:.1f} s wall"
        )
        print(f"outputs written to {config.output_dir()}")

    cli.main(body)


if __name__ == "__main__":
    main()
