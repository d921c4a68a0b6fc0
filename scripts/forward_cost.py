"""What one target pass over n new tokens costs here, per dtype and weight layout, side by side.

    python scripts/forward_cost.py --out docs/results/r8_forward_cost

Loads the target once per setup in one process (float32 with ``nn.Linear``; float32 with skinny
products for few rows, :mod:`selfspec.skinny_linear`; bfloat16 with ``nn.Linear``; bfloat16 with
prepacked weights, :mod:`selfspec.prepack`, where the CPU has native bf16; ``--setups`` picks) and
measures, interleaved per size (the setups' order alternating per round) so load drifts hit all
alike, the median seconds of a decoder + LM head pass over n new tokens after a 256-token
cache (``selfspec.measurement.calibration.verify_costs``): n = 1 is a plain decode step, larger n a
verified draft tree. Writes <out>.json (command, provenance, costs) and <out>.md (a table).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import selfspec  # noqa: E402
from selfspec.measurement import benchmark  # noqa: E402
from selfspec.measurement.measure import write_result  # noqa: E402
from selfspec.measurement.calibration import verify_costs  # noqa: E402

SETUPS = {  # name -> load_target keyword arguments
    "float32": dict(dtype="float32", skinny=False),
    "float32 skinny": dict(dtype="float32", skinny=True),
    "bfloat16": dict(dtype="bfloat16", prepack=False),
    "bfloat16 prepacked": dict(dtype="bfloat16", prepack=True),
}


def table(costs: dict[str, dict[int, float]]) -> str:
    sizes = sorted(next(iter(costs.values())))
    lines = ["| setup | " + " | ".join(f"n={n}" for n in sizes) + " | n=8 / n=1 |",
             "|---|" + "---|" * (len(sizes) + 1)]
    for name, c in costs.items():
        cells = " | ".join(f"{1000 * c[n]:.1f}" for n in sizes)
        lines.append(f"| {name} | {cells} | {c[8] / c[1]:.2f} |" if 8 in c and 1 in c else f"| {name} | {cells} | - |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=selfspec.DEFAULT_TARGET)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best median per cell is kept")
    ap.add_argument("--setups", nargs="+", choices=sorted(SETUPS), default=None,
                    help="default: every setup that runs here (bf16 prepacked needs native bf16)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    prov = benchmark.provenance()
    from selfspec.prepack import prepack_available

    names = args.setups or [n for n in SETUPS if n != "bfloat16 prepacked" or prepack_available(torch.bfloat16)]
    models = {name: selfspec.load_target(args.target, **SETUPS[name])[0] for name in names}
    costs = {name: {n: float("inf") for n in args.sizes} for name in models}
    for r in range(args.rounds):
        for n in args.sizes:  # setups interleaved per size, their order alternating per round
            for name, model in (list(models.items()) if r % 2 == 0 else list(models.items())[::-1]):
                costs[name][n] = min(costs[name][n], verify_costs(model, [n])[n])
    command = "python scripts/forward_cost.py " + " ".join(argv or sys.argv[1:])
    text = (f"`{command}`\n\nMilliseconds per target pass (decoder + LM head) over n new tokens after a "
            f"256-token cache, {torch.get_num_threads()} threads:\n\n{table(costs)}\n")
    print(text)
    write_result(args.out, {"command": command, "provenance": prov, "threads": torch.get_num_threads(),
                   "seconds": {k: {str(n): s for n, s in v.items()} for k, v in costs.items()}}, text)


if __name__ == "__main__":
    main()
