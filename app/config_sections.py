"""The run configuration's sections: each concern's fields, their ranges and their help.

app.config's ``TrainConfig`` is these sections as one flat model (a YAML file and a search space stay flat,
``--help`` reads by concern); its cross-field rules and the loading are there.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator

from app import config_scale

LrScaling = Literal["linear", "sqrt", "none"]
TENSOR_SPLITS = ("column", "row", "heads", "replicated")  # --tensor-layout LAYER=<one of these>
PIPELINE_MICROBATCHES = 4  # 2 stages, each batch in quarters: a stage idles 1/5 of a step, not 1/2 (docs/guides/pipeline.md)
PositiveInts = Annotated[list[PositiveInt], Field(min_length=1)]
# A model or dataset: a built-in name, "file.py:function", "package.module:function",
# a path/URI (datasets), or, from Python (app.train), the function itself.
Plugin = Union[str, Callable[..., Any]]
WorkerCount = Union[PositiveInt, tuple[PositiveInt, PositiveInt]]  # N, or (MIN, MAX): an elastic run
StepRange = tuple[PositiveInt, PositiveInt]  # --profile-steps A:B
CallbacksSpec = Union[str, Callable[..., Any], list[Any]]  # or a list of keras.callbacks.Callback (app.train)


class _Section(BaseModel):
    # A float field takes a finite number: inf or nan in a timeout, an interval or a rate is no setting at all.
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True, allow_inf_nan=False)


class RunSection(_Section):
    """Where and how wide the run is."""

    backend: Literal["ray", "local"] = Field(
        "ray", description="ray: Ray Train workers (MultiWorkerMirroredStrategy). local: no Ray, one process."
    )
    strategy: Literal["auto", "mirrored", "tpu", "one-device", "central-storage", "pipeline",
                      "parameter-server"] = Field(
        "auto",
        description="--backend ray: auto = MultiWorkerMirroredStrategy (synchronous all-reduce), parameter-server = "
        "asynchronous updates on --num-ps parameter servers (Ray actors). --backend local: auto = TPU if found, "
        "else 2+ GPUs Mirrored, 1 GPU one-device, else CPU; pipeline = the model cut into stages over --devices.",
    )
    devices: Optional[PositiveInt] = Field(
        None, description="--backend local on CPU: split the CPU into N logical devices (Mirrored replicas)."
    )
    pipeline_microbatches: PositiveInt = Field(
        PIPELINE_MICROBATCHES, description="--strategy pipeline: run each batch as N micro-batches, so that the "
        "stages overlap (GPipe).")
    split_at: Optional[Annotated[list[str], Field(min_length=1)]] = Field(
        None, description="--strategy pipeline: the layers that start a stage (block_2,block_4 or block_2 block_4); "
        "default: where the parameters balance.")
    tensor_parallel: Optional[int] = Field(
        None, ge=1, description="Each replica's layers split over N devices of its process (Megatron's layout: an "
        "MLP block's first Dense by output columns, its second by input rows, attention by heads; the GPUs, else N "
        "logical CPUs): one replica on --backend local, one per Ray worker, the workers' gradients all-reduced. The "
        "built-in mlp and transformer know their blocks; a model of your own names them with --tensor-layout. "
        "1: no split (a split run resumed on one device).")
    tensor_layout: Optional[Annotated[list[str], Field(min_length=1)]] = Field(
        None, description="--tensor-parallel: LAYER=column|row|heads|replicated items, LAYER a name or a pattern "
        "(ff_in_*): which Dense layers are split (by columns or rows) and which MultiHeadAttention (by heads).")
    steps_per_execution: PositiveInt = Field(
        1, description="Train steps per tf.function call (TPUs want many: fewer host round trips)."
    )
    num_workers: WorkerCount = Field(
        2, description="Ray Train workers (one replica each): N, or MIN:MAX for an elastic run that starts once MIN "
        "fit, grows as the cluster has room (up to MAX) and shrinks instead of failing when a node is lost.")
    resize_check_s: float = Field(
        15.0, gt=0, description="--num-workers MIN:MAX: how often Ray Train looks for room to grow the workers.")
    num_ps: PositiveInt = Field(
        1, description="--strategy parameter-server: parameter servers (Ray actors) the variables are spread over."
    )
    cpus_per_ps: float = Field(1.0, gt=0, description="--strategy parameter-server: CPUs each parameter server reserves.")
    use_gpu: bool = Field(False, description="Give each worker one GPU.")
    cpus_per_worker: float = Field(
        1.0, gt=0, description="CPUs each worker reserves; also its TensorFlow thread count (rounded up)."
    )
    memory_per_worker: Optional[float] = Field(
        None, gt=0, description="GiB of memory each Ray worker reserves (Ray's memory resource): the budget a "
        "model's training must fit (--shard-optimizer 3 cuts it by the workers). Unset: nothing reserved, and the "
        "budget is the memory a Ray started on this machine can reserve, shared by its workers.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="How Ray places the workers: PACK fills nodes (fast local all-reduce), SPREAD puts them on "
        "different nodes where it can (STRICT_*: must).",
    )
    max_failures: int = Field(
        0, ge=0, description="Restart the worker group from the last checkpoint up to N times when a worker dies "
        f"(an elastic run, where losing a node is expected: {config_scale.ELASTIC_RESTARTS} unless set)."
    )
    worker_start_timeout_s: float = Field(
        120.0, gt=0, description="How long to wait for the cluster to place the workers before failing."
    )
    stall_timeout_s: float = Field(
        300.0, gt=0,
        description="Ray workers: a training step or a sum over the workers (the gradient all-reduce, a metric "
        "sum) that waits longer than this many seconds fails the run (or restarts it under --max-failures) instead "
        "of waiting forever for a frozen or cut-off worker; a step's time counts from its start (its first trace "
        "too): raise it for a step that takes minutes.",
    )
    seed: int = Field(0, description="Seed for weights, the validation split and the per-epoch shuffle.")

    @property
    def tensor_degree(self) -> Optional[int]:
        """The devices --tensor-parallel splits layers over; None: no split (--tensor-parallel 1 is none too)."""
        return self.tensor_parallel if self.tensor_parallel and self.tensor_parallel > 1 else None

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        return config_scale.parse_workers(value)

    @property
    def min_workers(self) -> int:
        """The workers a run starts with (an elastic run: MIN)."""
        return config_scale.sizes(self.num_workers)[0]

    @property
    def max_workers(self) -> int:
        """The most workers a run has (an elastic run: MAX)."""
        return config_scale.sizes(self.num_workers)[-1]

    @property
    def elastic(self) -> bool:
        return not isinstance(self.num_workers, int)

    @property
    def restarts(self) -> int:
        """Worker-group restarts allowed: --max-failures, or for an elastic run that does not set it, a few."""
        given = "max_failures" in self.model_fields_set
        return config_scale.ELASTIC_RESTARTS if self.elastic and not given else self.max_failures


class DataSection(_Section):
    """What is trained on."""

    dataset: Plugin = Field(
        "digits",
        description="Dataset: digits (embedded, no download), synthetic (--synthetic-* sizes), synthetic-text, "
        "a path/URI (local, s3://, gs://) to parquet, CSV or TFRecord files, an image folder (one subfolder per "
        "class), a .npz file or a directory of .npy files, or your function: file.py:function or "
        "package.module:function.",
    )
    data_format: Literal["auto", "parquet", "csv", "tfrecord", "images", "numpy"] = Field(
        "auto", description="Format of a --dataset path: auto = from the extensions (tfrecord: files without one too)."
    )
    val_dataset: Optional[str] = Field(
        None, description="Validation data from a separate path/URI (same format); default: --val-fraction split."
    )
    feature_columns: Optional[list[str]] = Field(
        None,
        description="Feature columns (numeric scalars, or one list/tensor column; for .npz/.npy the array name). "
        "Default: every column but the label and text columns.",
    )
    inputs: Optional[list[str]] = Field(
        None,
        description="A model of several named inputs (keras.Input(name=...)) fed from file columns: one item per "
        "input, NAME (the column of that name) or NAME=COLUMN. Each column holds numbers or lists of numbers. "
        "Default: a model whose input names are all columns reads each from its own.",
    )
    label_column: str = Field("label", description="Column of the labels: integer class ids 0..K-1, class names "
                              "(strings), or float targets.")
    class_names: Optional[Annotated[list[str], Field(min_length=1)]] = Field(
        None, description="A label column of class names (strings): the names in class-id order (id 0 "
        "first). Default: every name in the training data, sorted. The run's config.yaml records them: evaluation "
        "and prediction map names to ids as training did.",
    )
    text_column: Optional[str] = Field(
        None, description="A string column to tokenize into --sequence-length token ids (the features, for text)."
    )
    num_classes: Optional[int] = Field(
        None, ge=2, description="Number of classes (default: largest label + 1); labels beyond it are refused."
    )
    feature_shape: Optional[PositiveInts] = Field(
        None, description="Reshape each example to this shape, e.g. 32 32 3 for images stored as flat lists."
    )
    image_size: Annotated[list[PositiveInt], Field(min_length=2, max_length=2)] = Field(
        default_factory=lambda: [32, 32], description="Image folders and image bytes: decode and resize to height width."
    )
    image_channels: Literal[1, 3] = Field(3, description="Image folders and image bytes: 3 = RGB, 1 = grayscale.")
    data_cache: Literal["auto", "memory", "stream"] = Field(
        "auto",
        description="File datasets: memory = preprocess once and keep the result in Ray's object store (epochs "
        "only reshuffle); stream = read and preprocess block by block every epoch (data larger than memory); "
        "auto = memory when it takes under 30 percent of the object store.",
    )
    shuffle: bool = Field(True, description="Reshuffle the training set every epoch (seeded).")
    shuffle_buffer: PositiveInt = Field(
        2048, description="Streamed data: rows in each worker's local shuffle buffer (files are shuffled too)."
    )
    stream_buffer_mib: int = Field(
        256, ge=256,
        description="Streamed data: object-store memory (MiB) that Ray Data may fill with blocks read ahead of "
        "training, per dataset. Bounds memory whatever the dataset's size; raise it if reads stall training. "
        "At least 256: with less, Ray Data's per-operator shares fall below one block and reading crawls.",
    )
    val_fraction: float = Field(0.2, gt=0, lt=1, description="Seeded fraction of the data held out for validation.")
    vocab_size: int = Field(
        8192, ge=2, le=2**24, description="Text: token id buckets (hashing trick; 0 is padding)."
    )
    sequence_length: PositiveInt = Field(64, description="Text: tokens per example (truncated or padded).")
    synthetic_text_rows: int = Field(2000, ge=2, description="--dataset synthetic-text: number of texts.")
    synthetic_rows: int = Field(2048, ge=2, description="--dataset synthetic: number of rows.")
    synthetic_shape: PositiveInts = Field(
        default_factory=lambda: [32, 32, 3], description="--dataset synthetic: shape of one example."
    )
    synthetic_classes: int = Field(10, ge=2, description="--dataset synthetic: number of classes.")


class ModelSection(_Section):
    """What is trained."""

    model: Plugin = Field(
        "mlp",
        description="Model: mlp, cnn, transformer, or your function: file.py:function or package.module:function "
        "(called with the arguments it declares among input_shape, num_classes and --model-args).",
    )
    model_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the model function, as a JSON object on the command line "
        "('{\"width\": 64}'), a mapping in YAML. Built-in models also take the fields below.",
    )
    task: Literal["auto", "classification", "binary", "regression"] = Field(
        "auto",
        description="auto: integer labels -> classification (binary when the model has one output), float "
        "targets -> regression. Sets the default loss and the metric (accuracy, or mean absolute error).",
    )
    loss: Optional[str] = Field(
        None,
        description="Any Keras loss name (e.g. huber, mean_squared_error). Default: cross-entropy for "
        "classification and binary, mean_squared_error for regression.",
    )
    class_weight: Optional[str] = Field(
        None,
        description="Weigh each class in the loss, as Keras's class_weight: balanced (n / (classes x count), from "
        "the training labels) or a JSON object of class ids to weights ('{\"0\": 1, \"1\": 5}').",
    )
    from_logits: Optional[bool] = Field(
        None,
        description="Whether the model outputs logits. Default: decided from the model's last activation "
        "(softmax or sigmoid -> probabilities).",
    )
    hidden_units: PositiveInts = Field(default_factory=lambda: [256, 128], description="mlp: hidden layer widths.")
    conv_filters: PositiveInts = Field(
        default_factory=lambda: [32, 64, 128],
        description="cnn: filters of each conv stage (two 3x3 conv + batch norm each; pooling between stages).",
    )
    embed_dim: PositiveInt = Field(64, description="transformer: embedding width (a multiple of --num-heads).")
    num_heads: PositiveInt = Field(4, description="transformer: attention heads per block.")
    ff_dim: PositiveInt = Field(128, description="transformer: hidden width of each block's feed-forward layer.")
    num_blocks: PositiveInt = Field(2, description="transformer: number of encoder blocks.")
    embedding_shards: PositiveInt = Field(
        1,
        description="transformer: split the token embedding table into K shards (app.layers.ShardedEmbedding); "
        "under --strategy parameter-server the shards are spread over the parameter servers.",
    )
    sync_batch_norm: bool = Field(
        False,
        description="cnn: batch-norm statistics over the global batch (one all-reduce per layer per step) "
        "instead of each replica's own batch.",
    )


class OptimSection(_Section):
    """How it is trained."""

    epochs: PositiveInt = Field(15, description="Training epochs.")
    per_replica_batch: int = Field(
        32, gt=0, description="Batch size on each replica; global batch = this x replicas."
    )
    global_batch: Optional[PositiveInt] = Field(
        None, description="Rows behind one optimizer step over every replica, kept at every worker count (an "
        "elastic run's math does not change with its size; what app.fit's batch_size means): each replica takes an "
        "equal part. Instead of --per-replica-batch.")
    base_lr: float = Field(0.05, gt=0, description="Learning rate at --reference-batch (a built-in model may carry "
        "its own default: transformer 0.001).")
    reference_batch: PositiveInt = Field(32, description="Global batch size at which --base-lr is the right LR.")
    lr_scaling: LrScaling = Field(
        "linear",
        description="How the LR follows global batch / reference batch: linear (Goyal et al. 2017), sqrt, none.",
    )
    warmup_epochs: float = Field(1.0, ge=0, description="Linear LR warmup length in epochs (0 = none).")
    lr_decay: Literal["cosine", "constant"] = Field(
        "cosine", description="LR after warmup: cosine decay to 0 over the run, or constant."
    )
    grad_accum: PositiveInt = Field(
        1,
        description="One optimizer update every K steps of --per-replica-batch, their gradients summed (Keras's "
        "gradient_accumulation_steps): global batch = per-replica x replicas x K (the LR rule uses it).",
    )
    mixed_precision: Literal["off", "fp16", "bf16"] = Field(
        "off",
        description="Compute in float16 (GPUs; dynamic loss scaling) or bfloat16 (TPUs, CPUs with bf16 "
        "instructions); variables and the logits stay float32.",
    )
    shard_optimizer: Literal[0, 1, 2, 3] = Field(0, description="ZeRO: each of N workers keeps 1/N of every "
        "optimizer's state (1: the state; 2: the summed gradients too; 3: the weights too, each layer's gathered as "
        "it computes), for the same weights; on Ray. 0: every worker holds the whole state.")
    optimizer: Literal["sgd", "adam"] = Field("sgd", description="Optimizer (a built-in model may carry its own "
        "default: transformer adam).")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum (0 = plain SGD).")
    callbacks: Optional[CallbacksSpec] = Field(None, description="Keras callbacks: file.py:function returning a "
        "list of keras.callbacks.Callback (from Python: the list). Run on rank 0; their stop and LR changes apply to "
        "every worker.")


class OutputSection(_Section):
    """Where results, checkpoints and logs go."""

    output: Optional[str] = Field(
        None, description="Output directory (default: runs/train-<timestamp>). Must not exist unless --overwrite."
    )
    overwrite: bool = Field(False, description="Allow replacing an existing --output directory.")
    resume: bool = Field(
        False,
        description="Continue the unfinished run in --output from its last checkpoint (its config.yaml is the base "
        "config). A finished run is never retrained.",
    )
    checkpoint_every_steps: Optional[PositiveInt] = Field(
        None, description="Ray Train: also checkpoint every N steps inside an epoch, so that a restart or a resize "
        "re-does at most N steps (the run goes on from that exact step).")
    keep_checkpoints: PositiveInt = Field(2, description="Checkpoints kept. Ray Train: the N best by the val metric "
        "(accuracy; mae for regression), plus the latest. --backend local, parameter-server: the latest N.")
    storage_path: Optional[str] = Field(None, description="Ray Train storage for checkpoints (default: <output>/ray); "
        "on a multi-node cluster, shared storage (NFS, s3://, gs://). Not used by --backend local or --strategy "
        "parameter-server: they write <output>/checkpoint.")
    tensorboard: bool = Field(True, description="Rank 0 writes TensorBoard scalars (see --tensorboard-dir).")
    tensorboard_dir: Optional[str] = Field(
        None,
        description="TensorBoard log directory or URI (default: <output>/tensorboard; with --storage-path, "
        "<storage-path>/<run name>/tensorboard, reachable from every node).",
    )
    log_every_steps: int = Field(
        50, ge=0, description="TensorBoard step scalars every N optimizer steps (0 = per epoch only)."
    )
    profile_steps: Optional[StepRange] = Field(
        None, description="A:B: TensorFlow's profiler over the run's steps A to B (counted from 1 over its epochs) on "
        "every worker, written to <tensorboard dir>/profile/worker-<rank>: TensorBoard's profile tab opens them "
        "(pip install -e '.[profile]', then tensorboard --logdir <output>/tensorboard/profile).")
    export: Annotated[list[str], Field(min_length=1)] = Field(default_factory=lambda: ["keras", "savedmodel"],
        description="What the run writes for use elsewhere: keras = model.keras, savedmodel = saved_model/ (a "
        "SavedModel for TensorFlow Serving); --export keras,savedmodel or --export keras.")
    audit_sample_ids: bool = Field(
        False, description="Record the id of every training row each worker's input hands to the step, gathered "
        "over the workers every epoch: audit_sample_ids.json (a list of ids per epoch) and result.json's audit (ids "
        "trained and distinct ones per epoch). Arrays and files; not a tf.data pipeline, not with "
        "--checkpoint-every-steps."
    )
    @field_validator("profile_steps", mode="before")
    @classmethod
    def _profile_steps(cls, value: Any) -> Any:
        return parse_steps(value)

    # Not "verbose": app.fit takes Keras's verbose (0, 1, 2, "auto"), beside every config field.
    show_logs: bool = Field(
        False, description="Show Ray's and TensorFlow's own log lines on the console too (they always go to "
        "<output>/train.log), and an error's traceback."
    )


def parse_steps(value: Any) -> Any:
    """--profile-steps A:B (or a pair): the first and last step, A <= B, each a whole number from 1."""
    if value is None or isinstance(value, (tuple, list)):
        pair = value
    else:
        parts = str(value).split(":")
        try:
            pair = tuple(int(p) for p in parts)
        except ValueError:
            pair = ()
        if len(parts) != 2 or len(pair) != 2:
            raise ValueError("takes A:B, the first and last step to profile (for example 10:15)")
    if pair is not None and len(pair) == 2 and all(isinstance(p, int) for p in pair) and pair[0] > pair[1]:
        raise ValueError(f"A:B must have A <= B: for example {pair[1]}:{pair[0]}")
    return pair


SECTIONS: tuple[type[_Section], ...] = (RunSection, DataSection, ModelSection, OptimSection, OutputSection)
