"""The benchmark suites behind jobs/benchmark.py: a preset in, the files written out.

- throughput (app.bench.scaling): the Ray path against a plain TF loop, 1..N workers, the N-process
  ceiling, the input alone, the time to first step -> benchmark.json, scaling.png
- checkpoint (app.bench.checkpoint_cost): one checkpoint write against one epoch -> checkpoint.json
- memory (app.bench.memory): peak memory with streamed parquet at 1x and scale x -> memory.json
- start (app.bench.start_end): jobs/train.py and app.fit from a fresh script against a plain Keras script of the
  same model and data: first step and whole command, medians of interleaved rounds, CPU steal -> start.json
- exit (app.bench.exit_gap): the time from the last epoch line to the end of jobs/train.py -> exit.json
- ps (app.bench.ps_vs_mwms): parameter-server training against MWMS, same model and CPUs -> ps.json
- sweep (app.bench.sweep_cost): ASHA against the full grid, worker-seconds and best accuracy -> sweep.json
- keras (app.bench.keras_fit): a compiled model (two metrics) on this product's loop against Keras's own
  model.fit, local and on one Ray worker -> keras.json
- engine (app.bench.engine): app.fit on Keras's own fit, 1 and 2 Ray workers, against plain model.fit processes
  and local runs, in the same run: the three speed ratios -> engine.json
- input (app.bench.input_sources): the same rows as parquet (streamed, cached), TFRecord and tf.data against
  arrays in memory, on Ray workers -> input.json
- predict (app.bench.predict_cost): batch prediction's rows/s (Ray, 1 and 2 actors) against model.predict, and its
  memory at 1x and scale x the data -> predict.json
- elastic (app.bench.elastic): Ray Train's elastic resize (1 -> 2 -> 1 workers as a node joins and leaves) under
  this product's TF_CONFIG backend: seconds to the first step at the new size, steps done again -> elastic.json
- streaming (app.bench.streaming): one compiled model by Keras's fit on 2 Ray workers from arrays, parquet
  (Ray Data) and TFRecord files (a tf.data pipeline every worker reads), rates and memory at 1x and scale x
  -> streaming.json
- shard-optimizer (app.bench.shard_optimizer): Adam's state sharded over 2 Ray workers against unsharded:
  samples/s, and each worker's state and peak memory on a model with a large state -> shard-optimizer.json
- tensor-parallel (app.bench.tensor_split): the transformer's feed-forward pairs split over N = 1, 2, 4 devices of
  one process: samples/s and the split layers' bytes per device -> tensor-parallel.json
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterable, Optional

from app.bench import (
    checkpoint_cost,
    elastic,
    engine,
    exit_gap,
    input_sources,
    keras_fit,
    memory,
    predict_cost,
    ps_vs_mwms,
    scaling,
    shard_optimizer,
    start_end,
    streaming,
    sweep_cost,
    tensor_split,
)
from app.bench.preset import Preset, load, parse_sets, preset_file
from app.driver import output_guard

SUITES = {"throughput": scaling, "checkpoint": checkpoint_cost, "memory": memory, "start": start_end,
          "exit": exit_gap, "ps": ps_vs_mwms, "sweep": sweep_cost, "keras": keras_fit, "engine": engine, "input": input_sources,
          "predict": predict_cost, "elastic": elastic, "tensor-parallel": tensor_split, "streaming": streaming,
          "shard-optimizer": shard_optimizer}


def load_preset(suite: str, preset: Optional[str] = None, quick: bool = False, flags: Optional[dict[str, Any]] = None,
                config_file: Optional[str] = None, sets: Iterable[str] = ()) -> Preset:
    """``suite``'s section of the preset (``--preset``, else quick.yaml or full.yaml), flags and fields applied."""
    return load(suite, SUITES[suite].PARAMS, preset_file(preset, quick), flags, config_file, parse_sets(sets))


def default_output(suite: str) -> Path:
    # The memory and predict suites keep their datasets there for the next run (memory: its phases, one at a time).
    if suite in ("memory", "predict"):
        return Path(f"runs/benchmark-{suite}")
    return Path(f"runs/benchmark-{'' if suite == 'throughput' else suite + '-'}{time.strftime('%Y%m%d-%H%M%S')}")


def run(preset: Preset, output: Optional[str], command: str) -> list[Path]:
    """Run the preset's suite; the files it wrote (into ``output``, by default under runs/)."""
    out = (Path(output) if output else default_output(preset.suite)).resolve()
    # Results are added to an earlier benchmark's directory (the memory suite's phases), never to anyone else's.
    output_guard.check(out, "benchmark", reuse=True)
    output_guard.take(out, "benchmark")
    try:
        return SUITES[preset.suite].run(preset, out, command)
    finally:
        output_guard.release(out)
