"""A ``.keras`` file, checked and loaded in one place: every job and API call that reads a trained model asks here.

Keras reports a truncated, empty or foreign file as "File not found: ... Please ensure the file is an accessible
`.keras` zip file" (a ValueError deep in its saving code); ``check`` says what is wrong in one line, from the
file's bytes alone, before any data is read or any Ray process starts.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any, Union

from app.errors import UserError

# The members every .keras archive holds (keras.src.saving.saving_lib writes them).
_MEMBERS = ("config.json", "metadata.json")


def check(path: Union[str, Path]) -> Path:
    """``path`` as a Path, if it is a readable .keras archive; else one line naming it and what it is instead."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"model file {str(path)!r} does not exist" + (" (it is a directory)" if path.is_dir() else ""))
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            broken = archive.testzip()  # a member whose bytes do not match its checksum: a truncated copy
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise UserError(f"model file {str(path)!r} is not a Keras model ({_why(e, path)}): give a model.keras "
                        "that a run or model.save() wrote") from None
    if broken is not None or not all(m in names for m in _MEMBERS):
        what = f"its member {broken!r} is corrupt" if broken else "a zip file without a Keras model's config.json"
        raise UserError(f"model file {str(path)!r} is not a Keras model ({what}): give a model.keras that a run or "
                        "model.save() wrote")
    return path


def load(path: Union[str, Path], compile: bool = False) -> Any:
    """The model in ``path`` (checked first); Keras's own refusal (a layer it does not know, say) as one line."""
    import keras

    import app.layers  # noqa: F401  (registers the custom layers a saved model may hold, for load_model)

    path = check(path)
    try:
        return keras.models.load_model(path, compile=compile)
    except (ValueError, TypeError, KeyError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load {str(path)!r} as a Keras model: {first}") from None


def _why(error: BaseException, path: Path) -> str:
    if path.stat().st_size == 0:
        return "the file is empty"
    if isinstance(error, zipfile.BadZipFile):
        return "not a zip archive, or a truncated one"
    return str(error).splitlines()[0] if str(error) else type(error).__name__
