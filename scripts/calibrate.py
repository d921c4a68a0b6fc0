"""Alias of ``selfspec calibrate`` (:mod:`selfspec.commands.calibrate`) for a checkout without the package installed."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from selfspec.commands.calibrate import main  # noqa: E402

if __name__ == "__main__":
    main()
