"""The optimizer's state of a --tensor-parallel run: each shard's slots (Adam's moments...) on the shard's device,
and the state as the unsplit model's optimizer holds it, which checkpoints keep (so a run resumes at any degree)."""

from __future__ import annotations

from typing import Any, Optional

from app import internals
from app.errors import UserError
from app.training.tensor_parallel import Shards, cut, device_of, join


def place_optimizer_slots(optimizer, device: Optional[str] = None) -> dict[int, list]:
    """Each variable's optimizer slots (Adam's moments...) on the variable's device (or on ``device``): Keras creates
    them in ``optimizer.build`` under no device scope (all on the first device); call before the optimizer is built.
    Returns the slots it will create, by ``id`` of their variable, in the order Keras creates them."""
    import tensorflow as tf

    make = optimizer.add_variable_from_reference
    slots: dict[int, list] = {}

    def placed(reference_variable, *args, **kwargs):
        with tf.device(device or device_of(reference_variable)):
            slot = make(reference_variable, *args, **kwargs)
        slots.setdefault(id(reference_variable), []).append(slot)
        return slot

    optimizer.add_variable_from_reference = placed
    return slots


class UnsplitOptimizer:
    """The optimizer's state as the unsplit model's optimizer holds it, for checkpoints: an optimizer of the same
    class and schedule built on the original model's variables, its slots the split optimizer's shards put together
    (``gather``, before a save) or the source of them (``scatter``, after a restore). A checkpoint is then the one an
    unsplit run writes, and a run resumes at any degree, or none."""

    def __init__(self, split: Shards, optimizer, slots: dict[int, list]):
        import keras

        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise UserError("--tensor-parallel with --mixed-precision fp16 (a loss-scaled optimizer) is not built: "
                            "use --mixed-precision bf16 or off")
        self.split, self.optimizer, self.slots = split, optimizer, slots
        rate = internals.learning_rate_schedule(optimizer)  # the same structure as an unsplit run's optimizer
        scheduled = isinstance(rate, keras.optimizers.schedules.LearningRateSchedule)
        # A rate variable beside a schedule (the product's rule wrapped around a number: its variable stays in the
        # optimizer's list) is in the twin too, or a checkpoint's variables would not line up with the model's
        with_variable = scheduled and any(v.name == "learning_rate" for v in optimizer.variables)
        self.unsplit = type(optimizer).from_config({**optimizer.get_config(), "learning_rate": 0.0 if with_variable
                                                    else rate if scheduled else float(rate.numpy())})
        if with_variable:
            internals.wrap_learning_rate(self.unsplit, lambda _: rate)
        # In host memory, where a checkpoint reads and writes them: no device holds the unsplit layers' slots.
        self.unsplit_slots = place_optimizer_slots(self.unsplit, device="/CPU:0")
        self.unsplit.build(split.unsplit_trainable)
        if not optimizer.built:
            optimizer.build(split.split_trainable)

    def gather(self):
        """The unsplit optimizer, holding the split one's state (call before each checkpoint)."""
        internals.step_counter(self.unsplit).assign(internals.step_counter(self.optimizer))
        for variable, pieces, axis in self._pieces():
            for k, slot in enumerate(self.unsplit_slots.get(id(variable), [])):
                slot.assign(join([self.slots[id(p)][k].numpy() for p in pieces], axis))
        return self.unsplit

    def scatter(self) -> None:
        """The restored unsplit state into the split model and optimizer (after a checkpoint was read)."""
        self.split.resplit()
        internals.step_counter(self.optimizer).assign(internals.step_counter(self.unsplit))
        for variable, pieces, axis in self._pieces():
            for k, slot in enumerate(self.unsplit_slots.get(id(variable), [])):
                for piece, part in zip(pieces, cut(slot.numpy(), len(pieces), axis)):
                    self.slots[id(piece)][k].assign(part)

    def _pieces(self) -> list[tuple[Any, list, Any]]:
        """The split layers' pieces, and every other trainable variable as its own one piece (shared by both models)."""
        split = self.split.pieces()
        ids = {id(variable) for variable, _, _ in split}
        return split + [(v, [v], None) for v in self.split.unsplit_trainable if id(v) not in ids]


class Split:
    """--tensor-parallel on Keras's fit: the model's split layers in place (app.training.tensor_parallel), and its
    optimizer's state as the unsplit model's optimizer holds it (app.training.tensor_optimizer). Checkpoints hold
    the unsplit model and optimizer, as an unsplit run writes them (app.training.keras_checkpoint.save): the driver's
    model reads them, and a run resumes at any degree, or none."""

    def __init__(self, model, plan, data: Any) -> None:
        """``data``: the worker's KerasData (its first batch builds the split layers)."""
        from app.training import tensor_parallel
        from app.training.keras_sync import optimizers_of
        from app.training.strategy import tensor_devices

        tensor_parallel.built_on(model, data.first_batch())
        self.shards = tensor_parallel.SplitInPlace.place(model, plan.on(tensor_devices(len(plan.devices))))
        (optimizer,) = optimizers_of(model)  # one: the driver refuses more (app.run.keras_step)
        self.optimizer = UnsplitOptimizer(self.shards, optimizer, place_optimizer_slots(optimizer))

    def checkpoint(self, gather: bool) -> Any:
        """The unsplit model and optimizer as one ``tf.train.Checkpoint`` (``gather``: the shards written into
        them first, before a save)."""
        import tensorflow as tf

        if gather:
            self.shards.unsplit_weights()
        return tf.train.Checkpoint(variables=self.shards.unsplit_variables,
                                   optimizers=[self.optimizer.gather() if gather else self.optimizer.unsplit])
