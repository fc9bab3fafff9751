"""The SavedModel beside model.keras (issue 28): what TensorFlow Serving loads serves what the Keras model predicts.

The SavedModel is loaded with ``tf.saved_model.load`` in a fresh process that never imports this project, as a
server would, and its ``serve`` endpoint and ``serving_default`` signature are compared with the
Keras model on 100 rows: a built-in model (the run the prediction tests share) and a user's functional model
with two named inputs. Training takes one features input, so the two-input model is exported directly with the
function the runs use (app.training.export.export_saved_model).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, clean_env, venv_env

# A fresh process: TensorFlow and the SavedModel alone, no app. Prints each model's outputs as JSON.
SERVE = """
import json, sys
import numpy as np
import tensorflow as tf
out = {}
for name, path, inputs in json.loads(sys.argv[1]):
    loaded = tf.saved_model.load(path)
    arrays = {k: np.load(v) for k, v in inputs.items()}
    served = loaded.serve(list(arrays.values()) if len(arrays) > 1 else next(iter(arrays.values())))
    signature = loaded.signatures["serving_default"]
    by_name = signature(**{k: tf.constant(v) for k, v in arrays.items()})
    out[name] = {"serve": np.asarray(served).tolist(), "signature": np.asarray(by_name["output_0"]).tolist(),
                 "inputs": {k: [s.shape.as_list(), s.dtype.name] for k, s in signature.structured_input_signature[1].items()},
                 "app_imported": "app" in sys.modules}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def two_input_model(tmp_path_factory):
    """A user's functional model with two named inputs, saved as .keras and exported as a run would export it."""
    import keras

    from app.training.export import export_saved_model

    out = tmp_path_factory.mktemp("two-inputs")
    numbers, extra = keras.Input((4,), name="numbers"), keras.Input((3,), name="extra")
    hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([numbers, extra]))
    model = keras.Model([numbers, extra], keras.layers.Dense(3, activation="softmax")(hidden))
    model.save(out / "model.keras")
    described = export_saved_model(out / "model.keras", out / "saved_model")
    return out, described


def test_saved_model_serves_what_the_keras_model_predicts(parquet_run, two_input_model, tmp_path):
    import keras

    run, _ = parquet_run
    result = json.loads((run / "result.json").read_text())
    assert result["saved_model"]["path"] == "saved_model" and result["saved_model"]["signature"] == "serving_default"
    assert result["saved_model"]["inputs"] == {"x": {"dtype": "float32", "shape": [-1, 16]}}  # any batch size
    assert result["saved_model"]["outputs"] == {"output_0": {"dtype": "float32", "shape": [-1, 4]}}
    # What the serving guide's saved_model_cli shows of it: the signature, its input and its output.
    shown = subprocess.run(["saved_model_cli", "show", "--dir", str(run / "saved_model"), "--tag_set", "serve",
                            "--signature_def", "serving_default"], env=venv_env(), capture_output=True, text=True,
                           timeout=300)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "inputs['x'] tensor_info" in shown.stdout and "shape: (-1, 16)" in shown.stdout, shown.stdout
    assert "outputs['output_0'] tensor_info" in shown.stdout and "shape: (-1, 4)" in shown.stdout, shown.stdout
    two, described = two_input_model
    assert described["inputs"] == {"extra": {"dtype": "float32", "shape": [-1, 3]},
                                   "numbers": {"dtype": "float32", "shape": [-1, 4]}}

    rng = np.random.default_rng(0)
    rows = {"builtin": {"x": rng.normal(size=(100, 16)).astype(np.float32)},
            "two_inputs": {"numbers": rng.normal(size=(100, 4)).astype(np.float32),
                           "extra": rng.normal(size=(100, 3)).astype(np.float32)}}
    jobs = []
    for name, where in (("builtin", run), ("two_inputs", two)):
        files = {}
        for key, array in rows[name].items():
            np.save(tmp_path / f"{name}-{key}.npy", array)
            files[key] = str(tmp_path / f"{name}-{key}.npy")
        jobs.append((name, str(where / "saved_model"), files))
    p = subprocess.run([sys.executable, "-c", SERVE, json.dumps(jobs)], cwd=REPO, env=clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    served = json.loads(p.stdout.strip().splitlines()[-1])

    expected = {"builtin": keras.models.load_model(run / "model.keras").predict(rows["builtin"]["x"], verbose=0),
                "two_inputs": keras.models.load_model(two / "model.keras").predict(
                    [rows["two_inputs"]["numbers"], rows["two_inputs"]["extra"]], verbose=0)}
    for name, want in expected.items():
        got = served[name]
        assert not got["app_imported"]  # the SavedModel stands alone: no code of this project
        assert got["inputs"] == {k: [[None, *v.shape[1:]], "float32"] for k, v in rows[name].items()}
        np.testing.assert_allclose(np.array(got["serve"]), want, atol=1e-5)
        np.testing.assert_allclose(np.array(got["signature"]), want, atol=1e-5)


def test_export_takes_a_comma_list_and_refuses_other_formats():
    from app.config import build_config
    from app.errors import UserError

    assert build_config(None, {}).export == ["keras", "savedmodel"]  # both by default
    assert build_config(None, {"export": "keras,savedmodel"}).export == ["keras", "savedmodel"]
    assert build_config(None, {"export": ["keras"]}).export == ["keras"]
    with pytest.raises(UserError, match="--export savedmodel alone leaves no model.keras"):
        build_config(None, {"export": ["savedmodel"]})
    with pytest.raises(UserError, match="--export takes keras and/or savedmodel"):
        build_config(None, {"export": "onnx"})
