"""The SavedModel for serving: a trained model's forward pass, as TensorFlow Serving and ``tf.saved_model.load``
take it.

Written with Keras 3's own exporter (``model.export(path, format="tf_saved_model")``): one ``serve`` endpoint (the
model's call in inference mode) and the ``serving_default`` signature. Its inputs keep the model's input names
(``x`` for the built-in models; a functional model's own ``keras.Input(name=...)``s, each one a named input) with
a batch dimension of any size, and its outputs are what the model returns. No code of this project is needed to
load it.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SAVED_MODEL_DIR = "saved_model"
SIGNATURE = "serving_default"
ENDPOINT = "serve"
_AUTO_NAME = re.compile(r"^keras_tensor(_\d+)?$")


def export_saved_model(model: Any, directory: str | Path) -> dict[str, Any]:
    """Write ``model`` (a Keras model, or the path of a .keras file) as a SavedModel in ``directory`` (replaced if
    it exists); returns what its serving signature takes and returns (for result.json)."""
    import keras

    if not isinstance(model, keras.Model):
        from app.training import model_file

        model = model_file.load(model, compile=False)
    directory = Path(directory)
    if directory.exists():
        shutil.rmtree(directory)
    model.export(str(directory), format="tf_saved_model", verbose=False, input_signature=_signature(model))
    described = describe(directory)
    log.info("SavedModel for serving: %s (signature %s: %s)", directory, SIGNATURE,
             ", ".join(f"{k} {v['shape']}" for k, v in described["inputs"].items()))
    return described


def _signature(model: Any) -> Any:
    """None (Keras derives it: each input under its own name), or one input named ``x`` where the model gives no
    name of its own: a model built with an unnamed ``keras.Input`` (Keras calls it ``keras_tensor_<n>``, a
    different n in every process) and a subclassed model."""
    import keras

    inputs = getattr(model, "inputs", None)
    if not inputs:
        # A subclassed model read back from a .keras file is built but was never called, and Keras derives the
        # signature of such a model from its first call: the shape it was built with stands in.
        shape, dtype = model.get_build_config()["input_shape"][1:], "float32"
    elif len(inputs) == 1 and _AUTO_NAME.match(inputs[0].name):
        shape, dtype = inputs[0].shape[1:], inputs[0].dtype
    else:
        return None
    return [keras.InputSpec(shape=(None, *shape), dtype=dtype, name="x")]


def describe(directory: str | Path) -> dict[str, Any]:
    """The serving signature's inputs and outputs (name -> dtype, shape; -1 = any size), read from the
    saved_model.pb as ``saved_model_cli show`` reads it: nothing is loaded or run."""
    import tensorflow as tf
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((Path(directory) / "saved_model.pb").read_bytes())
    graph = next(g for g in proto.meta_graphs if "serve" in g.meta_info_def.tags)
    signature = graph.signature_def[SIGNATURE]

    def tensors(infos) -> dict[str, Any]:
        return {name: {"dtype": tf.dtypes.as_dtype(info.dtype).name,
                       "shape": [d.size for d in info.tensor_shape.dim]} for name, info in sorted(infos.items())}

    return {"path": SAVED_MODEL_DIR, "tag": "serve", "signature": SIGNATURE, "endpoint": ENDPOINT,
            "inputs": tensors(signature.inputs), "outputs": tensors(signature.outputs)}
