"""A model with its own train_step, as keras.io writes a VAE ("Variational AutoEncoder", keras.io/examples/generative/vae),
on the digits this package ships (app.digits()): fit on x alone, three Mean trackers, the class defined in this script.

Only the fit line differs from the Keras script: `app.fit(build_vae, x, ...)` instead of `vae.fit(x, ...)`.
Run it: python examples/vae_own_train_step.py
"""

import json

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

import app

LATENT = 2


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def build_encoder():
    inputs = keras.Input(shape=(64,))
    x = layers.Dense(32, activation="relu")(inputs)
    z_mean = layers.Dense(LATENT, name="z_mean")(x)
    z_log_var = layers.Dense(LATENT, name="z_log_var")(x)
    return keras.Model(inputs, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])], name="encoder")


def build_decoder():
    latent_inputs = keras.Input(shape=(LATENT,))
    x = layers.Dense(32, activation="relu")(latent_inputs)
    return keras.Model(latent_inputs, layers.Dense(64, activation="sigmoid")(x), name="decoder")


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(ops.sum(keras.losses.binary_crossentropy(
                ops.expand_dims(data, -1), ops.expand_dims(reconstruction, -1)), axis=1))
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


def build_vae():
    vae = VAE(build_encoder(), build_decoder())
    vae.compile(optimizer=keras.optimizers.Adam(learning_rate=3e-3))
    return vae


digits, _ = app.digits()
# vae = build_vae(); history = vae.fit(digits, epochs=15, batch_size=128)
history = app.fit(build_vae, digits, epochs=15, batch_size=128, num_workers=2)
vae = history.model
z_mean, _, _ = vae.encoder.predict(digits[:5], verbose=0)
reconstructed = vae.decoder.predict(z_mean, verbose=0)
print(json.dumps({"loss": history.history["loss"], "kl_loss": history.history["kl_loss"],
                  "reconstruction_error": float(np.mean(np.abs(reconstructed - digits[:5])))}))
