"""Assertions on a2a's errors, shared by the test files (tests/reference.py
stays free of a2a; this module is its a2a-aware companion)."""

from __future__ import annotations

import pytest

import a2a


def raises_invalid(call, *fragments):
    """call() raises InvalidArgumentError whose message holds every fragment;
    returns the message."""
    with pytest.raises(a2a.InvalidArgumentError) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert info.value.status == a2a.InvalidArgumentError.status
    return message


def names_choice(message, token, choice):
    """The message points at the offending choice: indices[token, choice]."""
    return f"indices[{token}, {choice}]" in message
