"""Locating a dataset's files: local paths and URIs (s3://, gs://) through pyarrow's filesystems, and their format."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from app.errors import UserError
from app.registry import FILE_EXTENSIONS

if TYPE_CHECKING:
    from app.config import TrainConfig


@dataclass(frozen=True)
class Located:
    uri: str
    format: str  # parquet, csv, tfrecord, images, numpy; "ray-dataset": a data function's ray.data.Dataset
    filesystem: Any  # pyarrow.fs.FileSystem
    root: str  # path inside the filesystem
    files: tuple[str, ...]
    dataset: Any = None  # the ray.data.Dataset itself (format "ray-dataset")


def locate(uri: str, data_format: str = "auto") -> Located:
    """List the files behind a path or URI and tell their format (from the extensions unless given)."""
    import pyarrow.fs as pafs

    if "://" in uri:
        try:
            fs, root = pafs.FileSystem.from_uri(uri)
        except Exception as e:  # pyarrow's errors say what is wrong (scheme, credentials, bucket)
            raise UserError(f"cannot open dataset {uri!r}: {e}") from None
    else:
        fs, root = pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise UserError(f"dataset {uri!r} does not exist")
    if info.type == pafs.FileType.File:
        files = [root]
    else:
        listing = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        # Hidden and underscore files are writers' markers (_SUCCESS, .crc), not data.
        files = sorted(
            f.path for f in listing
            if f.type == pafs.FileType.File and not os.path.basename(f.path).startswith((".", "_"))
        )
    formats = {FILE_EXTENSIONS.get(f.rsplit(".", 1)[-1].lower()) for f in files} - {None}
    if data_format == "auto":
        if not files:
            raise UserError(f"dataset {uri!r} is empty: no files found")
        if len(formats) != 1:
            found = ", ".join(sorted(formats)) or "none of parquet, csv, tfrecord, npz, npy or images"
            raise UserError(
                f"cannot tell the format of dataset {uri!r}: its file extensions say {found}; "
                "set --data-format"
            )
        data_format = formats.pop()
    # TFRecord files are often named without an extension (train-00000-of-00064): with --data-format
    # tfrecord, every file that no other format claims is one.
    unclaimed = (None,) if data_format == "tfrecord" else ()
    wanted = [f for f in files if FILE_EXTENSIONS.get(f.rsplit(".", 1)[-1].lower()) in (data_format, *unclaimed)]
    if not wanted:
        raise UserError(f"dataset {uri!r} is empty: no {data_format} files found")
    return Located(uri, data_format, fs, root, tuple(wanted))


def given_dataset(name: str, dataset: Any) -> Located:
    """A ray.data.Dataset returned by a data function: streamed like a parquet source."""
    return Located(name, "ray-dataset", None, "", (), dataset)


def located(config: "TrainConfig") -> Optional[Located]:
    """Where --dataset's files are, or None for a built-in name or a function.

    This lists the files (a round trip per prefix on an object store): a run calls it
    once and hands the answer on (to ``streams`` and ``streamed.prepare``).
    """
    from app.registry import is_dataset_name, looks_like_path

    dataset = config.dataset
    if not isinstance(dataset, str) or not looks_like_path(dataset):
        return None
    assert is_dataset_name(dataset)
    return locate(dataset, config.data_format)


# Resuming at an exact step needs every epoch's order of rows known to every worker, whatever their number.
STEP_EXACT = ("--num-workers MIN:MAX and --checkpoint-every-steps go on from an exact step of a seeded global order of "
              "rows, which in-memory data has (built-in datasets, .npz/.npy files, data functions returning arrays); "
              "{what} streams through Ray Data, split per worker: give a fixed --num-workers and no "
              "--checkpoint-every-steps, or load it as arrays")


def streams(loc: Optional[Located], on_ray: bool) -> bool:
    """On the Ray backend, parquet, CSV, TFRecord and image folders (and a function's Ray Dataset) go through Ray Data;
    the local backend reads them in its own process (app.data.local_files); numpy files load in memory."""
    return loc is not None and loc.format != "numpy" and on_ray
