"""Alias of ``selfspec train`` (:mod:`selfspec.commands.train`) for a checkout without the package installed."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from selfspec.commands.train import main  # noqa: E402

if __name__ == "__main__":
    main()
