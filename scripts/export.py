"""Alias of ``selfspec export`` (:mod:`selfspec.commands.export`) for a checkout without the package installed."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from selfspec.commands.export import main  # noqa: E402

if __name__ == "__main__":
    main()
