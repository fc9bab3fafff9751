"""Errors that mean "the user asked for something we cannot do".

Entry scripts print these as one line and exit with status 2, without a
traceback: the message itself must name the problem and the fix.
"""


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
