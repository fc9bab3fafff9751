"""The console a person reads: the plan, one line per epoch, the result; the chatter goes to <output>/train.log.

During a Ray run the driver's Ray forwards every worker's and actor's output to
the driver's console, each line prefixed by its process: Ray Train's per-report
dumps, Ray Data's plans, TensorFlow's notices, from every worker. ``routed``
sorts those lines while a run trains:

- lines a worker marked for people (``MARK``: the epoch lines, our warnings)
  are printed as they are, without Ray's prefix, once (in a sweep, whose
  console tells each trial's epochs itself, they go to the file with the rest);
- Ray's distributed progress bars (``ray.experimental.tqdm_ray``: ours, and Ray
  Data's with --show-logs) are drawn;
- everything else goes to the run's log file, and to the console as well with
  ``--show-logs``.

The messages the cluster publishes for this job (the raylet's warnings and
errors, printed by a thread of Ray's of their own) go to the file and to the
console, but for known noise (``_RAY_NOISE``).

The driver's own Python logging is split the same way: ``app`` lines and
errors on the console, everything in the file. A worker's full traceback is
written to the file too (``write_trace``); the console gets one line.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import re
import sys
import threading
from pathlib import Path
from typing import Iterator, Optional, Sequence

from app import internals
from app.ui.worker_lines import MARK

LOG_FILE = "train.log"
RAY_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune")  # they keep their own handlers
BAR_PREFIX = "epoch "  # our progress bars' descriptions start so (app.training.worker)

_EARLY_LINES = 20_000  # worker lines kept from before the run's log file exists (its checks), then written in

_trace_log = logging.getLogger("app.trace")  # full worker tracebacks: the file only
_trace_log.propagate = False
_said_log = logging.getLogger("app.said")  # what ``say`` printed, for the file (printed, not logged, on the console)
_said_log.propagate = False
_said_log.setLevel(logging.INFO)
_current: Optional[Path] = None


def write_trace(title: str, text: str) -> Optional[Path]:
    """Write a long error text (every worker's traceback) to the run's log file; returns the file, or None."""
    if _current is None:
        return None
    _trace_log.error("%s\n%s", title, text)
    return _current


def say(line: str) -> None:
    """A line for people on stdout (a sweep's console: app.ui.tune_console), and in the run's log file."""
    print(line, flush=True)
    _said_log.info("%s", line)


# Set by ``for_people`` for the duration of a run; "sticky": until the process ends (``for_this_process``).
# "marked": workers' marked lines go to the console (a training run) or, False, to the log file (a sweep).
# "silent": nothing but warnings and errors on the console (app.fit(verbose=0), as model.fit(verbose=0)).
# "no_bars": the epoch lines without a progress bar inside the epochs (app.fit(verbose=2), as model.fit(verbose=2)).
_people = {"active": False, "verbose": False, "sticky": False, "marked": True, "silent": False, "no_bars": False}


def bars() -> bool:
    """Whether rank 0 draws a progress bar inside long epochs: for a person at a terminal, unless told not to."""
    return sys.stderr.isatty() and not _people["silent"] and not _people["no_bars"]


def worker_progress_bar(total: int, desc: str) -> "_Flushed":
    """A bar for a Ray actor's epoch, drawn by the driver's console: ray.experimental.tqdm_ray."""
    from ray.experimental import tqdm_ray

    return _Flushed(tqdm_ray.tqdm(total=total, desc=desc, unit="step"))


class _Flushed:
    """A tqdm_ray bar whose updates leave this process at once: they are lines on stdout, which is a file here."""

    def __init__(self, bar):
        self.bar = bar

    def update(self, k: int) -> None:
        self.bar.update(k)
        sys.stdout.flush()

    def close(self) -> None:
        self.bar.close()
        sys.stdout.flush()


def for_this_process() -> None:
    """Job scripts: a run's console rules stay until the process ends.

    A failed run's last lines (a Ray Data task's traceback, say) reach the driver
    after the run has ended, while the script prints its one line and exits.
    """
    _people["sticky"] = True


class _ConsoleFilter(logging.Filter):
    """During a run, not verbose, a console handler shows our package's lines only (Ray Data logs its
    errors with whole tracebacks; the run turns them into one line of its own)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _people["silent"] and record.levelno < logging.WARNING:
            return False
        if not _people["active"] or _people["verbose"]:
            return True
        return record.name == "app" or record.name.startswith("app.") or record.levelno >= logging.CRITICAL


def quiet_now() -> None:
    """Apply the run's console rules to what exists now: call again once Ray (or Ray Data) has started.

    Ray Data makes its console handler when imported, and the driver's printer of
    worker output exists once Ray is initialised.
    """
    for handler in _console_handlers():
        if not any(isinstance(f, _ConsoleFilter) for f in handler.filters):
            handler.addFilter(_ConsoleFilter())
    if _people["active"]:
        _WorkerLines.install()


