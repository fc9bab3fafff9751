"""The built-in datasets: small, shipped or generated, never downloaded.

Each is a plain function that takes the config fields it needs by name
(app.registry.call_with_declared) and returns (x, y) arrays, exactly what a
user's own data function returns.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 8x8 handwritten digits of UCI's "Optical Recognition of Handwritten Digits" (CC BY 4.0; the
    set scikit-learn ships as ``load_digits``), shipped in this package as ``digits.npz``: no download.

    x: 64 features per row, the 0-16 pixel counts scaled to [0, 1] (float32; a Dense model takes them as they
    are); y: the digit (int64). Their image shape travels with the data (IMAGE_SHAPES -> DataFacts.image_shape)
    for image models.
    """
    with np.load(Path(__file__).with_name("digits.npz")) as shipped:
        return (shipped["x"] / 16.0).astype(np.float32), shipped["y"].astype(np.int64)


# Built-in datasets whose rows are flattened images: the shape an image model (cnn) sees them in.
IMAGE_SHAPES = {"digits": (8, 8, 1)}


def synthetic(
    synthetic_rows: int, synthetic_shape: list[int], synthetic_classes: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded, learnable data of any shape: a per-class pattern under unit Gaussian noise.

    For benchmarks and tests: the size and shape are whatever the config says,
    and a model can still learn it (the pattern's amplitude is small enough
    that it takes a few epochs, not one step).
    """
    rng = np.random.default_rng(seed + 1)
    shape = tuple(synthetic_shape)
    patterns = rng.normal(size=(synthetic_classes, *shape)).astype(np.float32)
    y = rng.integers(0, synthetic_classes, size=synthetic_rows, dtype=np.int64)
    x = rng.normal(size=(synthetic_rows, *shape)).astype(np.float32)
    x += 0.5 * patterns[y]
    return x, y


def synthetic_text(
    synthetic_text_rows: int, synthetic_classes: int, seed: int, vocab_size: int, sequence_length: int
) -> tuple[np.ndarray, np.ndarray]:
    """Generated labelled texts (app.data.text), tokenized: the built-in text dataset for the transformer."""
    from app.data import text

    texts, y = text.synthetic_corpus(synthetic_text_rows, synthetic_classes, seed)
    return text.tokenize(texts, vocab_size, sequence_length), y
