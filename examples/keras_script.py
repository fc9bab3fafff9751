"""The README's Keras script with its one line changed: model.fit -> app.fit, on 2 Ray workers.

    python examples/keras_script.py
"""

import keras

import app


def build_model():
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


x, y = app.digits()   # your arrays; these: the 1,797 8x8 digits this package ships, scaled to [0, 1]
# history = build_model().fit(x, y, batch_size=256, epochs=10, validation_split=0.2)
history = app.fit(build_model, x, y, batch_size=256, epochs=10, validation_split=0.2, num_workers=2)
print(history.history["val_accuracy"])   # one value per epoch; also loss, accuracy, val_loss
model = history.model                    # the trained model
