"""The `mode="rescale"` recipe written out with a plain optimizer, for both Keras families.

The reference runs a fresh inner optimizer configured with `β̃ = 1 − (1 − β)/k`
for each moving-average coefficient (and, for a heavy-ball momentum, the
learning rate divided by `k` and the weight decay multiplied by `k`, so their
product is unchanged) at every micro-step, and puts the model's weights back
after every micro-step that is not the `k`-th of its window. Its iteration
counter counts micro-steps, as the wrapped optimizer's bias corrections do.
"""

import numpy as np

# (class name, constructor arguments, the coefficients rescaled, heavy ball)
OPTIMIZERS = [
    ("Adam", dict(learning_rate=1e-2), ("beta_1", "beta_2"), False),
    ("AdamW", dict(learning_rate=1e-2, weight_decay=0.1, amsgrad=True), ("beta_1", "beta_2"), False),
    ("Adamax", dict(learning_rate=1e-2), ("beta_1", "beta_2"), False),
    ("Nadam", dict(learning_rate=1e-2), ("beta_1", "beta_2"), False),
    ("Lion", dict(learning_rate=1e-3), ("beta_1", "beta_2"), False),
    ("Lamb", dict(learning_rate=1e-2), ("beta_1", "beta_2"), False),
    ("SGD", dict(learning_rate=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), ("momentum",), True),
    ("RMSprop", dict(learning_rate=1e-2, momentum=0.5, centered=True), ("rho", "momentum"), True),
    # No moving average of the gradient: the window's last micro-gradient moves the weights.
    ("RMSprop", dict(learning_rate=1e-2), ("rho",), False),
    ("Adadelta", dict(learning_rate=1.0), ("rho",), False),
    ("Adafactor", dict(learning_rate=1e-2), (), False),
]
IDS = [name + ("_no_momentum" if name == "RMSprop" and "momentum" not in kwargs else "")
       for name, kwargs, *_ in OPTIMIZERS]


def rescaled_config(optimizer, k, coefficients, heavy_ball):
    """The inner optimizer's config with the recipe's coefficients and rates."""
    config = dict(optimizer.get_config())
    for name in coefficients:
        config[name] = 1.0 - (1.0 - config[name]) / k
    if heavy_ball:
        config["learning_rate"] = config["learning_rate"] / k
        if config.get("weight_decay"):
            config["weight_decay"] = config["weight_decay"] * k
    return config


def run_recipe(model, optimizer, step, micro_batches, k):
    """Steps `optimizer` (configured by `rescaled_config`) on each micro-batch and
    restores the weights after every micro-step but each window's last."""
    for j, batch in enumerate(micro_batches):
        before = [np.array(w) for w in model.get_weights()]
        step(*batch)
        if (j + 1) % k:
            model.set_weights(before)