@contextlib.contextmanager
def silent() -> Iterator[None]:
    """Inside: the run's epoch lines and our other lines for people go to its log file only; warnings and errors
    still reach the console (app.fit(verbose=0): model.fit(verbose=0) prints nothing)."""
    with _set("silent"):
        yield


@contextlib.contextmanager
def no_bars() -> Iterator[None]:
    """Inside: one line per epoch and no progress bar (app.fit(verbose=2), as model.fit(verbose=2))."""
    with _set("no_bars"):
        yield


@contextlib.contextmanager
def _set(rule: str) -> Iterator[None]:
    before = _people[rule]
    _people[rule] = True
    try:
        yield
    finally:
        _people[rule] = before


@contextlib.contextmanager
def for_people(verbose: bool = False, marked: bool = True) -> Iterator[None]:
    """A whole run, its checks included: libraries' log lines stay off the console unless ``verbose``.

    ``marked=False``: the workers' lines marked for people go to the log file too (a sweep).
    """
    saved = dict(_people)
    if not saved["active"]:
        _WorkerLines.early.clear()  # lines of an earlier run's checks are not this run's
    _people.update(active=True, verbose=verbose, marked=marked)
    # From a Python script that configured no logging (app.fit, as model.fit is called), the root has no handler
    # and the epoch lines of a run in this process (the local backend) reached no one; the job scripts have one.
    own = None if _console_handlers(tensorflow=False) else logging.StreamHandler(sys.stderr)
    if own is not None:
        own.setFormatter(logging.Formatter("%(message)s"))
        logging.getLogger().addHandler(own)
    quiet_now()
    try:
        yield
    finally:
        if own is not None:
            logging.getLogger().removeHandler(own)
        if not _people["sticky"]:
            _people.update(saved)
            if not saved["active"]:
                _WorkerLines.uninstall()


@contextlib.contextmanager
def routed(log_file: Path, verbose: bool = False, marked: bool = True, plan: Sequence[str] = ()) -> Iterator[Path]:
    """Route the driver's logging and the Ray workers' output as the module docstring says, while inside.

    ``marked``: as for ``for_people``. ``plan``: the run's plan lines, written first into the file (the console
    had them already; from Python, as app.fit, which prints only the epochs, the file is where they are).
    """
    global _current
    file_handler = logging.FileHandler(log_file)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for line in plan:
        file_handler.handle(logging.makeLogRecord({"name": "app.plan", "levelno": logging.INFO,
                                                   "levelname": "INFO", "msg": line}))
    root = logging.getLogger()
    root_level = root.level
    root.setLevel(min(root_level, logging.INFO))  # the file gets every library's INFO lines
    for logger in (root, _trace_log, _said_log, *_own_handler_loggers()):
        logger.addHandler(file_handler)
    _current = log_file
    try:
        with for_people(verbose, marked):
            _WorkerLines.attach(file_handler)
            yield log_file
    finally:
        if not _people["sticky"]:  # a job script keeps its log to the end: a failed run's last lines come late
            _current = None
            _WorkerLines.detach()
            for logger in (root, _trace_log, _said_log, *_own_handler_loggers()):
                logger.removeHandler(file_handler)
            root.setLevel(root_level)
            file_handler.close()


def _own_handler_loggers() -> list[logging.Logger]:
    """Loggers that do not propagate to the root (Ray's), so that the file gets their lines too."""
    loggers = [logging.getLogger(name) for name in RAY_LOGGERS]
    return [logger for logger in loggers if not logger.propagate]


def _console_handlers(tensorflow: bool = True) -> list[logging.Handler]:
    """Handlers writing to the terminal: the root's (cli.main's basicConfig), those of Ray's own loggers and
    TensorFlow's (its logger has a stderr handler of its own, which prints a strategy's INFO lines, as "Reduce to
    ... then broadcast", whenever a run sets the root's level to INFO; ``tensorflow=False``: not those, which print
    no line of ours)."""
    handlers = []
    tf_logger = [logging.getLogger("tensorflow")] if tensorflow and "tensorflow" in logging.Logger.manager.loggerDict \
        else []
    for logger in (logging.getLogger(), *_own_handler_loggers(), *tf_logger):
        handlers += [h for h in logger.handlers
                     if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                     and getattr(h, "stream", None) in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)]
    return handlers


