"""ray-tf-train: data-parallel Keras 3 training on Ray (and locally), from the command line or from Python.

    from app import train, tune, evaluate, fit, predict
    result = train(model=build_model, data=load_data, num_workers=2, epochs=10)
    history = fit(build_model, x, y, batch_size=256, epochs=10, validation_split=0.2)   # model.fit's arguments
    predict(result["output"], data=x_new, output="runs/predictions")   # parquet; pandas.read_parquet reads it

``app.ShardedEmbedding`` (app.layers) is an embedding table in K shards for your own
models: spread over the parameter servers under --strategy parameter-server.

The functions are imported on first use, so that ``import app`` stays light.
"""

from typing import Any


def train(*args: Any, **kwargs: Any) -> dict:
    """app.run.api.train: train and return what result.json holds."""
    from app.run.api import train as _train

    return _train(*args, **kwargs)


def tune(*args: Any, **kwargs: Any) -> dict:
    """app.run.api.tune: sweep hyperparameters with Ray Tune."""
    from app.run.api import tune as _tune

    return _tune(*args, **kwargs)


def fit(*args: Any, **kwargs: Any) -> Any:
    """app.run.fit.fit: keras.Model.fit's arguments (x, y, global batch_size, validation_split, ...) on Ray
    workers; returns a History (``.history``, ``.result``, ``.model``)."""
    from app.run.fit import fit as _fit

    return _fit(*args, **kwargs)


def evaluate(*args: Any, **kwargs: Any) -> dict:
    """app.run.api.evaluate: score an exported model."""
    from app.run.api import evaluate as _evaluate

    return _evaluate(*args, **kwargs)


def predict(*args: Any, **kwargs: Any) -> dict:
    """app.run.api.predict: apply a trained model to a dataset, predictions written as parquet."""
    from app.run.api import predict as _predict

    return _predict(*args, **kwargs)


def __getattr__(name: str) -> Any:
    # app.ShardedEmbedding for users' own models, imported (with Keras) only when asked for.
    if name == "ShardedEmbedding":
        from app.layers import ShardedEmbedding

        return ShardedEmbedding
    raise AttributeError(f"module 'app' has no attribute {name!r}")


__all__ = ["train", "fit", "tune", "evaluate", "predict", "ShardedEmbedding"]
