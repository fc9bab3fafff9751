"""Your own data from parquet files: train on a directory of them by column, then predict on new rows.

    python examples/parquet_data.py

The rows here are made up (two noisy blobs per class) and written first, as your own files would already be.
Ray Data streams the files to 2 Ray workers block by block; `features` is a list column (4 floats a row),
`label` an integer class. Run it again and it writes the same files and replaces its run and its predictions
(`overwrite`: without it, a second run stops at once, naming the output that exists).
"""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import app

out = Path("runs/example-parquet")
rng = np.random.default_rng(0)
for part in range(2):  # data/train/part-0.parquet, part-1.parquet
    label = rng.integers(0, 3, 600)
    features = rng.normal(size=(600, 4)) + np.eye(3, 4)[label] * 3.0
    (out / "data" / "train").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"features": list(features.astype("float32")), "label": label}),
                   out / "data" / "train" / f"part-{part}.parquet")

result = app.train(data=str(out / "data" / "train"), label_column="label", feature_columns=["features"],
                   model="mlp", num_workers=2, epochs=4, output=str(out / "run"), overwrite=True)
print(f"val_accuracy {result['metrics']['val_accuracy']:.4f}")

# New rows (the same columns, no label needed): predictions in the input's order, as parquet.
predicted = app.predict(str(out / "run"), data=str(out / "data" / "train"), output=str(out / "predictions"),
                        overwrite=True)
print(f"{predicted['rows']} rows predicted: {out / 'predictions'}")
