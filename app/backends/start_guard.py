"""Ray Train's worker-group start, made safe to fail: a failed start gives back what it holds.

Ray 2.60's Train V2 (ray/train/v2/_internal/execution/worker_group/worker_group.py,
``WorkerGroup._start``) cleans up a failed start only when it failed before the
group's state was built. A worker that dies after that point (while the
backend gives the workers their TF_CONFIG, while Ray Data's split coordinators
start, or while the training function is launched) makes the start raise,
but nothing shuts the half-started group down: the controller never got a
handle to it. Its placement group keeps the CPUs, and the retry's placement
group waits for them, forever (start failures are retried without limit
unless ``FailureConfig.controller_failure_limit`` is set). Seen: 3 of 13 runs
with a worker SIGKILLed 1-1.5 s after its process appeared were still waiting
minutes later ("1.0 used of 2.0 reserved in placement groups").

A worker that dies just after the start, before the train function is
launched, raises outside the part Ray turns into a start failure: the run
ends on a ``ControllerError`` Ray's failure policy does not retry, whatever
``max_failures`` says. ``ReleaseFailedStart`` makes such an error retryable
in the controller's process (``internals.retry_worker_deaths_in_the_controller``),
counted against the same budget.

``ReleaseFailedStart`` is a controller-side callback that shuts a group
whose start failed down: at once when the start raises inside the callbacks' context, and, for a
group the controller lost (a launch that failed after the callbacks), at the
next start or when the controller shuts down.
Ray Train takes extra controller callbacks, ahead of its own, from the
``RAY_TRAIN_CALLBACKS`` environment variable, read by ``fit()`` in the driver;
``install()`` adds this one there. Ray Train's callback classes are internal
(DeveloperAPI), reached through app.internals: tests/test_start_faults.py kills
workers at several moments of the start and fails if this stops working on a new
Ray, and tests/test_internals.py checks the hooks used here still exist.
"""

from __future__ import annotations

import contextlib
import logging
import os

from app import internals

log = logging.getLogger(__name__)

ENV_VAR = internals.TRAIN_CALLBACKS_ENV_VAR
WorkerGroupCallback, ControllerCallback = internals.train_callback_bases()


class ReleaseFailedStart(WorkerGroupCallback, ControllerCallback):
    """Shut down a worker group whose start failed after its state was built (see the module docstring)."""

    def __init__(self):
        self._group = None  # the group being started, as soon as it has state

    def after_controller_start(self, train_run_context) -> None:
        # In the controller's process: a worker lost between the group's start and the launch of
        # the train function is a worker failure, retried within the run's budget.
        internals.retry_worker_deaths_in_the_controller()

    def before_worker_group_start(self, worker_group_context) -> None:
        # A group from an earlier start that the controller never got (its launch failed after
        # the callbacks ran) still holds its placement group: release it before asking for another.
        self._release("an earlier start")

    @contextlib.contextmanager
    def on_worker_group_start(self):
        try:
            yield
        except BaseException:
            self._release("this start")
            raise

    def after_worker_group_start(self, worker_group) -> None:
        # Called first among the callbacks (environment callbacks come before Ray's own),
        # so a later callback that fails finds the group recorded.
        self._group = worker_group

    def after_worker_group_training_start(self, worker_group) -> None:
        self._group = None  # started: from now on the controller owns it and shuts it down

    async def before_controller_shutdown(self) -> None:
        self._release("the last start")  # a run that ends on a failed start leaves nothing held

    def _release(self, which: str) -> None:
        group, self._group = self._group, None
        if group is None or not group.has_started():
            return
        log.warning("releasing the worker group of %s that failed to start (its placement group and workers)", which)
        try:
            group.shutdown()
        except Exception:  # the start's own error is what the run reports
            log.warning("could not shut down the worker group of a failed start", exc_info=True)


def install() -> None:
    """Have the next Ray Train ``fit()`` of this process run ``ReleaseFailedStart`` on its controller."""
    path = f"{__name__}.{ReleaseFailedStart.__name__}"
    current = [p.strip() for p in os.environ.get(ENV_VAR, "").split(",") if p.strip()]
    if path not in current:
        os.environ[ENV_VAR] = ",".join([path, *current])
