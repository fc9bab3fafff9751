"""Throughput measurements for jobs/benchmark.py, each run in a process of its own.

    python -m app.benchmark plain '<TrainConfig JSON>'   # (a) plain TF loop: no Ray, no strategy
    python -m app.benchmark input '<TrainConfig JSON>'   # Ray Data -> tf.data, no model

Each prints one JSON line. A fresh process per measurement means TensorFlow's
thread pools are set up exactly as in a Ray worker (threads are fixed at
start-up), and no measurement warms a cache for the next one.

Steady state: the first epoch (tracing, the first shuffle) is reported but
left out of the samples/s figure, for the baseline and the Ray runs alike.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from app.config import TrainConfig


def steady(per_epoch: list[float]) -> float:
    """Samples/s of the epochs after the first (all of them if there is only one)."""
    return statistics.mean(per_epoch[1:] or per_epoch)


def plain_tf(config: TrainConfig) -> dict[str, Any]:
    """The baseline: the same model, data and thread count in a minimal single-process tf.function loop."""
    from app import data, models
    from app.strategy import set_thread_counts

    threads = set_thread_counts(config.cpus_per_worker)
    import keras
    import tensorflow as tf

    source = data.load_source(config)
    model = models.build_model(config, source.feature_shape, source.num_classes)
    optimizer = keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    batch = config.per_replica_batch
    train = (
        tf.data.Dataset.from_tensor_slices((source.train.x, source.train.y))
        .shuffle(len(source.train), seed=config.seed, reshuffle_each_iteration=True)
        .batch(batch, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    per_epoch = []
    for _ in range(config.epochs):
        start, n, loss = time.perf_counter(), 0, None
        for x, y in train:
            loss = step(x, y)
            n += batch
        float(loss)  # wait for the last step
        per_epoch.append(n / (time.perf_counter() - start))
    return {"samples_per_second": steady(per_epoch), "per_epoch": per_epoch, "threads": threads}


def input_pipeline(config: TrainConfig) -> dict[str, Any]:
    """Ray Data -> one worker's shard -> tf.data, exactly the workers' input code, with no model behind it."""
    import ray

    from app import data, ray_train

    ray_train.connect(config)
    try:
        source = data.load_source(config)
        datasets = ray_train.build_datasets(config, source)
        plan = data.EpochPlan(len(source.train), config.num_workers, config.per_replica_batch)
        # What a worker's get_dataset_shard("train") is: one output of an equal streaming split.
        shard = datasets["train"].streaming_split(config.num_workers, equal=True)[0]
        batches = data.train_batches_from_shard(shard, plan, source.feature_shape, config.epochs)
        iterator = iter(batches)
        per_epoch = []
        for _ in range(config.epochs):
            start = time.perf_counter()
            for _ in range(plan.steps):
                x, _, _ = next(iterator)
            x.numpy()
            per_epoch.append(plan.steps * config.per_replica_batch / (time.perf_counter() - start))
    finally:
        ray.shutdown()
    return {"samples_per_second": steady(per_epoch), "per_epoch": per_epoch, "workers_sharing": config.num_workers}


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    kind, payload = sys.argv[1], json.loads(sys.argv[2])
    measure = {"plain": plain_tf, "input": input_pipeline}[kind]
    print(json.dumps(measure(TrainConfig(**payload))))
