"""outrider's environment switches (OUTRIDER_*), read one way: a name, its choices, the first of
them the default. Each switch's meaning is documented beside the function that reads it."""

from __future__ import annotations

import os

from .errors import OutriderError


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The value of environment variable `name` (trimmed, lower case), one of `choices`
    (the first when unset); any other value is one clear error naming the variable."""
    choice = os.environ.get(name, choices[0]).strip().lower()
    if choice not in choices:
        listed = f"{', '.join(choices[:-1])} or {choices[-1]}"
        raise OutriderError(f"{name} must be {listed}, got {choice!r}")
    return choice
