"""An error raised while Keras's fit ran the model's own code (its ``train_step``, ``test_step``, ``call``, ...),
told in one line that names that code, the error and, where the error says it, the file and line.

Keras's fit runs a model's steps as a traced graph. An error of the user's Python when it is traced comes back as
autograph's "in user code:" message, and an error of its ops when they run as TensorFlow's "Graph execution error"
(its "defined at" frames, when TensorFlow kept them). Either way the first line a user sees names no code of
theirs; this one does, and keeps the whole traceback (which the run writes to its train.log).
"""

from __future__ import annotations

import contextlib
import re
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from app.errors import FRAME, UserCodeError, UserError, users_file, words_of

# What a model may bring of its own, in the order that names it when the error does not say which one ran.
METHODS = ("train_step", "test_step", "compute_loss", "compute_metrics", "call")
# Keras's framing of an error a layer's call raised names the layer.
_LAYER = re.compile(r"Exception encountered when calling (\w+)\.call\(\)")


@contextlib.contextmanager
def named(model: Any, first: Callable[[BaseException], Optional[Exception]] = lambda e: None) -> Iterator[None]:
    """Run the block; an error it raises that ``first`` names (a callback's), or else the model's own code, becomes
    that one line (the product's own one-line errors pass as they are)."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        line = first(e) or raised_by_model(e, model)
        if line is None:
            raise
        raise line from None


def raised_by_model(error: BaseException, model: Any) -> Optional[UserCodeError]:
    """The one line for ``error`` if the model's own code raised it (None: nothing says so, the error stays as it
    is): a frame of the user's own files in the error, or a graph error of a model with steps or a call of its
    own."""
    import tensorflow as tf

    cls = type(model).__name__
    own = own_methods(model)
    frames = _users_frames(error)
    if frames:
        file, line, fn = frames[-1]
        layer = _LAYER.search(str(error))
        code = f"{layer.group(1)}.call" if layer and fn == "call" else f"{cls}.{fn}" if fn in METHODS else fn
        where = f" ({Path(file).name} line {line})"
    elif isinstance(error, tf.errors.OpError) and own:
        code = f"{cls}.{own[0]}" + (f" (or its {', '.join(own[1:])})" if own[1:] else "")
        where = ""
    else:
        return None
    return UserCodeError(f"{code} raised {type(error).__name__}: {words_of(error)}{where}", error)


def own_methods(model: Any) -> list[str]:
    """The METHODS ``model``'s class defines itself (not Keras's), in METHODS' order."""
    def defined_by_user(method: str) -> bool:
        owner = next((c for c in type(model).__mro__ if method in vars(c)), None)
        return owner is not None and not owner.__module__.startswith(("keras", "tensorflow"))

    return [m for m in METHODS if defined_by_user(m)]


def _users_frames(error: BaseException) -> list[tuple[str, int, str]]:
    """(file, line, function) of the user's own code: from the error's text (autograph's and TensorFlow's frames)
    and its Python traceback, outside Python's own library, the installed ones, this product, generated code and
    a script's top."""
    found = [(f, int(n), fn) for f, n, fn in FRAME.findall(str(error))]
    found += [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(error.__traceback__)]
    return [(f, n, fn) for f, n, fn in found if fn != "<module>" and users_file(f)]
