"""A bad command line as one line: tyro's parse errors worded by their hook, or its box folded (app.cli); and how an
entry script ends (app.cli.main): a traceback kept in a file, Ray left before the exit."""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from app import internals
from app.errors import UserError

# --- one line per error ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def one_line_errors(argv: list[str], known: list[str]):
    """tyro reports a parse error as a multi-line box; its error hook lets us word it as one line instead.

    tyro's error events are marked experimental and not exported (app.internals reaches them; hence the
    exact pin); without them, collapse folds the box.
    """
    events = internals.tyro_error_events()
    if events is None:  # pragma: no cover - a tyro without the hook
        yield
        return

    def flag_of(argument: Any) -> str:
        flags = getattr(getattr(argument, "lowered", None), "name_or_flags", None) or ()
        return flags[0] if flags else "an option"

    def metavar_of(argument: Any) -> str:
        return getattr(getattr(argument, "lowered", None), "metavar", None) or "a value"

    def hook(event: Any) -> None:
        if isinstance(event, events.InvalidChoice):
            raise UserError(f"{flag_of(event.argument)}: invalid choice {event.value!r} "
                            f"(choose from {', '.join(event.choices)})")
        if isinstance(event, events.InstantiationFailure):
            if event.argument is None:
                raise UserError(event.message)
            flag = flag_of(event.argument)
            given = _values_after(argv, flag)
            raise UserError(f"{flag} expects {metavar_of(event.argument)}, got {given!r}" if given is not None
                            else f"{flag}: {event.message}")
        if isinstance(event, events.UnrecognizedArgs):
            options = [t for t in event.tokens if t.startswith("-")]  # the values after them are noise here
            words = []
            for token in options or event.tokens:
                close = difflib.get_close_matches(token.split("=", 1)[0], known, n=1, cutoff=0.7) if options else []
                words.append(f"{token} (did you mean {close[0]}?)" if close else token)
            what = "unknown option" if options else "unexpected argument"
            raise UserError(f"{what}{'s' if len(words) > 1 else ''} {', '.join(words)}; see --help")
        if isinstance(event, events.BadValue):
            raise UserError(f"{flag_of(event.argument)} expects {metavar_of(event.argument)}"
                            + (f", got {event.offending_value!r}" if event.offending_value else ""))
        if isinstance(event, events.MissingArgs):
            missing = [f"{flag_of(a.arg)} {metavar_of(a.arg)}" for a in event.missing_arguments]
            raise UserError(f"missing {', '.join(missing)} (required)")
        if isinstance(event, events.MissingMutexGroup):
            raise UserError("; ".join("give one of " + ", ".join(flag_of(a.arg) for a in group)
                                      for group in event.groups))
        if isinstance(event, events.MutexConflict):
            raise UserError(f"{event.first_token} and {event.second_token} exclude each other: give one")
        # Any other kind: tyro prints its box and exits 2; collapse makes it one line.

    with events.on_parse_error(hook):  # raising from the hook takes over tyro's error report
        yield


def _values_after(argv: list[str], flag: str) -> str | None:
    """What the user typed after ``flag`` (its last occurrence), for error messages."""
    for i in reversed(range(len(argv))):
        if argv[i].startswith(flag + "="):
            return argv[i].split("=", 1)[1]
        if argv[i] == flag:
            values = []
            for token in argv[i + 1:]:
                if token.startswith("--"):
                    break
                values.append(token)
            return " ".join(values)
    return None


_BOX = re.compile(r"[╭╮╰╯│─]+")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def collapse(text: str) -> str:
    """tyro's boxed error -> one line (the box's title and body; no usage, no help pointers)."""
    kept = []
    for raw in _ANSI.sub("", text).splitlines():
        line = _BOX.sub(" ", raw).strip()
        if line.startswith(("For full helptext", "Argument helptext", "usage:")):
            break
        if line:
            kept.append(line)
    return re.sub(r"\s+", " ", " ".join(kept)).strip() or "invalid command line (see --help)"


def guarded(parse: Callable[[], Any]) -> Any:
    """A bad command line is a user error: one line, exit 2 (as main() does for the run itself)."""
    try:
        return parse()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# --- an entry script's exit (app.cli.main) -----------------------------------------------------------------

def ray_joined() -> bool:
    """Whether this process is connected to a Ray (importing Ray to ask would cost a script without it seconds)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def leave_ray() -> None:
    """A script that connected to Ray and succeeded leaves it, then exits at once, status 0: Ray Data's executor
    threads can outlive a dataset's last read and call Ray's core worker after the exit-time ray.shutdown(), which
    Ray answers by exiting 1 (ray-project/ray#19115). Only for a Ray the script connected: one this process held
    before it (a script run inside another program) stays."""
    if ray_joined():
        ray = sys.modules["ray"]
        ray.shutdown()
        logging.shutdown()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)


parsed = {"show_logs": False}  # the parsed config's --show-logs (it may come from a --config file)


def kept(trace: str) -> str:
    """Keep the user's traceback where the one line says (no run directory exists yet); --show-logs prints it."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", prefix="ray-tf-train-error-", suffix=".txt", delete=False) as f:
        f.write(trace)
    if "--show-logs" in sys.argv[1:] or parsed["show_logs"]:
        print(trace, file=sys.stderr, end="")
    return f" (traceback in {f.name})"
