"""The ``selfspec`` command: one subcommand per job, each a thin layer over the library.

    selfspec generate --prompt "Write a haiku about trees."      speculative generation, speed vs plain
    selfspec bench --questions q.jsonl --methods eagle3+ngram    side-by-side benchmark with intervals
    selfspec train --model M --drafter eagle3                     distil, train, calibrate, benchmark, card: one command
    selfspec distill --config configs/distill/smollm2.yaml        self-distilled training data (one stage)
    selfspec train --config configs/eagle3/smollm2.yaml           train a drafter from a recipe config (one stage)
    selfspec calibrate selfspec/checkpoints/<head>                         measure a head's acceptance per depth (one stage)
    selfspec export selfspec/checkpoints/<head> --format eagle3 --out DIR  layouts vLLM / SGLang load

``selfspec <command> --help`` shows each command's options and a working example.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": "speculative generation on a model, with its speed against plain decoding",
    "bench": "benchmark drafters against plain decoding, side by side, with intervals",
    "distill": "self-distil training data with the target model",
    "train": "train a drafter for a model in one command (EAGLE-3 head, Medusa heads, layer-skip adapter)",
    "calibrate": "measure a trained drafter's acceptance per depth on held-out prompts",
    "export": "export a drafter checkpoint in a layout serving engines load",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()]
    return "usage: selfspec <command> [options]\n\ncommands:\n" + "\n".join(lines) + \
        "\n\n`selfspec <command> --help` shows a command's options and an example."


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        sys.exit(f"selfspec: unknown command {name!r}\n\n{usage()}")
    importlib.import_module(f"selfspec.commands.{name}").main(rest)


if __name__ == "__main__":
    main()
