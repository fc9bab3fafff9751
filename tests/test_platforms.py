"""What differs between the platforms the README lists, checked on this Linux machine.

The one platform-dependent figure of a run is each worker's peak memory (`worker_peak_rss_mib` in history.csv):
the kernel's ru_maxrss is KiB on Linux and bytes on macOS, and Windows has no `resource` module at all. No
Windows or macOS machine runs the tests: the other platforms' branches run here with that platform's answer
put in place of the kernel's.
"""

from __future__ import annotations

import sys
import types

from app.training import metrics


def test_the_peak_memory_is_the_kernels_high_water_mark_on_linux():
    peak = metrics.peak_rss_mib()
    with open("/proc/self/status") as status:  # VmHWM: the same peak, in kB
        hwm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    assert abs(peak - hwm_kib / 1024) < 64 and peak > 20, (peak, hwm_kib)


def test_the_peak_memory_is_in_mib_on_macos_whose_ru_maxrss_is_bytes(monkeypatch):
    usage = types.SimpleNamespace(ru_maxrss=512 * 2**20)  # what a Mac's getrusage says for 512 MiB
    fake = types.SimpleNamespace(RUSAGE_SELF=0, getrusage=lambda who: usage)
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setitem(sys.modules, "resource", fake)
    assert metrics.peak_rss_mib() == 512


def test_the_peak_memory_comes_from_psutil_on_windows_which_has_no_resource_module(monkeypatch):
    import psutil

    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setitem(sys.modules, "resource", None)  # `import resource` raises there, as on Windows
    info = types.SimpleNamespace(peak_wset=300 * 2**20)  # psutil's peak working set on Windows, in bytes
    monkeypatch.setattr(psutil, "Process", lambda: types.SimpleNamespace(memory_info=lambda: info))
    assert metrics.peak_rss_mib() == 300
