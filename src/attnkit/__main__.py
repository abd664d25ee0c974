"""``python -m attnkit``: the same as the ``attnkit`` command."""

import sys

from attnkit.cli import main

sys.exit(main())
