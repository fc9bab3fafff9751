"""What app.fit returns: Keras's History of a run, read from the run's own record (result.json, history.csv)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Optional


class History:
    """What app.fit returns: Keras's History (``history``, ``epoch``, ``params``, ``model``) for a run.

    ``history``: the epoch record's losses and metrics keyed as Keras's History (``loss``, ``accuracy``,
    ``val_loss``, ``val_accuracy``, ...; one value per epoch). ``records``: the whole per-epoch records, as
    history.csv holds them (samples, seconds, learning rate). ``result``: result.json's content.
    ``model``: the trained ``model.keras``, loaded on first use.
    """

    def __init__(self, result: dict[str, Any], records: list[dict[str, Any]], model_file: Path, verbose: Any = "auto"):
        self.result = result
        self.records = records
        self.history = keras_history(records)
        self.epoch = [int(r["epoch"]) - 1 for r in records]  # Keras counts epochs from 0
        self.params = {"verbose": verbose, "epochs": result["config"]["epochs"], "steps": result["steps_per_epoch"]}
        self.model_file = model_file
        self._model = None

    @classmethod
    def of_keras_run(cls, result: dict[str, Any], out: Path, epochs: int, model: Any = None,
                     verbose: Any = "auto") -> "History":
        """A run by Keras's fit (result.json's content): its epoch logs as Keras's History has them (a key's list has
        the epochs that logged it: validation_freq); ``model`` the trained model (or its file, loaded on use);
        ``params`` as Keras's (``verbose`` as fit was given it)."""
        self = cls.__new__(cls)
        from app.training.keras_callbacks import RECORD_KEYS

        self.result, self.records, self.history = result, result["history"], {}
        for record in self.records:
            for k, v in record.items():
                if k not in RECORD_KEYS:
                    self.history.setdefault(k, []).append(v)
        self.epoch = [int(r["epoch"]) - 1 for r in self.records]
        self.params = {"verbose": verbose, "epochs": epochs, "steps": result["steps_per_epoch"]}
        self.model_file = out / result.get("model_file", result["checkpoint"])
        self._model = model
        return self

    @property
    def model(self):
        if self._model is None:
            from app.training import model_file

            self._model = model_file.load(self.model_file, compile=True)
        return self._model

    def __repr__(self) -> str:
        return f"History({len(self.epoch)} epochs, keys {list(self.history)}, output {self.model_file.parent})"


def keras_history(rows: list[dict[str, Any]]) -> dict[str, list[Optional[float]]]:
    """history.csv's rows of an own-loop run (app.training.metrics.history_row: its logs under Keras's names) ->
    Keras's History: each loss and metric, training ones first, then validation, as Keras orders its logs. A value
    an epoch's row lacks is None."""
    from app.training.objective import metric_names_in

    names = list(dict.fromkeys(n for r in rows for n in metric_names_in(r)))
    keys = [k for k in (*names, *(f"val_{n}" for n in names)) if any(k in r for r in rows)]
    return {k: [None if r.get(k) in (None, "") else float(r[k]) for r in rows] for k in keys}


def read_records(path: Path) -> list[dict[str, Any]]:
    """history.csv's rows, numbers as numbers."""
    with path.open(newline="") as f:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _number(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
