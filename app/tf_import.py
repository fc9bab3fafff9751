"""The first ``import tensorflow`` of a job script, without the C++ INFO lines TF_CPP_MIN_LOG_LEVEL cannot stop.

TensorFlow 2.21's libraries log through absl before absl's logging is
initialised, and absl then writes every message, INFO included, to stderr
(abseil-cpp PRs #1718 and #1957, not merged): "WARNING: All log messages before
absl::InitializeLog() is called are written to STDERR" and "I0000 ... port.cc:153]
oneDNN custom operations are on ...", twice per process, even with
TF_CPP_MIN_LOG_LEVEL=2. ``install()`` runs that first import with file
descriptor 2 going through a filter that passes everything else on.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import os
import re
import sys
import threading

# absl's pre-initialisation notice, and its INFO lines ("I" + MMDD).
_ABSL_INFO = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\)|I\d{4} )")


def install() -> None:
    """Quiet the first import of TensorFlow in this process (a no-op if it is imported already)."""
    if "tensorflow" not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``tensorflow`` with the other finders, and wraps its loader once."""

    done = False

    def find_spec(self, name, path, target=None):
        if name != "tensorflow" or self.done:
            return None
        for finder in sys.meta_path:  # the others, in their order (this list is being iterated: not edited)
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _QuietLoader(spec.loader, self)
                return spec
        return None


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader, finder: _Finder):
        self._loader, self._finder = loader, finder

    def __getattr__(self, name):  # resource readers and the like: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._finder.done = True
        with _without_absl_info():
            self._loader.exec_module(module)


@contextlib.contextmanager
def _without_absl_info():
    """File descriptor 2 into a pipe; a thread passes on every line but absl's INFO ones, as they come.

    As they come: if the process dies inside the import, what it said before is out.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        read_end, write_end = os.pipe()
    except OSError:
        os.close(saved)
        yield
        return
    relay = threading.Thread(target=_relay, args=(read_end, saved), daemon=True)
    relay.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer is gone: the relay reads to the end and stops
        relay.join(timeout=5)
        os.close(saved)


def _relay(read_end: int, out: int) -> None:
    with os.fdopen(read_end, "rb") as pipe:
        for line in pipe:
            if not _ABSL_INFO.match(line.decode(errors="replace")):
                os.write(out, line)
