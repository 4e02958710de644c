"""`accum._shadow.shadowed`: instance attributes set for a while, what was there restored."""

from accum import _shadow


class Optimizer:
    def update(self):
        return "class"


def test_restores_the_class_method_and_an_instance_attribute():
    optimizer = Optimizer()
    optimizer.scale = 1
    with _shadow.shadowed(optimizer, {"update": lambda: "hook", "scale": 2}):
        assert optimizer.update() == "hook" and optimizer.scale == 2
    assert optimizer.update() == "class" and optimizer.scale == 1
    assert "update" not in vars(optimizer) and not hasattr(optimizer, "_accum_shadows")


def test_reentered_the_first_values_stay_until_the_last_exit():
    optimizer = Optimizer()
    with _shadow.shadowed(optimizer, {"update": lambda: "first"}):
        with _shadow.shadowed(optimizer, {"update": lambda: "second"}):  # another replica
            assert optimizer.update() == "first"
        assert optimizer.update() == "first"
    assert optimizer.update() == "class"


def test_other_names_of_the_same_object_are_independent():
    optimizer = Optimizer()
    with _shadow.shadowed(optimizer, {"all_reduce": list}):
        with _shadow.shadowed(optimizer, {"update": lambda: "hook"}):
            assert optimizer.update() == "hook" and optimizer.all_reduce is list
        assert optimizer.update() == "class" and optimizer.all_reduce is list
    assert not hasattr(optimizer, "all_reduce")


def test_restores_on_an_error():
    optimizer = Optimizer()
    try:
        with _shadow.shadowed(optimizer, {"update": lambda: "hook"}):
            raise RuntimeError("traced update failed")
    except RuntimeError:
        pass
    assert optimizer.update() == "class"


class Model:
    def compile(self, optimizer):
        return ("class", optimizer)


def test_replaced_methods_are_bound_until_restored():
    model = Model()
    _shadow.replace_methods(model, {"compile": lambda self, optimizer: ("instance", self, optimizer)})
    assert model.compile("sgd") == ("instance", model, "sgd")
    assert _shadow.restore_methods(model, ("compile", "fit")) is True
    assert model.compile("sgd") == ("class", "sgd")
    assert _shadow.restore_methods(model, ("compile",)) is False
