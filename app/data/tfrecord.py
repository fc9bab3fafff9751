"""TFRecord files of ``tf.train.Example`` records: read in this process (--backend local), and the one-line
reasons a file does not read, the same on both backends.

On Ray, ``ray.data.read_tfrecords`` reads them (app.data.streamed); here the records become pyarrow tables
in the layout that reader gives, so that everything after the read (app.data.schema's spec, app.data.blocks'
checks, features, labels and row ids) is the parquet path's and a row gets the same id, hence the same side
of the validation split, on both backends. That layout, per feature of a record:

- ``float_list`` -> float32, ``int64_list`` -> int64, ``bytes_list`` -> binary;
- one value -> a scalar column, more -> a list column (a batch mixing both is all lists here, so the length
  check of app.data.schema.totals names the mix; Ray Data's reader fails to merge such a block instead,
  which ``read_failure`` words the same way);
- a feature a record lacks -> null (refused as missing values).

The framing (length, CRC of the length, data, CRC of the data) is read as Ray Data's reader reads it, without
checking the CRCs; a length beyond the end of the file is the sign of a file that is not TFRecord.
"""

from __future__ import annotations

import re
import struct
from typing import TYPE_CHECKING, Iterator, Optional

from app.errors import UserError

if TYPE_CHECKING:
    import pyarrow as pa

    from app.data.files import Located

FIX = "write tf.train.Example records with tf.io.TFRecordWriter (uncompressed)"


def not_tfrecord(path: str, records: int) -> str:
    return f"{path} is not a TFRecord file (its framing breaks after {records} records): {FIX}"


def not_example(path: str) -> str:
    return f"{path} holds a record that is not a tf.train.Example (e.g. a SequenceExample): {FIX}"


def mixed_lengths(name: str) -> str:
    return (f"feature column {name!r} has ragged feature shapes: one value in some records, a list in others "
            "(every example must have the same shape)")


def read_failure(error_text: str) -> Optional[str]:
    """Ray Data's TFRecord reader's failure (a task's whole error text) as our line, or None if it is not one."""
    framing = re.search(r"Failed to read TFRecord file (.+?)\. Please ensure.*?Already read (\d+) rows", error_text)
    if framing:
        return not_tfrecord(framing.group(1), int(framing.group(2)))
    parse = re.search(r"failed to parse `tf.train.Example` record in '(.+?)'", error_text)
    if parse:
        return not_example(parse.group(1))
    merge = re.search(r"Field (\S+) has incompatible types: list<[^>]*> vs \w+", error_text) or \
        re.search(r"Field (\S+) has incompatible types: \w+ vs list<", error_text)
    if merge:
        return mixed_lengths(merge.group(1))
    return None


def batches(loc: "Located", columns: Optional[list[str]], rows: int) -> Iterator["pa.Table"]:
    """The records of every file, ``rows`` at a time, as tables of ``columns`` (None: every feature)."""
    import tensorflow as tf
    from google.protobuf.message import DecodeError

    for path in loc.files:
        examples = []
        for record in _records(loc, path):
            try:
                examples.append(tf.train.Example.FromString(record))
            except DecodeError:
                raise UserError(f"cannot read dataset {loc.uri!r} as tfrecord: {not_example(path)}") from None
            if len(examples) == rows:
                yield _table(examples, columns)
                examples = []
        if examples:
            yield _table(examples, columns)


def _records(loc: "Located", path: str) -> Iterator[bytes]:
    count = 0
    with loc.filesystem.open_input_file(path) as f:
        size = f.size()
        while f.tell() < size:
            header = f.read(12)  # uint64 length, uint32 masked CRC of the length
            length = struct.unpack("<Q", header[:8])[0] if len(header) == 12 else size
            if f.tell() + length + 4 > size:
                raise UserError(f"cannot read dataset {loc.uri!r} as tfrecord: {not_tfrecord(path, count)}")
            data = f.read(length)
            f.read(4)  # masked CRC of the data
            count += 1
            yield data


def _table(examples: list, columns: Optional[list[str]]) -> "pa.Table":
    import pyarrow as pa

    if columns is None:
        columns = list(dict.fromkeys(name for e in examples for name in e.features.feature))
    types = {"float_list": pa.float32(), "int64_list": pa.int64(), "bytes_list": pa.binary()}
    table = {}
    for name in columns:
        values, kind = [], None
        for example in examples:
            feature = example.features.feature.get(name)
            which = feature.WhichOneof("kind") if feature is not None else None
            listed = list(getattr(feature, which).value) if which else []
            values.append(listed or None)  # an empty feature is a missing value, as a feature the record lacks
            kind = kind or (which if listed else None)
        scalar = all(v is None or len(v) == 1 for v in values)
        value_type = types.get(kind, pa.null())
        table[name] = pa.array([v if v is None or not scalar else v[0] for v in values],
                               type=value_type if scalar else pa.list_(value_type))
    return pa.table(table)
