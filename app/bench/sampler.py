"""Peak memory of every process this one starts (Ray's daemons, workers and tasks), sampled with psutil.

Every ``interval`` seconds, for each descendant process (``children(recursive=True)``),
``memory_full_info()`` gives:

- ``rss``: every resident page, the pages of Ray's shared-memory object store
  that the process wrote or read included;
- ``rss - shared``: the process's own memory, exactly Linux's ``RssAnon``
  (``shared`` is ``RssFile + RssShmem``): what it allocated itself, without
  the store's pages it mapped or its code;
- ``uss``: the pages no other process maps (it counts a store page that only
  this process maps, hence the figure above is the one compared).

and, for the machine, ``virtual_memory().shared``: its ``Shmem`` (/dev/shm,
where the object store lives), above its level at the start: the store's
pages that blocks have touched, counted once however many processes map them.
Peaks are the largest values seen, so a spike shorter than the interval can
be missed (the kernel's own high-water mark, ``VmHWM``, is not in psutil).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

MIB = 2**20


@dataclass
class Peak:
    name: str  # the command line at the last new peak (Ray sets it to "ray::<actor or task>" for its workers)
    rss: float = 0.0  # MiB
    own: float = 0.0  # MiB: rss - shared = RssAnon
    uss: float = 0.0  # MiB


class ProcessPeaks:
    """``with ProcessPeaks() as peaks: ...``; then ``peaks.processes`` (pid -> Peak) and ``peaks.shmem_peak``."""

    def __init__(self, interval: float = 0.5):
        import psutil

        self.interval = interval
        self.processes: dict[int, Peak] = {}
        self.shmem_peak = 0.0  # MiB above the start
        self._me = psutil.Process()
        self._shmem_start = self._shmem()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ProcessPeaks":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _shmem() -> float:
        import psutil

        return psutil.virtual_memory().shared / MIB

    def sample(self) -> None:
        import psutil

        self.shmem_peak = max(self.shmem_peak, self._shmem() - self._shmem_start)
        for p in self._me.children(recursive=True):
            try:
                with p.oneshot():
                    mem = p.memory_full_info()
                    name = " ".join(p.cmdline()) or p.name()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            peak = self.processes.setdefault(p.pid, Peak(name))
            now = (mem.rss / MIB, (mem.rss - mem.shared) / MIB, mem.uss / MIB)
            if any(n > old for n, old in zip(now, (peak.rss, peak.own, peak.uss))):
                peak.name = name  # what the process was doing at its peak (a Ray worker changes its name)
                peak.rss, peak.own, peak.uss = (max(n, old) for n, old in zip(now, (peak.rss, peak.own, peak.uss)))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def largest(self, match, figure: str = "rss") -> float:
        """The largest peak ``figure`` (rss, own, uss) among the processes whose name ``match``es, in MiB."""
        return round(max((getattr(p, figure) for p in self.processes.values() if match(p.name)), default=0.0), 1)
