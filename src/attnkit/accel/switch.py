"""An on/off switch for a lever: on by default (or, for a lever a rule chooses, None: "the
rule"), set by its environment variable or inside a ``with`` block (benchmarks and tests
compare both). A switch keeps its variable's text too (``value``), for one that picks among
more than two (``ATTNKIT_KERNELS``: a kernel variant, or off).

The environment is read in one place, :func:`read_environment`, which ``accel.prepare`` and
``accel.levers`` (so ``attnkit info`` and every run's header) call: a switch says what the
environment asked as of the last report, and a ``with`` block overrides it inside the block.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Switch", "read_environment", "switch"]

_SWITCHES: dict[str, Switch] = {}


def switch(env: str) -> Switch:
    """The switch named by environment variable ``env`` (``accel.prepare`` reads them all)."""
    if env not in _SWITCHES:
        raise ValueError(f"switch: no lever is switched by {env!r}; known: {sorted(_SWITCHES)}")
    return _SWITCHES[env]


def read_environment() -> None:
    """Set every switch not held by a ``with`` block from its environment variable: ``0`` or
    ``off`` off, ``1`` or ``on`` on, anything else (or unset) its default."""
    for each in _SWITCHES.values():
        each.value = os.environ.get(each.env, "").strip()
        if not each.held:
            said = {"0": False, "off": False, "1": True, "on": True}.get(each.value.lower())
            each.on = each.default if said is None else said
            each.why_off = f"{each.env}={each.value}" if said is False else "switched off"


class Switch:
    def __init__(self, env: str, default: bool | None = True) -> None:
        self.env, self.default = env, default
        self.on: bool | None = default
        self.why_off = "switched off"  # why the lever is off: its variable, or a with block
        self.value = ""  # the variable's text, as of the last read
        self.held = 0  # with blocks open on it
        _SWITCHES[env] = self

    @contextmanager
    def __call__(self, enabled: bool) -> Iterator[None]:
        """Inside the block the lever is on (``enabled``) or off."""
        before, self.on = (self.on, self.why_off), bool(enabled)
        self.why_off, self.held = "switched off", self.held + 1
        try:
            yield
        finally:
            (self.on, self.why_off), self.held = before, self.held - 1
