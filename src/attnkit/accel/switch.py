"""An on/off switch for a lever: on by default, off with an environment variable or inside a
``with`` block (benchmarks and tests compare both)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Switch", "switch"]

_SWITCHES: dict[str, Switch] = {}


def switch(env: str) -> Switch:
    """The switch named by environment variable ``env`` (``accel.prepare`` reads them all)."""
    if env not in _SWITCHES:
        raise ValueError(f"switch: no lever is switched by {env!r}; known: {sorted(_SWITCHES)}")
    return _SWITCHES[env]


class Switch:
    def __init__(self, env: str) -> None:
        self.env = env
        self.on = os.environ.get(env, "1") != "0"
        _SWITCHES[env] = self

    @property
    def why_off(self) -> str:
        """Why the lever is off: its environment variable, or a ``with`` block."""
        return f"{self.env}=0" if os.environ.get(self.env) == "0" else "switched off"

    @contextmanager
    def __call__(self, enabled: bool) -> Iterator[None]:
        """Inside the block the lever is on (``enabled``) or off."""
        before, self.on = self.on, bool(enabled)
        try:
            yield
        finally:
            self.on = before
