"""The ``attnkit`` command: one module per command, each with ``register(subparsers)`` (its
arguments) and ``run(args)``; ``parser.py`` registers them all from one list. Shared helpers
live in ``common.py`` (loading, devices), ``tasks.py`` (the task commands) and ``serving.py``
(serve and chat).

Usage errors (a bad option, a malformed value) print one line naming the option and exit with
status 2; other failures print one line and exit with status 1. Set ``ATTNKIT_DEBUG=1`` to see
the traceback of a failure.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from attnkit.cli.common import UsageError
from attnkit.cli.parser import build_parser

__all__ = ["UsageError", "build_parser", "main"]


def _one_line_warnings() -> None:
    """attnkit's own warnings (a kernel that did not load, on the "attnkit" logger) as one
    line each on stderr."""
    log = logging.getLogger("attnkit")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("attnkit: warning: %(message)s"))
        log.addHandler(handler)
        log.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    _one_line_warnings()
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named with the command's own help, not the top level's
            where = f"attnkit {args.command}" if args.command else "attnkit"
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} (see '{where} --help')")
        if args.command is None:
            parser.print_help()
            return 0
        return args.handler(args) or 0  # a handler may return an exit status
    except UsageError as error:
        print(f"attnkit: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attnkit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`attnkit ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as error:  # one line, no traceback, unless asked for
        if os.environ.get("ATTNKIT_DEBUG"):
            raise
        print(f"attnkit: error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
