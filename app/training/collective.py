"""Sums across Ray workers with TensorFlow's collective ops, outside any tf.distribute scope.

MultiWorkerMirroredStrategy is created in each Ray worker only to configure the
cluster's collectives (from TF_CONFIG, before any other TensorFlow op); the
model, its optimizers and Keras's step then run under the default strategy,
one replica per worker, exactly as one process runs them: no MWMS scope, whose
per-step cost was 8 % of a CPU step's rate here. What crosses workers goes
through the same collective all-reduce MWMS uses inside (``CollectiveReduceV2``,
ring over gRPC on CPUs, NCCL on GPUs), called here directly:

- in a traced step (``in_graph``, ``sum_gradients``): the gradients, once per
  optimizer step, in packs that start as soon as their gradients exist (the
  last layers' first), overlapping the rest of the backward pass; a sparse
  gradient's slices gathered instead (``gather_slices_in_graph``); sharded
  optimizers: ``scatter_sum_in_graph`` and ``gather_in_graph``, app.training.zero;
- on the host (``host``, ``gather``): metric sums, batch-norm statistics,
  callback decisions, where each worker runs, a few times per epoch.

With one worker every sum is the value itself.

Every worker makes the same calls in the same order, so a key names the same
all-reduce everywhere: a traced call site has a fixed instance key (``Site``),
the same after a retrace (a short last batch); each host call takes the next
key of a counter (host sums differ in length from call to call, and a key is
bound to its first shape).
"""

from __future__ import annotations

from contextlib import nullcontext
from enum import IntEnum
from typing import Optional, Sequence

import numpy as np

from app.training.stall_watch import StallWatch

GROUP_KEY = 4242  # one group: every worker's device; MWMS's own groups count up from 1


class Site(IntEnum):
    """Every all-reduce in a traced step, one key each (an optimizer's gradients: GRADIENTS + its index)."""

    NORMS = 10  # + the optimizer's index: its variables' squared norms, summed over their parts (app.training.zero)
    FINITE = 20  # + the optimizer's index: its parts' non-finite gradients, counted over the workers (app.training.zero)
    ROWS = 30  # + the optimizer's index: the global batch's rows behind its sharded step (app.training.zero)
    GRADIENTS = 100  # + the optimizer's index x PACKS + the pack's index
    PACKS = 1000
    PARTS = 200_000  # + the optimizer's index x PACKS + the bucket's index: its parts gathered (app.training.zero)
    SLICES = 300_000  # + (the optimizer's index x 64 + the sparse gradient's index) x SLICE_KEYS: its slices gathered
    BATCH_NORM = 400_000  # + 2 x (layer x CALLS + call) (+ 1: its gradient): app.training.sync_batch_norm
    WEIGHT_NORMS = 499_999  # the gradients' squared norms of a model whose weights are sharded (app.training.zero_weights)
    # Stage 3's keys, far above the host keys' counter (which counts up from HOST_KEYS a few times an epoch), within
    # an instance key's int32: room for millions of weights.
    WEIGHTS = 1 << 24  # + 3 x (the weight's index x CALLS + call) + 0, 1, 2: gathered, again, its gradient (zero_weights)
    SLICES_OF_WEIGHTS = 1 << 30  # + the weight's index x SLICE_KEYS: an embedding's gradient rows gathered (zero_weights)


BYTES_PER_PACK = 4 << 20  # gradients summed in packs of about this size
# A sparse gradient's gather: its lengths' key, then two keys (values, rows) per padded size 2^0 .. 2^63: a key is
# bound to the shape it first gathers, so each size has its own.
SLICE_KEYS = 1 + 2 * 64
SPARSE_PER_OPTIMIZER = 64  # sparse gradients an optimizer's gather keys have room for; past them: summed dense


HOST_KEYS = 1 << 20  # host calls count up from here, above every Site


