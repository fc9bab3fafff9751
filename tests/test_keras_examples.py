"""The two Keras scripts of examples/ that keras.io could have written, with only the fit line changed: each runs as a
user runs it (`python examples/<file>.py`, joined to the session's Ray, from a directory of its own), both at once.

vae_own_train_step.py is also the script test of a model class defined in the script's __main__: it trains on 2
workers, its History comes back, and the lines after fit use ``history.model`` (its encoder and decoder predict).
"""

from __future__ import annotations

import concurrent.futures
import json

from conftest import REPO, run_job

EXAMPLES = REPO / "examples"
KERAS_EXAMPLES = ["vae_own_train_step.py", "tf_data_pipeline.py"]


def test_the_keras_examples_train_by_their_own_step_and_return_their_model(joined, tmp_path):
    # Each in a directory of its own: two runs started in the same second would choose the same default output.
    dirs = [tmp_path / name.removesuffix(".py") for name in KERAS_EXAMPLES]
    for d in dirs:
        d.mkdir()
    with concurrent.futures.ThreadPoolExecutor(len(dirs)) as pool:  # side by side: their start-ups overlap
        first = list(pool.map(lambda name, d: run_job(str(EXAMPLES / name), timeout=900, env=joined, cwd=d),
                              KERAS_EXAMPLES, dirs))
    for p in first:
        assert p.returncode == 0, p.stderr[-3000:]
    vae, pipeline = (json.loads(p.stdout.strip().splitlines()[-1]) for p in first)

    # The VAE's own trackers are the History (no val_: no validation argument); its loss falls; the decoder of the
    # returned model reconstructs the digits better than a constant would (mean absolute error of pixels in [0, 1]).
    assert len(vae["loss"]) == 15 and vae["loss"][-1] < vae["loss"][0] * 0.8, vae
    assert vae["reconstruction_error"] < 0.25, vae
    assert "model.keras not written" in first[0].stderr + first[0].stdout  # its class lives in the script

    # The tf.data pipeline: Keras's keys, validated on the tf.data validation set every epoch, and it learns.
    assert pipeline["keys"] == ["accuracy", "loss", "val_accuracy", "val_loss"], pipeline
    assert len(pipeline["val_accuracy"]) == 30 and pipeline["val_accuracy"][-1] >= 0.75, pipeline
