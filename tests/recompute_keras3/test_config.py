"""The RECOMPUTE switch: parsed when asked, overridable by a context manager."""

import pytest

import recompute


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "On", " on "])
def test_true_values(monkeypatch, value):
    monkeypatch.setenv("RECOMPUTE", value)
    assert recompute.is_enabled() is True


@pytest.mark.parametrize("value", ["0", "false", "No", "off", ""])
def test_false_values(monkeypatch, value):
    monkeypatch.setenv("RECOMPUTE", value)
    assert recompute.is_enabled() is False


def test_unset_is_off(monkeypatch):
    monkeypatch.delenv("RECOMPUTE", raising=False)
    assert recompute.is_enabled() is False


@pytest.mark.parametrize("value", ["2", "enable", "1.0", "y"])
def test_bad_values_name_the_value(monkeypatch, value):
    monkeypatch.setenv("RECOMPUTE", value)
    with pytest.raises(ValueError, match=f"Received: RECOMPUTE={value!r}"):
        recompute.is_enabled()


def test_read_when_asked_not_at_import(monkeypatch):
    monkeypatch.setenv("RECOMPUTE", "0")
    assert not recompute.is_enabled()
    monkeypatch.setenv("RECOMPUTE", "1")
    assert recompute.is_enabled()


def test_scope_beats_a_bad_environment_value(monkeypatch):
    monkeypatch.setenv("RECOMPUTE", "garbage")
    with recompute.recompute_scope(False):
        assert recompute.is_enabled() is False


@pytest.mark.parametrize("value, enabled", [(" 1\n", True), ("\tyes ", True), ("  ", False), (" off\n", False)])
def test_surrounding_whitespace_is_ignored_as_documented(monkeypatch, value, enabled):
    monkeypatch.setenv("RECOMPUTE", value)
    assert recompute.is_enabled() is enabled
    assert "surrounding whitespace ignored" in recompute.is_enabled.__doc__


def test_exact_float32_pins_and_restores():
    from tests.helpers.numerics import check_exact_float32

    check_exact_float32()