class Collective:
    """All-reduce (sum) over ``world`` workers; with one worker every sum is the value itself."""

    def __init__(self, world: int, timeout_s: Optional[float] = None, rank: int = 0):
        self.world, self.rank = world, rank
        # --stall-timeout-s: a step or a host sum that waits longer on a peer is cancelled or aborted (None: waits)
        self.watch = StallWatch(timeout_s) if world > 1 and timeout_s else None
        self._host_calls = 0
        # --tensor-parallel: a worker's variables live on several devices; its sums all run on one of them (the
        # group has one member per worker). None: where the placer puts them (the worker's one device).
        self.device: Optional[str] = None

    def in_graph(self, tensor, site: int):
        """Sum of a tensor over every worker, inside a traced function."""
        if self.world == 1:
            return tensor
        from app.internals import collectives

        return self._run(lambda: collectives.all_reduce(tensor, self.world, GROUP_KEY, int(site)))

    def gather_in_graph(self, tensor, site: int):
        """Every worker's ``tensor`` concatenated along the first axis in rank order, inside a traced function."""
        if self.world == 1:
            return tensor
        from app.internals import collectives

        # ``site``: a number, or a tensor (a key chosen in the graph: gather_slices_in_graph)
        key = site if hasattr(site, "dtype") else int(site)
        return self._run(lambda: collectives.all_gather(tensor, self.world, GROUP_KEY, key))

    def scatter_sum_in_graph(self, tensor, site: int):
        """This worker's part of the sum over every worker of ``tensor`` (first axis: one row per worker, row ``r``
        for rank ``r``), inside a traced function: a reduce-scatter."""
        if self.world == 1:
            return tensor[0]
        import tensorflow as tf

        from app.internals import collectives

        rows = self._run(lambda: collectives.all_to_all(tensor, self.world, GROUP_KEY, int(site)))
        with self._placed():
            return tf.reduce_sum(rows, 0)

    def gather_slices_in_graph(self, slices, site: int):
        """Every worker's slices of a ``tf.IndexedSlices`` concatenated in rank order, inside a traced function.
        Workers may hold different numbers of slices, and a step another number than the last (a global batch cut
        one row apart, a short last batch): each pads to the power of two at or above the longest, whose keys
        (``site`` + 1 + 2 log2 of it) always gather that shape; the padding is dropped after the gather."""
        import tensorflow as tf

        rows = tf.cast(slices.indices, tf.int64)
        length = tf.shape(rows, out_type=tf.int64)[:1]
        lengths = self.gather_in_graph(length, site)
        longest = tf.maximum(tf.reduce_max(lengths), 1)
        bits = tf.cast(tf.raw_ops.PopulationCount(x=_smear(longest - 1)), tf.int64)  # log2 of the padded size
        size = tf.bitwise.left_shift(tf.constant(1, tf.int64), bits)
        values = slices.values
        pad = tf.concat([[[0, size - length[0]]], tf.zeros([tf.rank(values) - 1, 2], tf.int64)], 0)
        keep = tf.reshape(tf.sequence_mask(lengths, size), [-1])
        key = tf.cast(site + 1 + 2 * bits, tf.int32)
        all_values = self.gather_in_graph(tf.pad(values, pad), key)
        all_rows = self.gather_in_graph(tf.pad(rows, [[0, size - length[0]]]), key + 1)
        return tf.IndexedSlices(tf.boolean_mask(all_values, keep),
                                tf.cast(tf.boolean_mask(all_rows, keep), slices.indices.dtype), slices.dense_shape)

    def gather_tensor(self, tensor):
        """``gather_in_graph`` on the host (eager), under the next host key."""
        if self.world == 1:
            return tensor
        self._host_calls += 1
        return self.gather_in_graph(tensor, HOST_KEYS + self._host_calls)

    def _run(self, op):
        """``op()`` on this worker's collective device; run eagerly (a host sum), inside the stall watch's bound
        (a traced step's are inside it by the step: app.training.keras_callbacks.StepWatch)."""
        import tensorflow as tf

        with self._placed(), self.watch.waiting() if self.watch and tf.executing_eagerly() else nullcontext():
            return op()

    def _placed(self):
        if self.device is None:
            return nullcontext()
        import tensorflow as tf

        return tf.device(self.device)

    def host(self, values: np.ndarray) -> np.ndarray:
        """Sum of a host vector over every worker (float64, exact for counts)."""
        values = np.asarray(values, dtype=np.float64)
        if self.world == 1:
            return values
        import tensorflow as tf

        self._host_calls += 1
        return self.in_graph(tf.constant(values), HOST_KEYS + self._host_calls).numpy()

    def sum_gradients(self, grads: list, site: int = Site.GRADIENTS, bytes_per_pack: int = BYTES_PER_PACK,
                      gather_slices: bool = True) -> list:
        """Each gradient summed over every worker (inside a traced step), in packs of about ``bytes_per_pack``: the
        last variables' first, as the backward pass makes them, so a pack's all-reduce starts while the rest are
        still being computed. Every worker packs the same list the same way."""
        if self.world == 1:
            return list(grads)
        import tensorflow as tf

        # A sparse gradient (an embedding's rows, tf.IndexedSlices) is every worker's slices gathered, as
        # MultiWorkerMirroredStrategy reduces one: the optimizer then sees the slices one process would have (Adam
        # squares each slice before adding a row's, so a dense sum would change its steps). An unused variable's
        # None stays None. ``gather_slices`` False (a step XLA compiles): summed dense.
        optimizer = (site - Site.GRADIENTS) // Site.PACKS
        sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)][:SPARSE_PER_OPTIMIZER] \
            if gather_slices else []
        grads = [None if g is None else g if i in sparse else tf.convert_to_tensor(g) for i, g in enumerate(grads)]
        out = list(grads)
        for j, i in enumerate(sparse):
            out[i] = self.gather_slices_in_graph(
                grads[i], Site.SLICES + (optimizer * SPARSE_PER_OPTIMIZER + j) * SLICE_KEYS)
        order = [i for i in reversed(range(len(grads))) if grads[i] is not None and i not in sparse]
        # A densified embedding gradient may have no static shape: it counts as small here.
        packs = [[order[j] for j in pack] for pack in
                 cut_in_packs([(grads[i].shape.num_elements() or 0) * grads[i].dtype.size for i in order],
                              bytes_per_pack)]
        with self._placed():  # a pack gathers gradients from every device of the worker (--tensor-parallel)
            for k, members in enumerate(packs):
                flat = tf.concat([tf.reshape(tf.cast(grads[i], tf.float32), [-1]) for i in members], 0)
                parts = tf.split(self.in_graph(flat, site + k), tf.stack([tf.size(grads[i]) for i in members]))
                for i, part in zip(members, parts):
                    out[i] = tf.cast(tf.reshape(part, tf.shape(grads[i])), grads[i].dtype)
        return out

    def average_variables(self, variables: list) -> None:
        """Each variable set to its mean over every worker (host-side: batch-norm statistics, once per epoch)."""
        self._assign_sum(variables, 1.0 / self.world, mine=True)

    def broadcast_variables(self, variables: list) -> None:
        """Each variable set to rank 0's value (every worker starts from the same weights)."""
        self._assign_sum(variables, 1.0, mine=self.rank == 0)

    def _assign_sum(self, variables: list, scale: float, mine: bool) -> None:
        """Each variable set to its sum over the workers x ``scale``, a pack of about BYTES_PER_PACK (of one dtype)
        at a time, so the copies it makes are a pack's, not the model's. A broadcast (``scale`` 1: every other
        worker sends zeros) sums in the variables' own dtype, which is exact; a mean in float64."""
        if self.world == 1 or not variables:
            return
        import tensorflow as tf

        dtypes = [tf.as_dtype(v.dtype) for v in variables]
        for members in cut_in_packs([int(np.prod(v.shape)) * d.size for v, d in zip(variables, dtypes)],
                                    BYTES_PER_PACK, dtypes):
            pack = [variables[i] for i in members]
            dtype = dtypes[members[0]] if scale == 1.0 else tf.float64
            flat = tf.concat([tf.reshape(tf.cast(tf.convert_to_tensor(v), dtype), [-1]) for v in pack], 0)
            self._host_calls += 1
            total = self.in_graph(flat if mine else tf.zeros_like(flat), HOST_KEYS + self._host_calls)
            if scale != 1.0:
                total = total * scale
            at = 0
            for v in pack:
                size = int(np.prod(v.shape))
                v.assign(tf.cast(tf.reshape(total[at:at + size], v.shape), v.dtype))
                at += size

    def gather(self, row: np.ndarray) -> np.ndarray:
        """Every worker's ``row`` (the same length everywhere), stacked in rank order, on the host."""
        row = np.asarray(row, dtype=np.float64)
        mine = np.zeros((self.world, row.size))
        mine[self.rank] = row
        return self.host(mine.ravel()).reshape(self.world, row.size)


def _smear(n):
    """``n`` (int64, >= 0) with every bit below its highest set: its population count is the bits ``n`` takes."""
    import tensorflow as tf

    for shift in (1, 2, 4, 8, 16, 32):
        n = tf.bitwise.bitwise_or(n, tf.bitwise.right_shift(n, tf.constant(shift, tf.int64)))
    return n


def cut_in_packs(nbytes: Sequence[int], limit: int = BYTES_PER_PACK, kinds: Optional[Sequence] = None) -> list[list[int]]:
    """Positions ``0..len(nbytes) - 1``, in order, cut into packs: the next pack starts once one holds ``limit``
    bytes or more, or where ``kinds`` (a dtype each) changes. Every worker cuts the same list the same way."""
    packs: list[list[int]] = []
    size = limit
    for i, n in enumerate(nbytes):
        if size >= limit or kinds is not None and kinds[i] != kinds[packs[-1][-1]]:
            packs.append([])
            size = 0
        packs[-1].append(i)
        size += n
    return packs