class _WorkerLines:
    """Takes the place of Ray's printer of worker output: one batch (Ray's log batch dict) at a time, sorted.

    Marked lines to the console, progress bars drawn, the rest to the run's log
    file (kept in memory until it exists) and, with --show-logs, to Ray's printer.
    Ray's own events (the autoscaler's "cannot be scheduled", the raylet's) go to
    Ray's printer as well: they are what a user waiting on a full cluster needs.
    """

    file: Optional[logging.FileHandler] = None
    early: "collections.deque[str]" = collections.deque(maxlen=_EARLY_LINES)
    lock = threading.Lock()

    def __init__(self, ray_printer):
        self.ray_printer = ray_printer

    @classmethod
    def install(cls) -> None:
        internals.swap_worker_line_printer(lambda printer: cls(printer) if not isinstance(printer, cls) else printer)
        internals.swap_ray_message_printer(lambda printer: printer if isinstance(printer, _RayMessages)
                                           else _RayMessages(printer))

    @classmethod
    def uninstall(cls) -> None:
        internals.swap_worker_line_printer(lambda printer: printer.ray_printer if isinstance(printer, cls) else printer)
        internals.swap_ray_message_printer(lambda printer: printer.ray_printer if isinstance(printer, _RayMessages)
                                           else printer)

    @classmethod
    def attach(cls, file_handler: logging.FileHandler) -> None:
        with cls.lock:
            cls.file = file_handler
            cls._write(list(cls.early))
            cls.early.clear()

    @classmethod
    def detach(cls) -> None:
        with cls.lock:
            cls.file = None

    @classmethod
    def _write(cls, lines: list[str]) -> None:
        file = cls.file
        if file is None:
            cls.early.extend(lines)
            return
        with file.lock:  # the driver's own records are written to it from other threads
            if file.stream is not None:
                file.stream.write("".join(f"{line}\n" for line in lines))
                file.stream.flush()

    def __call__(self, data: dict) -> None:
        # This runs on Ray's log thread, which ends on an unexpected exception (and
        # with it every worker line for the rest of the process): never raise.
        try:
            self._sort(data)
        except Exception:
            self.ray_printer(data)

    def _sort(self, data: dict) -> None:
        from ray.experimental import tqdm_ray
        from ray.experimental.tqdm_ray import RAY_TQDM_MAGIC

        lines = data.get("lines", [])
        if data.get("pid") in ("autoscaler", "raylet"):
            self.ray_printer(data)  # Ray filters these down to its events itself
        if data.get("pid") == "autoscaler":  # the log file keeps its events, not its routine report
            lines = [] if any(AUTOSCALER_REPORT in line for line in lines) \
                else [line for line in lines if not AUTOSCALER_ROUTINE.search(line)]
        people = [line[len(MARK):] for line in lines if line.startswith(MARK)]
        bars = [line for line in lines if RAY_TQDM_MAGIC in line]
        rest = [line for line in lines if not line.startswith(MARK) and RAY_TQDM_MAGIC not in line]
        if not _people["marked"] or _people["silent"]:  # a sweep (its console tells the trials' epochs), verbose=0
            people, rest = [], people + rest
        bar_manager = tqdm_ray.instance()
        if people:
            out = sys.stderr if data.get("is_err") else sys.stdout
            bar_manager.hide_bars()  # a line printed over a bar would be redrawn over
            print("\n".join(people), file=out, flush=True)
            bar_manager.unhide_bars()
        for line in bars:
            # Drawn here, not by Ray's printer: its de-duplication holds back lines that
            # differ only in numbers, which is every update of a bar.
            state = json.loads(line)
            if str(state.get("desc", "")).startswith(BAR_PREFIX):
                # Our one bar, as if drawn by this process: no "(pid=...)" before it.
                state.update(ip=bar_manager.ip, pid=bar_manager.pid)
            bar_manager.process_state_update(state)
        if rest:
            who = data.get("actor_name") or data.get("task_name")
            prefix = f"({who + ' ' if who else ''}pid={data.get('pid')}, ip={data.get('ip')}) "
            with _WorkerLines.lock:
                _WorkerLines._write([prefix + line for line in rest])
            if _people["verbose"] and data.get("pid") not in ("autoscaler", "raylet"):
                self.ray_printer({**data, "lines": rest})


# The autoscaler's cluster report, every 5 s (nodes, resources, demands: `ray status` shows it on demand), and its
# monitor's timings around it: a long run's log would be mostly these.
AUTOSCALER_REPORT = "======== Autoscaler status:"
AUTOSCALER_ROUTINE = re.compile(r"\bINFO autoscaler\.py:\d+ -- ")


# Ray's messages that go to the log file only: the raylet's warning that many worker processes are starting
# (a sweep starts a trial process, a Train controller and the workers of each trial, by design, at once).
_RAY_NOISE = ("PYTHON worker processes have been started",)


class _RayMessages:
    """Takes the place of Ray's printer of the messages the cluster publishes for this job (the raylet's warnings
    and errors: a worker killed for memory, say): each to the log file, and to the console (Ray's printer) unless it
    is ``_RAY_NOISE`` and not --show-logs."""

    def __init__(self, ray_printer):
        self.ray_printer = ray_printer

    def __call__(self, data: dict, ignore_prefix: bool = False) -> None:
        try:  # on Ray's thread of error messages: never raise
            lines = data.get("lines", [])
            with _WorkerLines.lock:
                _WorkerLines._write([f"({data.get('pid')}) {line}" for line in lines])
            if _people["verbose"] or not any(noise in line for noise in _RAY_NOISE for line in lines):
                self.ray_printer(data, ignore_prefix)
        except Exception:
            self.ray_printer(data, ignore_prefix)
