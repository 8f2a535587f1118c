"""The check every "all problems in one error" test makes (hybrid.config.errors.one_error_for_all)."""

import pytest

from hybrid.config import ConfigError


def raises_one_error_listing(load, data, count: int, what: str, parts) -> str:
    """``load(data)`` raises one ConfigError of one line, ``"<count> <what> need changing: (1) ..."``, holding
    every one of ``parts``; returns its text."""
    with pytest.raises(ConfigError) as raised:
        load(data)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{count} {what} need changing: (1) "), message
    for part in parts:
        assert part in message, (part, message)
    return message
