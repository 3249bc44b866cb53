"""``python -m autopar``: command line: ``demo``, ``plan``, ``simulate`` and ``calibrate`` (see
:mod:`autopar.cli`)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``python -m autopar COMMAND ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m autopar demo [--nproc N] [--steps S] [--topology NAME] [--compile]\n"
              "       python -m autopar plan MODEL --mesh NODESxGPUS --hardware NAME --batch B "
              "[--seq S] [--json P] [--trace P] [--svg P] (--help for all options)\n"
              "       python -m autopar simulate PLAN.json [--trace P] [--svg P]\n"
              "       python -m autopar calibrate --out TOPOLOGY.json [--model MODEL --batch B "
              "--seq S] [--nproc N]")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from autopar.demo import main as demo_main

        return demo_main(rest)
    if command in ("plan", "simulate", "calibrate"):
        from autopar.cli import main as cli_main

        return cli_main(argv)
    print(f"unknown command {command!r}; available: demo, plan, simulate, calibrate", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
