"""Both Keras families implement the whole adapter interface (`recompute._adapter.Adapter`)."""

import inspect

import pytest

from recompute import _adapter, _backends


@pytest.mark.parametrize("adapter", _backends.ADAPTERS, ids=lambda m: m.__name__)
def test_every_member_is_defined(adapter):
    missing = [name for name in _adapter.MEMBERS if not hasattr(adapter, name)]
    assert not missing, f"{adapter.__name__} lacks {missing}"


@pytest.mark.parametrize("adapter", _backends.ADAPTERS, ids=lambda m: m.__name__)
def test_signatures_match_the_protocol(adapter):
    for name in _adapter.MEMBERS:
        spec = getattr(_adapter.Adapter, name, None)
        if not callable(spec):
            continue
        expected = list(inspect.signature(spec).parameters)[1:]  # without `self`
        assert list(inspect.signature(getattr(adapter, name)).parameters) == expected, name


@pytest.mark.parametrize("adapter", _backends.ADAPTERS, ids=lambda m: m.__name__)
def test_no_member_is_a_placeholder(adapter):
    # The interface has no "raise AssertionError" members: a family without a
    # feature says so through a value (e.g. `legacy_rng` returns None).
    for name in _adapter.MEMBERS:
        member = getattr(adapter, name)
        if callable(member):
            assert "AssertionError" not in inspect.getsource(member), name
