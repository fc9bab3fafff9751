"""The output guard: whether a job may write a directory, and the two files it leaves in every one it writes.

Every job that writes a directory (train, tune, predict, benchmark) asks ``check`` before any work and is refused in
one line when the directory is or contains the working directory, the home directory, a filesystem root, this
product's repository or a git work tree, or anything the job reads (its dataset, validation set, run, model file,
checkpoint, plug-in files; a dataset's directory also may not hold it); or when another job is writing it.
``--overwrite`` replaces only a directory this product wrote for the same kind of job: each one holds ``MARKER``
(its kind, and once a job has ended, the names its jobs wrote there); one that holds anything else (a file the user
added) is refused, naming it. ``take`` is called once the job's own checks have passed: only then is a replaced
directory deleted.

"Another job is writing it": ``take`` holds an exclusive ``flock`` on ``LOCK`` in the directory until ``release``
or the process's end (the kernel drops it with the process, so a killed job leaves no stale lock behind);
``check`` tries the same lock without waiting. The lock file says who holds it, for the refusal's line.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from app import registry
from app.errors import UserError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows has no flock: a job there cannot see another one writing
    fcntl = None

MARKER = ".ray-tf-train"  # {"kind": ...}: this product wrote the directory, for that kind of job
LOCK = ".ray-tf-train.lock"  # flock-ed by the job writing the directory; says which job that is
KINDS = ("train", "tune", "predict", "benchmark")
_WHAT = {"train": "a training run", "tune": "a sweep", "predict": "predictions", "benchmark": "benchmark results"}

_held: dict[Path, int] = {}  # directories this process is writing -> the descriptor holding their lock
_found: dict[Path, set[str]] = {}  # ... -> the names in it when this process took it (not its own)


def default_output(kind: str) -> str:
    """Where a job writes when not told (app.config.new_output)."""
    from app.config import new_output

    return new_output(kind)


# What a job reads, by the flag that names it; a dataset's directory may not hold an output either.
# A key without dashes names a thing reached through several flags (a model: --model, --run, --checkpoint).
_NOUNS = {"--dataset": "the dataset", "--val-dataset": "the validation set", "--model": "the model function's file",
          "--callbacks": "the callbacks' file", "--space": "the search space", "model": "the model",
          "checkpoint": "the checkpoint"}
_DATA = ("--dataset", "--val-dataset")


def reads_of(inputs: Mapping[str, Any]) -> dict[str, Path]:
    """{flag: local path} of what a job reads, from the flags' values: paths, URIs, names, ``file.py:function``
    (its file) or functions (nothing to guard)."""
    found = {}
    for flag, value in inputs.items():
        if isinstance(value, str) and registry.is_plugin(value):
            value = value.split(":", 1)[0] if value.split(":", 1)[0].endswith(".py") else None
        if isinstance(value, Path) or (isinstance(value, str) and value and "://" not in value):
            path = Path(value).expanduser()
            if path.exists():
                found[flag] = path.resolve()
    return found


def check(out: Path, kind: str, reads: Mapping[str, Path] = {}, *, overwrite: bool = False, resume: bool = False,
          reuse: bool = False) -> None:
    """Refuse, in one line, a directory this job may not write (see the module docstring). ``resume``: the job
    continues what is there; ``reuse``: an earlier output of the same kind is added to (a benchmark's)."""
    out = Path(out).expanduser().resolve()
    if (problem := dangerous(out, kind, reads)) is not None:
        raise UserError(problem)
    if (writer := _writer(out)) is not None:
        raise UserError(f"another job is writing {str(out)!r} ({writer}): wait for it to end, or give another "
                        f"--output, e.g. --output {default_output(kind)}")
    if not out.exists() or resume:
        return
    if not out.is_dir():
        raise UserError(f"output {str(out)!r} is a file, not a directory: give another --output, e.g. "
                        f"--output {default_output(kind)}")
    if not any(p.name != LOCK for p in out.iterdir()):
        return
    written = kind_of(out)
    if reuse and written == kind:
        return
    if not overwrite and not reuse:
        # A run's directory (an interrupted one, say) can also be gone on with.
        go_on = ", --resume to go on with it (from its last checkpoint)," if kind == "train" == written else ""
        raise UserError(f"output {str(out)!r} already exists: choose another --output (e.g. --output "
                        f"{default_output(kind)})" + (f"{go_on} or --overwrite to replace it" if written == kind else ""))
    if written is None:
        raise UserError(f"output {str(out)!r} was not written by this product (it has no {MARKER} file): "
                        f"{'--overwrite replaces' if overwrite else 'a job adds to'} only a directory it wrote; give "
                        f"another --output, e.g. --output {default_output(kind)}")
    if written != kind:
        raise UserError(f"output {str(out)!r} holds {_WHAT.get(written, written)}, not {_WHAT[kind]}: give another "
                        f"--output, e.g. --output {default_output(kind)}")
    if overwrite and (foreign := _not_written(out)):
        raise UserError(f"output {str(out)!r} holds {', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}, "
                        "which this product did not write and --overwrite would delete: move them out, or give "
                        f"another --output, e.g. --output {default_output(kind)}")


def _not_written(out: Path) -> list[str]:
    """The names in ``out`` that no job of this product wrote there (its marker lists what they wrote; a job that
    never ended has no list: nothing is known against it)."""
    try:
        wrote = json.loads((out / MARKER).read_text()).get("wrote")
    except (OSError, ValueError, AttributeError):
        return []
    if wrote is None:
        return []
    return sorted(p.name for p in out.iterdir() if p.name not in {*wrote, MARKER, LOCK})


def note_written(path: Path) -> None:
    """``path``, a file a job wrote into a directory of another job's (evaluate's eval.json beside a run's model),
    listed with what the product wrote there, so that --overwrite of that directory may replace it."""
    path = Path(path).expanduser().resolve()
    try:
        marker = json.loads((path.parent / MARKER).read_text())
    except (OSError, ValueError):
        return
    if isinstance(marker, dict) and isinstance(marker.get("wrote"), list) and path.name not in marker["wrote"]:
        marker["wrote"] = sorted([*marker["wrote"], path.name])
        (path.parent / MARKER).write_text(json.dumps(marker) + "\n")


def check_not_being_written(directory: Path) -> None:
    """Refuse to write a file into a directory that another job is writing (evaluate's eval.json beside a model)."""
    directory = Path(directory).expanduser().resolve()
    if (writer := _writer(directory)) is not None:
        raise UserError(f"another job is writing {str(directory)!r} ({writer}): wait for it to end")


def dangerous(out: Path, kind: str, reads: Mapping[str, Path] = {}) -> Optional[str]:
    """Why ``out`` may never be an output (whatever --overwrite says), or None."""
    fix = f"give a directory of its own, e.g. --output {default_output(kind)}"

    def holds(place: Path) -> str:
        return "is" if out == place else "contains"

    cwd = Path.cwd().resolve()
    if out == Path(out.anchor):
        return f"--output {str(out)!r} is a filesystem root: {fix}"
    if out == cwd or out in cwd.parents:
        return f"--output {str(out)!r} {holds(cwd)} the working directory, which holds your files: {fix}"
    home = Path.home().resolve()
    if out == home or out in home.parents:
        return f"--output {str(out)!r} {holds(home)} your home directory: {fix}"
    repo = _repository()
    if repo is not None and (out == repo or out in repo.parents):
        return f"--output {str(out)!r} {holds(repo)} this product's repository: {fix}"
    if (out / ".git").exists():
        return f"--output {str(out)!r} is a git work tree (it has .git): {fix}"
    for flag, path in reads.items():
        what = f"{_NOUNS.get(flag, 'the input')} {str(path)!r}" + (f" ({flag})" if flag.startswith("--") else "")
        if out == path or out in path.parents:
            return f"--output {str(out)!r} {holds(path)} {what}, which this job reads: {fix}"
        if flag in _DATA and path.is_dir() and path in out.parents:
            return f"--output {str(out)!r} is inside {what}: its files would be read as data; {fix}"
    return None


def kind_of(out: Path) -> Optional[str]:
    """The kind of job that wrote ``out`` (its marker), or None: not this product's."""
    try:
        kind = json.loads((out / MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in KINDS else None


def take(out: Path, kind: str, *, replace: bool = False) -> Path:
    """Start writing ``out`` (after the job's checks): an earlier output of this kind deleted first when
    ``replace``; created; marked as ``kind``'s; locked until ``release`` or this process's end."""
    out = Path(out).expanduser().resolve()
    if replace and out.is_dir() and any(p.name != LOCK for p in out.iterdir()):
        # Asked again now, just before deleting: the checks ran a while ago.
        check(out, kind, overwrite=True)
        release(out)
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    _lock(out, kind)
    _found[out] = {p.name for p in out.iterdir()}
    if kind_of(out) is None:  # a resumed run keeps its marker; an empty directory given gets one
        (out / MARKER).write_text(json.dumps({"kind": kind}) + "\n")
    return out


def release(out: Path) -> None:
    """This process no longer writes ``out`` (another job may now replace it). Its marker lists what this
    product wrote there: what the job added, and what earlier jobs had (``--overwrite`` deletes nothing else)."""
    out = Path(out).expanduser().resolve()
    fd = _held.pop(out, None)
    if fd is None:
        return
    try:
        marker = json.loads((out / MARKER).read_text())
        found = _found.pop(out, set())
        # Without a list yet (a job that never ended wrote what was here), what was here counts as written.
        earlier = marker.get("wrote", found)
        marker["wrote"] = sorted({*earlier, *(p.name for p in out.iterdir() if p.name not in found)} - {MARKER, LOCK})
        (out / MARKER).write_text(json.dumps(marker) + "\n")
    except (OSError, ValueError, AttributeError):  # a marker gone or not ours: nothing listed
        pass
    finally:
        os.close(fd)  # closing the descriptor drops the flock


def _lock(out: Path, kind: str) -> None:
    if out in _held:
        return
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"another job is writing {str(out)!r} ({_writer(out) or 'it holds its lock'}): wait for it "
                        f"to end, or give another --output, e.g. --output {default_output(kind)}") from None
    who = {"pid": os.getpid(), "host": socket.gethostname(), "kind": kind, "command": " ".join(sys.argv)[:300],
           "since": f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S}"}
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(who) + "\n").encode())
    _held[out] = fd


def _writer(out: Path) -> Optional[str]:
    """Who is writing ``out`` (another process holds its lock), or None."""
    if fcntl is None or out in _held or not (out / LOCK).is_file():
        return None
    try:
        fd = os.open(out / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            who = json.loads((out / LOCK).read_text())
            return f"{who['kind']}, pid {who['pid']} on {who['host']} since {who['since']}: {who['command']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "it holds its lock"
    finally:
        os.close(fd)
    return None


def _repository() -> Optional[Path]:
    """The checkout this product runs from (None when it is installed as a package)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "app").is_dir() else None
