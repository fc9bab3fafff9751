"""A tf.data input pipeline with a preprocessing layer adapted on the training data and a tf.data validation set,
as keras.io's structured-data and image examples train ("Structured data classification from scratch").

Only the fit line differs from the Keras script: `app.fit(build_model, train_ds, validation_data=val_ds, ...)`.
Run it: python examples/tf_data_pipeline.py
"""

import json
from pathlib import Path

import keras
import numpy as np
import pandas as pd
import tensorflow as tf

import app

# UCI's wine recognition data (CC BY 4.0): 178 wines, 13 measurements on scales from 0.1 to 1,680, 3 cultivars.
data = pd.read_csv(Path(__file__).with_name("wine.csv"))
rng = np.random.default_rng(0)
order = rng.permutation(len(data))
features = data.drop(columns="class").to_numpy()[order].astype("float32")
labels = data["class"].to_numpy()[order]
cut = int(0.8 * len(labels))
train_ds = tf.data.Dataset.from_tensor_slices((features[:cut], labels[:cut])).shuffle(256, seed=1).batch(16)
val_ds = tf.data.Dataset.from_tensor_slices((features[cut:], labels[cut:])).batch(16)

# A Normalization layer adapted on the training features only (its mean and variance become the model's weights).
normalizer = keras.layers.Normalization()
normalizer.adapt(train_ds.map(lambda x, y: x))


def build_model():
    inputs = keras.Input((features.shape[1],))
    x = normalizer(inputs)
    x = keras.layers.Dense(32, activation="relu")(x)
    x = keras.layers.Dropout(0.2)(x)
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(x))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


# history = build_model().fit(train_ds, validation_data=val_ds, epochs=30)
history = app.fit(build_model, train_ds, validation_data=val_ds, epochs=30, num_workers=2)
print(json.dumps({"val_accuracy": history.history["val_accuracy"], "keys": list(history.history)}))
