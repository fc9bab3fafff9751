"""ray-tf-train: data-parallel Keras 3 training on Ray (and locally), from the command line or from Python.

    from app import train, tune, evaluate, predict
    result = train(model=build_model, data=load_data, num_workers=2, epochs=10)
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


__all__ = ["train", "tune", "evaluate", "predict", "ShardedEmbedding"]
