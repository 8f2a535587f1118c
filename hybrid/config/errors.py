"""The one error type of the config package, and the nearest-name suggestions."""

from __future__ import annotations

import difflib
from typing import Iterable, Sequence, Tuple


class ConfigError(ValueError):
    """A configuration value or key that hybrid cannot use; the message says how to fix it.

    ``keys`` are the dotted config keys the error is about (empty when none
    applies); ``message`` is the text without the ``(set by --flag)`` note
    that :func:`hybrid.config.flags.key_error` adds to ``str(error)``.
    """

    def __init__(self, text: str, keys: Iterable[str] = (), message: str = None):
        super().__init__(text)
        self.keys: Tuple[str, ...] = tuple(keys)
        self.message = text if message is None else message


def one_error_for_all(problems: Sequence[ConfigError], what: str) -> ConfigError:
    """One ConfigError for every problem found in one pass, so that a file is fixed in one edit, not one run each.

    ``what`` names the items (``"config keys"``); a single problem is returned
    as it is, several become ``"N <what> need changing: (1) ... (2) ..."``.
    A problem that is itself such a list is spread into it.
    """
    flat = [item for problem in problems for item in getattr(problem, "problems", (problem,))]
    if len(flat) == 1:
        return flat[0]
    error = ConfigError(f"{len(flat)} {what} need changing: " + " ".join(f"({i}) {p}" for i, p in enumerate(flat, 1)),
                        keys=[key for p in flat for key in p.keys],
                        message=f"{len(flat)} {what} need changing: "
                                + " ".join(f"({i}) {p.message}" for i, p in enumerate(flat, 1)))
    error.problems = tuple(flat)
    return error


def suggestion(key: str, candidates: Iterable[str], prefix: str = "") -> str:
    """`` Did you mean 'prefix.x'?`` for the closest candidate, or a list of the valid ones."""
    candidates = sorted(set(candidates))
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if close:
        return f" Did you mean '{prefix}{close[0]}'?"
    return f" Valid keys here: {', '.join(candidates)}."


def value_suggestion(value: str, choices: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` when a bad value is close to a valid one, else an empty string."""
    close = difflib.get_close_matches(value, sorted(set(choices)), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def unknown_key_error(path: str, key: str, candidates: Iterable[str], what: str = "config key") -> ConfigError:
    full = f"{path}.{key}" if path else key
    return ConfigError(f"unknown {what} '{full}'.{suggestion(key, candidates, f'{path}.' if path else '')}",
                       keys=(full,))
