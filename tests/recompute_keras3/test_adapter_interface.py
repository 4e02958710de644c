"""Both Keras families implement the whole adapter interface (`recompute.adapters._adapter.Adapter`)."""

import pytest

from recompute.adapters import _adapter, _backends
from tests.helpers import protocol_checks


@pytest.mark.parametrize("adapter", _backends.ADAPTERS, ids=lambda m: m.__name__)
def test_every_member_is_defined(adapter):
    missing = protocol_checks.missing_members(adapter, _adapter.MEMBERS)
    assert not missing, f"{adapter.__name__} lacks {missing}"


@pytest.mark.parametrize("adapter", _backends.ADAPTERS, ids=lambda m: m.__name__)
def test_signatures_match_the_protocol(adapter):
    mismatched = protocol_checks.mismatched_signatures(adapter, _adapter.Adapter, _adapter.MEMBERS)
    assert not mismatched, mismatched


@pytest.mark.parametrize("adapter", _backends.ADAPTERS, ids=lambda m: m.__name__)
def test_no_member_is_a_placeholder(adapter):
    # The interface has no "raise AssertionError" members: a family without a
    # feature says so through a value (e.g. `legacy_rng` returns None).
    found = protocol_checks.placeholders(adapter, _adapter.MEMBERS, ("AssertionError",))
    assert not found, found
