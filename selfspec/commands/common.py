"""What every command shares: the model-loading flags (the same names in every subcommand) and
one-line errors.

Flags: ``--model``, ``--device``, ``--dtype``, ``--revision``, ``--trust-remote-code``,
``--attn-implementation`` (passed to :func:`selfspec.load_target`), and ``--debug``.

Errors: an expected error (a bad argument, a missing or corrupt file, an offline hub id) prints
``selfspec <command>: error: <message>`` on stderr and exits with status 2; ``--debug`` shows the
traceback instead. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager

from selfspec.model.loading import DEFAULT_TARGET

#: Exceptions that mean bad input, not a bug in selfspec.
EXPECTED = (ValueError, TypeError, OSError, ImportError, FloatingPointError)


def add_model_args(ap: argparse.ArgumentParser, *, default_model: str | None = DEFAULT_TARGET,
                   model_help: str = "the target: alias, local folder, .gguf file or hub id",
                   dtype_default: str | None = "auto") -> None:
    """Add the model-loading flags and ``--debug`` to ``ap``."""
    ap.add_argument("--model", default=default_model, help=model_help)
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    ap.add_argument("--dtype", default=dtype_default,
                    help="target dtype: auto (GPU: the checkpoint's own; CPU: bfloat16 where it runs natively and "
                         "measures faster here, else float32), float32, bfloat16, float16")
    ap.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) of --model")
    ap.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code from the hub")
    ap.add_argument("--attn-implementation", default=None,
                    help="sdpa or eager (kernels that take no tree mask, e.g. flash_attention_2, are replaced by sdpa)")
    add_debug(ap)


def add_debug(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--debug", action="store_true", help="show tracebacks of errors")


def load_kwargs(args) -> dict:
    """The ``from_pretrained`` keyword arguments the flags ask for (unset ones left out)."""
    out = {}
    if getattr(args, "revision", None):
        out["revision"] = args.revision
    if getattr(args, "trust_remote_code", False):
        out["trust_remote_code"] = True
    if getattr(args, "attn_implementation", None):
        out["attn_implementation"] = args.attn_implementation
    return out


def load_model(args, **overrides):
    """``selfspec.load_target`` with the flags of :func:`add_model_args` (``overrides`` win)."""
    import selfspec

    kwargs = dict(dtype=args.dtype, device=args.device) | load_kwargs(args) | overrides
    return selfspec.load_target(args.model, **kwargs)


@contextmanager
def fail(command: str, args=None):
    """Turn expected errors raised inside into one line and exit status 2 (see the module docstring)."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"selfspec {command}: interrupted", file=sys.stderr)
        sys.exit(130)
    except EXPECTED as err:
        if getattr(args, "debug", False):
            raise
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"selfspec {command}: error: {message}", file=sys.stderr)
        sys.exit(2)
