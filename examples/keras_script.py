"""The README's Keras script with its one line changed: model.fit -> app.fit, on 2 Ray workers.

    python examples/keras_script.py
"""

import keras
from sklearn.datasets import load_digits

import app


def build_model():
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


d = load_digits()
x, y = (d.data / 16.0).astype("float32"), d.target
# history = build_model().fit(x, y, batch_size=256, epochs=10, validation_split=0.2)
history = app.fit(build_model, x, y, batch_size=256, epochs=10, validation_split=0.2, num_workers=2)
print(history.history["val_accuracy"])   # one value per epoch; also loss, accuracy, val_loss
model = history.model                    # the trained model
