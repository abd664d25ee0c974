"""An on/off switch for a lever: on by default, off with an environment variable or inside a
``with`` block (benchmarks and tests compare both)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Switch"]


class Switch:
    def __init__(self, env: str) -> None:
        self.env = env
        self.on = os.environ.get(env, "1") != "0"

    @contextmanager
    def __call__(self, enabled: bool) -> Iterator[None]:
        """Inside the block the lever is on (``enabled``) or off."""
        before, self.on = self.on, bool(enabled)
        try:
            yield
        finally:
            self.on = before
