"""The ``selfspec`` command's subcommands (:mod:`selfspec.cli`); ``scripts/`` holds aliases."""
