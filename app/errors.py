"""Errors that mean "the user asked for something we cannot do".

Entry scripts print these as one line and exit with status 2, without a
traceback: the message itself must name the problem and the fix.
"""

import re

# A traceback's frame line, as Python, autograph and TensorFlow write it.
FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')
# TensorFlow's framing of an error in a graph, and Keras's of one a layer's call raised (the layer named, then its
# arguments dumped after the words; the words in bold).
_NOISE = ("Graph execution error", "Detected at node", "<stack traces", "[[", "in user code",
          "Exception encountered when calling")
_ARGUMENTS = "Arguments received by"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# TensorFlow's name of the function an op failed in, before the words ("{{function_node __wrapped__LogicalAnd_device_
# /job:localhost/...}} Incompatible shapes: ..."), and the op's empty name after them ("[Op:LogicalAnd] name: ").
_TF_FRAMING = re.compile(r"\{\{function_node [^}]*\}\}\s*|(?<=\])\s+name:\s*$", re.M)


class UserError(Exception):
    """A problem with the user's input (flags, config file, data, cluster size)."""


class RunFailed(Exception):
    """A run that started and then failed (a lost worker beyond --max-failures, a non-finite loss, ...).

    Entry scripts print it as one line and exit with status 1.
    """


class NonFiniteLoss(Exception):
    """The training loss became NaN or infinite (a worker's; the driver tells it as a RunFailed line)."""


class UserCodeError(UserError):
    """The user's own code (a model or data function, their file's import) raised.

    The message is the one line; ``trace`` keeps the user's whole traceback, which
    the entry scripts write to a file the line names (and print with --show-logs).
    It crosses processes (a model function that raises in a Ray worker): pickled as
    the message and the trace.
    """

    def __init__(self, message: str, error: BaseException | None = None, trace: str = ""):
        import traceback

        super().__init__(message)
        self.trace = "".join(traceback.format_exception(error)) if error is not None else trace

    def __reduce__(self):
        return type(self), (str(self), None, self.trace)


def users_file(filename: str) -> bool:
    """Whether a traceback frame's file is the user's own code: not Python's library, an installed package, this
    product, or code generated at run time (autograph's, ``<string>``)."""
    import sysconfig
    from pathlib import Path

    if "-packages" in filename or "__autograph_generated" in filename or filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    return not any(path.is_relative_to(d) for d in (Path(__file__).resolve().parent,
                                                     Path(sysconfig.get_paths()["stdlib"]).resolve()))


def words_of(error: BaseException) -> str:
    """The error's own words, in one line: the last line that is neither a frame, nor source, nor TensorFlow's or
    Keras's framing, without its type's name."""
    text = _TF_FRAMING.sub("", _ANSI.sub("", str(error))).split(_ARGUMENTS, 1)[0]
    lines = [line.strip() for line in text.splitlines()]
    kept = [line for line in lines if line and not FRAME.search(line) and not line.startswith(_NOISE)]
    text = kept[-1] if kept else type(error).__name__
    prefix = f"{type(error).__name__}: "
    return " ".join((text[len(prefix):] if text.startswith(prefix) else text).split())[:300]
