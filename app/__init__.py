"""ray-tf-train: data-parallel Keras 3 training on Ray (and locally), from the command line or from Python.

    from app import train, tune, evaluate, fit, predict
    result = train(model=build_model, data=load_data, num_workers=2, epochs=10)
    history = fit(build_model, x, y, batch_size=256, epochs=10, validation_split=0.2)   # model.fit's arguments
    predict(result["output"], data=x_new, output="runs/predictions")   # parquet; pandas.read_parquet reads it
    x, y = digits()   # the 1,797 8x8 digits this package ships (scikit-learn's load_digits, scaled to [0, 1])

``app.ShardedEmbedding`` (app.layers) is an embedding table in K shards for your own
models: spread over the parameter servers under --strategy parameter-server.

The functions are the ones in app.run.api and app.run.fit, with their own signatures and docstrings
(``help(app.fit)``); importing them imports neither TensorFlow nor Ray (they load when a run starts).
"""

from typing import Any

from app.data.builtin import digits
from app.run.api import evaluate, predict, train, tune
from app.run.fit import fit


def __getattr__(name: str) -> Any:
    # app.ShardedEmbedding for users' own models, imported (with Keras) only when asked for.
    if name == "ShardedEmbedding":
        from app.layers import ShardedEmbedding

        return ShardedEmbedding
    raise AttributeError(f"module 'app' has no attribute {name!r}")


__all__ = ["train", "fit", "tune", "evaluate", "predict", "digits", "ShardedEmbedding"]
