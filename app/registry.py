"""Names -> functions: the built-in models and datasets, and the resolver for users' own.

A model or dataset is named one of three ways, everywhere (flag, YAML, Tune
space, Python API):

- a built-in name: ``mlp``, ``digits``, ...
- ``path/to/file.py:function``: the file is imported by path (it need not be
  on ``sys.path``); ray job submit's --working-dir ships it with the job;
- ``package.module:function``: imported from ``sys.path``;

or, from Python, the function itself. Datasets may also be a path or URI to
files (parquet, CSV, images, numpy), told apart by ``looks_like_path``.

This module is a leaf: it names the built-ins as strings and imports nothing
of the app, so config validation stays light; ``resolve`` imports on demand.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from app.errors import UserCodeError, UserError, words_of

MODELS = {
    "mlp": "app.models:build_mlp",
    "cnn": "app.models:build_cnn",
    "transformer": "app.models:build_transformer",
}
# What a built-in model trains with when the run does not say (--optimizer, --base-lr): the global defaults
# (SGD at 0.05) suit the cnn; the mlp (256, 128) learns the digits better at 0.1 (`python jobs/train.py --seed S`:
# val accuracy 0.9861 and 0.9721 for seeds 0 and 1, where (128, 64) at 0.05 reached 0.9777 and 0.9694); attention
# layers stay at chance under them (val accuracy 0.11 after 6 epochs of synthetic-text), and Adam at 1e-3, the
# usual transformer setting, learns it in one epoch.
MODEL_OPTIMIZERS: dict[str, dict[str, Any]] = {
    "mlp": {"optimizer": "sgd", "base_lr": 0.1},
    "transformer": {"optimizer": "adam", "base_lr": 1e-3},
}
DATASETS = {
    "digits": "app.data.builtin:digits",
    "synthetic": "app.data.builtin:synthetic",
    "synthetic-text": "app.data.builtin:synthetic_text",
}

IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "bmp", "gif", "tif", "tiff")
FILE_EXTENSIONS = {"parquet": "parquet", "csv": "csv", "tfrecord": "tfrecord", "tfrecords": "tfrecord", "npz": "numpy",
                   "npy": "numpy"}
FILE_EXTENSIONS.update({ext: "images" for ext in IMAGE_EXTENSIONS})

# "file.py:function" or "package.module:function" (a Windows drive "C:\..." is not one).
_PLUGIN = re.compile(r"^(?P<where>[^:]+\.py|[A-Za-z_][\w.]*):(?P<name>[A-Za-z_]\w*)$")


def is_plugin(value: str) -> bool:
    return bool(_PLUGIN.match(value))


def looks_like_path(name: str) -> bool:
    """A --dataset value that names files rather than a built-in dataset (existence is checked later)."""
    if is_plugin(name):
        return False
    # A path that exists is a path, whatever it looks like (./data); a built-in name stays the built-in.
    exists = name not in DATASETS and os.path.exists(os.path.expanduser(name))
    return exists or "://" in name or "/" in name or os.sep in name or name.rsplit(".", 1)[-1].lower() in FILE_EXTENSIONS


def is_dataset_name(value: str) -> bool:
    return value in DATASETS or is_plugin(value) or looks_like_path(value)


def is_model_name(value: str) -> bool:
    return value in MODELS or is_plugin(value)


def describe(fn: Callable[..., Any] | list) -> str:
    """How a function given from Python is recorded: module:qualname (a list of callbacks: their classes)."""
    if isinstance(fn, list):
        return f"__main__:[{', '.join(type(c).__name__ for c in fn)}]"
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def callbacks_problem(value: Any) -> str | None:
    """Why a callbacks value is refused, or None. A list given from Python and recorded in a config file
    (``__main__:[EarlyStopping]``) passes here: only a run that uses it is refused (``recorded_callbacks``)."""
    if isinstance(value, str) and not is_plugin(value) and not value.startswith("__main__:["):
        return (f"callbacks {value!r}: give file.py:function or package.module:function, a function that returns a "
                "list of keras.callbacks.Callback")
    # Told by class name, so that checking a config does not import Keras.
    bad = [c for c in value if not any(k.__name__ == "Callback" and k.__module__.startswith("keras")
                                       for k in type(c).__mro__)] if isinstance(value, list) else []
    if bad:
        return f"callbacks holds {str(bad[0])[:60]!r} of type {type(bad[0]).__name__}, not a keras.callbacks.Callback"
    return None


def recorded_callbacks(value: str) -> str:
    """Why a run of a config file whose callbacks were a list passed from Python is refused."""
    return (f"callbacks {value[len('__main__:'):]} were a list passed from Python, which a config file cannot "
            "hold: pass them again (app.train(callbacks=[...])) or name a function, --callbacks file.py:function")


def reloadable(value: str | Callable[..., Any]) -> bool:
    """Whether a config file can name this model or dataset: a name or path, or a module-level function
    of an importable module (not a script's or a notebook's ``__main__``, nor a nested function or lambda)."""
    if isinstance(value, str):
        return not value.startswith("__main__:")
    return getattr(value, "__module__", "__main__") != "__main__" and bool(_PLUGIN.match(describe(value)))


def resolve(value: str | Callable[..., Any], builtins: dict[str, str]) -> Callable[..., Any]:
    """A callable for a built-in name, a plug-in spec, or a callable (returned as it is)."""
    if callable(value):
        return value
    spec = builtins.get(value, value)
    match = _PLUGIN.match(spec)
    if not match:
        raise UserError(f"{value!r} is neither a built-in name ({', '.join(sorted(builtins))}) nor file.py:function")
    where, name = match["where"], match["name"]
    if where == "__main__":
        raise UserError(f"{value} was a function passed from Python (a script or notebook), recorded by name: pass "
                        "it again (app.train(model=..., data=...)) or name it file.py:function")
    if where.endswith(".py"):
        module = _import_file(where, value)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise UserError(f"{value}: cannot import module {where!r} ({e})") from None
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UserError(f"{value}: {where} has no function {name!r} (it has {', '.join(found) or 'none'})")
    if not callable(fn):
        raise UserError(f"{value}: {name!r} in {where} is a {type(fn).__name__}, not a function")
    return fn


def _import_file(path: str, value: str):
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{value}: file {path!r} does not exist (paths are relative to {os.getcwd()})")
    module_name = f"_user_{file.stem}"
    if module_name in sys.modules and getattr(sys.modules[module_name], "__file__", None) == str(file.resolve()):
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file.resolve())
    module = importlib.util.module_from_spec(spec)
    # The file's own folder first, so that it can import its neighbours.
    sys.path.insert(0, str(file.resolve().parent))
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise UserCodeError(f"{value}: importing {path} raised {type(e).__name__}: {words_of(e)}", e) from e
    return module


def call_with_declared(fn: Callable[..., Any], available: dict[str, Any], what: str,
                       required: tuple[str, ...] = ()) -> Any:
    """Call ``fn`` with the entries of ``available`` that it declares (all of them if it takes ``**kwargs``).

    A function is never handed an argument it did not ask for, so a user's
    ``build_model(input_shape)`` and a built-in with ten options are called the
    same way; the ``required`` entries (what the user asked for by name, e.g.
    --model-args) must be taken. Whatever it raises is reported in one line.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = dict(available)
    else:
        kwargs = {k: v for k, v in available.items() if k in params}
    refused = [k for k in required if k not in kwargs]
    if refused:
        takes = [n for n in params if n not in ("self",)]
        raise UserError(f"{what} does not take argument(s) {', '.join(refused)} (it takes {', '.join(takes)}): "
                        "leave them out")
    missing = [
        n for n, p in params.items()
        if p.default is inspect.Parameter.empty and n not in kwargs
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    if missing:
        raise UserError(
            f"{what} needs argument(s) {', '.join(missing)} that nothing provides (it can take "
            f"{', '.join(sorted(available))}; add the rest to --model-args)"
        )
    try:
        return fn(**kwargs)
    except UserError:
        raise
    except Exception as e:
        raise UserCodeError(f"{what} raised {type(e).__name__}: {words_of(e)}", e) from e
