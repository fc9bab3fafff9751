"""The bound on every wait for the other workers (--stall-timeout-s).

A worker that froze (a stuck device, a partition, a SIGSTOP) leaves its peers
waiting in their next collective, which TensorFlow would wait on forever. The
watch bounds that wait: while this worker is inside a training step (whose
all-reduces run in the traced step) or a host sum, a thread of its own looks at
the clock, and once the wait passes the bound it aborts the collectives run
eagerly (as MultiWorkerMirroredStrategy's health check does) and cancels the
step's traced function (each step runs under a cancellation manager of its
own). The worker then raises ``StallWatch.error()``: the run ends in one line,
or Ray Train restarts its workers under --max-failures.

Not the collective ops' own timeout: each op with one starts a thread that sleeps
the whole timeout after the op is done (measured: 4 threads a step, +800 every
200 steps), so a run at a fast step's rate fails once the process can start no
more threads ("Resource temporarily unavailable"). The bound counts from the
step's start, so it includes the step's own compute (and its tracing, in the
first step of a fit): raise it for a step that takes minutes.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional


class StallWatch:
    """Aborts this process's collectives when a wait (a step, a host sum) lasts longer than ``timeout_s``."""

    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self._since: Optional[float] = None  # when the outermost wait began; None: not waiting
        self._depth = 0
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._step: Optional[tuple[Any, Callable[[], None]]] = None  # the step's cancellation scope, and its cancel
        self._closed = False
        self.aborted = False
        self.message = (f"this worker waited {self.timeout_s:g} s for a step or a sum that needs every worker: a peer "
                        "froze, was lost or was cut off")

    @contextmanager
    def waiting(self) -> Iterator[None]:
        self.begin()
        try:
            yield
        finally:
            self.end()

    def begin(self, step: bool = False) -> None:
        """A wait begins; ``step``: a training step, whose traced function is cancelled at a stall. Each step has a
        cancellation manager of its own: TensorFlow cancels a function's manager when the function fails, as a
        validation pass ends on an input of unknown size."""
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._since = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
                self._thread.start()
        if step:
            from app.internals import collectives

            scope, cancel = collectives.cancellable()
            scope.__enter__()
            self._step = (scope, cancel)

    def end(self, step: bool = False) -> None:
        if step and self._step is not None:
            self._step[0].__exit__(None, None, None)
            self._step = None
        with self._lock:
            self._depth = max(0, self._depth - 1)
            if self._depth == 0:
                self._since = None

    def end_open_step(self) -> None:
        """End the step begun and not ended, if any."""
        if self._step is not None:
            self.end(step=True)

    def close(self) -> None:
        """Training is over (or failed inside a step): nothing waits any more."""
        self.end_open_step()
        with self._lock:
            self._depth, self._since, self._closed = 0, None, True

    def error(self) -> Exception:
        """What the worker raises once the watch ended a wait: in the words app.ui.failures tells a stall by."""
        return RuntimeError(f"Collective ops is aborted by: {self.message}")

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while not self._closed:
            time.sleep(poll)
            with self._lock:
                since, step = self._since, self._step
            if since is not None and time.monotonic() - since > self.timeout_s:
                from app.internals import collectives

                self.aborted = True
                collectives.abort_eager(self.message)
                if step is not None:
                    step[1]()
                return
