"""Alias of ``selfspec bench`` (:mod:`selfspec.commands.bench`) for a checkout without the package installed."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from selfspec.commands.bench import main  # noqa: E402

if __name__ == "__main__":
    main()
