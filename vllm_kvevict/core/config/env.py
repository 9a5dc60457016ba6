"""Environment variables that pick among fixed choices (kernel paths, CPU
instruction paths, score precision): one parser, so every variable accepts
the same spellings and fails with the same message."""

from __future__ import annotations

import os


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """Environment variable `name`, one of `choices` (the first is the
    default), case and spaces ignored; anything else raises ValueError."""
    value = os.environ.get(name, choices[0]).strip().lower()
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {choices}")
    return value
