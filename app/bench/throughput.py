"""Throughput measurements for the throughput suite (app.bench.scaling), each run in a process of its own.

    python -m app.bench.throughput plain '<TrainConfig JSON>'   # the baseline: plain TF loop, no Ray, no strategy
    python -m app.bench.throughput input '<TrainConfig JSON + "input_workers">'   # a worker's input, no model

Each prints one ``RESULT <json>`` line (app.bench.proc). Steady state: the
first epoch (tracing, the first shuffle) is reported but left out of the
samples/s figure, for the baseline and the Ray runs alike.
"""

from __future__ import annotations

import time
from typing import Any

from app.bench.proc import child_main, steady
from app.config import TrainConfig


def plain_tf(payload: dict[str, Any]) -> dict[str, Any]:
    """The baseline: the same model, data and thread count in a minimal single-process tf.function loop.

    With ``together`` ({"processes": N, "barrier": DIR, "window_s": T}), one of N
    such processes started at once: after its first epoch it waits for the others
    at a file barrier, then all train for the same T seconds. Their rates add up to
    what N processes reach together; per-epoch rates would count the time one ran
    alone after the other had finished (they do not finish together).
    """
    from app.data.memory import load_source
    from app.training.model import build_model
    from app.training.strategy import set_thread_counts

    payload = dict(payload)
    together = payload.pop("together", None)
    config = TrainConfig(**payload)
    threads = set_thread_counts(config.cpus_per_worker)
    import keras
    import tensorflow as tf

    source = load_source(config)
    model = build_model(config, source.facts)
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
    for _ in range(1 if together else config.epochs):
        start, n, loss = time.perf_counter(), 0, None
        for x, y in train:
            loss = step(x, y)
            n += batch
        float(loss)  # wait for the last step
        per_epoch.append(n / (time.perf_counter() - start))
    if together:
        return {"samples_per_second": _window(step, train.repeat(), batch, **together), "first_epoch": per_epoch[0],
                "threads": threads}
    return {"samples_per_second": steady(per_epoch), "per_epoch": per_epoch, "threads": threads}


def _window(step, batches, batch: int, processes: int, barrier: str, window_s: float) -> float:
    """Samples/s over ``window_s`` seconds, started when all ``processes`` have reached the barrier."""
    import os
    from pathlib import Path

    Path(barrier, str(os.getpid())).touch()
    deadline = time.time() + 600
    while len(os.listdir(barrier)) < processes:
        if time.time() > deadline:
            raise TimeoutError(f"the other processes did not reach {barrier} in 600 s")
        time.sleep(0.01)
    start, n, loss = time.perf_counter(), 0, None
    for x, y in batches:
        loss = step(x, y)
        n += batch
        if time.perf_counter() - start >= window_s:
            break
    float(loss)
    return n / (time.perf_counter() - start)


def input_pipeline(payload: dict[str, Any]) -> dict[str, Any]:
    """What a Ray worker's input is for in-memory data, with no model behind it.

    The driver puts the arrays in the object store once; each worker, after
    setting its thread count, takes its slice of a seeded permutation every
    epoch (``train_batches_from_arrays`` with its rank and the world size).
    Here: worker rank 0 of ``input_workers``, the arrays loaded in this process.
    """
    from app.data.memory import load_source
    from app.data.plan import EpochPlan
    from app.data.tf_input import train_batches_from_arrays
    from app.training.strategy import set_thread_counts

    payload = dict(payload)
    world = int(payload.pop("input_workers"))
    config = TrainConfig(**payload)
    set_thread_counts(config.cpus_per_worker)
    source = load_source(config)
    plan = EpochPlan.for_run(config, len(source.train), world)
    batches = train_batches_from_arrays(source.train, plan, config.seed, config.shuffle, 0, config.epochs, 0)
    iterator = iter(batches)
    per_epoch = []
    for _ in range(config.epochs):
        start = time.perf_counter()
        for _ in range(plan.steps):
            x = next(iterator)[0]
        x.numpy()
        per_epoch.append(plan.steps * plan.step_batch / (time.perf_counter() - start))
    return {"samples_per_second": steady(per_epoch), "per_epoch": per_epoch, "rank": 0, "workers_sharing": world,
            "input": "train_batches_from_arrays (in-memory data on a Ray worker)"}


if __name__ == "__main__":
    child_main({"plain": plain_tf, "input": input_pipeline})
