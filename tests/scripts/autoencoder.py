"""The autoencoder the user scripts of tests/test_keras_features.py train: a model with its own train_step, its two
Dense layers named (``encoder``, ``decoder``) so that a tensor-parallel layout can split them. Imported by the
scripts beside it, as a user's script imports its own model module."""

import keras
import tensorflow as tf


class Autoencoder(keras.Model):
    """Its own train_step, written for mixed precision as Keras's guide writes it (the output cast to float32)."""

    def __init__(self, hidden: int = 4, activation=None):
        super().__init__()
        self.encoder = keras.layers.Dense(hidden, activation=activation, name="encoder")
        self.decoder = keras.layers.Dense(8, name="decoder")
        self.loss_tracker = keras.metrics.Mean(name="reconstruction")

    def call(self, inputs):
        return self.decoder(self.encoder(inputs))

    def train_step(self, data):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(self(data), tf.float32) - data))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.loss_tracker.update_state(loss)
        return {"reconstruction": self.loss_tracker.result()}

    @property
    def metrics(self):
        return [self.loss_tracker]
