"""``python -m asyncckpt``: see ``asyncckpt.cli``."""

import sys

from asyncckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
