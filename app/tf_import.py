"""The first ``import tensorflow`` of a job script, without the C++ INFO lines TF_CPP_MIN_LOG_LEVEL cannot stop.

TensorFlow 2.21's libraries log through absl before absl's logging is
initialised, and absl then writes every message, INFO included, to stderr
(abseil-cpp PRs #1718 and #1957, not merged): "WARNING: All log messages before
absl::InitializeLog() is called are written to STDERR" and "I0000 ... port.cc:153]
oneDNN custom operations are on ...", twice per process, even with
TF_CPP_MIN_LOG_LEVEL=2. ``install()`` runs that first import with file
descriptor 2 captured and writes back everything else it caught.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import re
import sys
import tempfile

# absl's pre-initialisation notice, and its INFO lines ("I" + MMDD).
_ABSL_INFO = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\)|I\d{4} )")


def install() -> None:
    """Quiet the next first import of TensorFlow in this process (a no-op if it is imported already)."""
    if "tensorflow" not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "tensorflow":
            return None
        sys.meta_path.remove(self)  # once: the package's own imports go the usual way
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader)
        return spec


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):  # resource readers and the like: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as caught:
            os.dup2(caught.fileno(), 2)
            try:
                self._loader.exec_module(module)
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                caught.seek(0)
                lines = caught.read().decode(errors="replace").splitlines(keepends=True)
                kept = "".join(line for line in lines if not _ABSL_INFO.match(line))
                if kept:
                    sys.stderr.write(kept)
                    sys.stderr.flush()
