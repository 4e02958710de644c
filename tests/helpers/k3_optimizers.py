"""The Keras 3 inner optimizers of the AccumOptimizer exactness suites (TensorFlow and JAX backends)."""

import keras


def schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "sgd_schedule_wd": lambda: keras.optimizers.SGD(schedule(), momentum=0.5, weight_decay=0.1),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adam_schedule_clipnorm": lambda: keras.optimizers.Adam(schedule(), clipnorm=0.05),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
    "adam_clipvalue_amsgrad": lambda: keras.optimizers.Adam(0.01, clipvalue=0.01, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "adamw_schedule": lambda: keras.optimizers.AdamW(schedule(), weight_decay=0.05),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "rmsprop_momentum": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
    "rmsprop_momentum_centered": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adam_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=4),
}
