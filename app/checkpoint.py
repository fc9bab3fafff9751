"""What a checkpoint holds and how it is written.

A checkpoint directory holds ``model.keras`` (architecture + weights, openable
by ``keras.models.load_model`` in any process) and ``state.json`` (epoch
counter and the history so far, so that the driver can read the full history
from the last checkpoint alone).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import keras

MODEL_FILE = "model.keras"
STATE_FILE = "state.json"


def save(directory: str | Path, model: "keras.Model", state: dict[str, Any]) -> None:
    directory = Path(directory)
    model.save(directory / MODEL_FILE)
    (directory / STATE_FILE).write_text(json.dumps(state, indent=1))


def load_state(directory: str | Path) -> dict[str, Any]:
    return json.loads((Path(directory) / STATE_FILE).read_text())
