"""One encoded image (PNG, JPEG, ...) -> pixels, decoded as Ray Data's ``read_images`` decodes an image file.

Pillow opens the bytes, resizes to the wanted size (bilinear) when it differs, then converts the colour
mode: the order ``read_images`` uses, so an image folder read by Ray Data, the same folder read in the
process (--backend local), and the same images stored as bytes in TFRecord or parquet give the same pixels.
"""

from __future__ import annotations

import io

import numpy as np


def decode(data: bytes, height: int, width: int, mode: str) -> np.ndarray:
    """(height, width, 3) uint8 for mode "RGB", (height, width) for "L"; OSError if Pillow cannot decode it."""
    from PIL import Image

    image = Image.open(io.BytesIO(data))  # UnidentifiedImageError is an OSError
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.BILINEAR)
    if image.mode != mode:
        image = image.convert(mode)
    return np.asarray(image)


def mode_of(shape: tuple[int, ...]) -> str:
    """The Pillow mode of a stored image shape: (h, w, 3) is RGB, (h, w) grayscale (--image-channels)."""
    return "RGB" if len(shape) == 3 else "L"
