"""The README's model and data functions, and the guide's Keras callbacks, for the command line:

    python jobs/train.py --model examples/my_example.py:build_model --dataset examples/my_example.py:load_data
    python jobs/train.py --model examples/my_example.py:build_model --dataset examples/my_example.py:load_data \
      --callbacks examples/my_example.py:callbacks
"""

import keras

import app


def build_model(input_shape, num_classes):
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(num_classes, activation="softmax"),
    ])


def load_data():
    x, y = app.digits()  # the 1,797 8x8 digits this package ships, scaled to [0, 1]
    return x.reshape(-1, 8, 8, 1), y


def callbacks(output_dir):
    return [keras.callbacks.EarlyStopping(monitor="val_loss", patience=2),
            keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1),
            keras.callbacks.CSVLogger(f"{output_dir}/keras_log.csv")]
