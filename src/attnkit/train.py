"""``python -m attnkit.train RECIPE [options]``: ``attnkit train`` as a module, for torchrun::

    torchrun --standalone --nproc-per-node 2 -m attnkit.train examples/shakespeare-char.toml

Each worker runs the same command; the trainer reads RANK / WORLD_SIZE / LOCAL_RANK itself.
"""

import sys

from attnkit.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
