"""The training examples of ``examples/`` as checks of the 2-process worker job: each runs with
small sizes in the job's process group (starting processes is the slow part)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# name -> (module, argv): small sizes, a few steps each
RUNS = {
    "gpt2": ("train_hf", ["--model", "gpt2", "--layers", "2", "--hidden", "64", "--heads", "4",
                          "--vocab", "128", "--seq", "32", "--batch", "4", "--steps", "4",
                          "--lr", "1e-2"]),
    "llama": ("train_hf", ["--model", "llama", "--layers", "2", "--hidden", "64", "--heads", "4",
                           "--vocab", "128", "--seq", "32", "--batch", "4", "--steps", "4",
                           "--lr", "1e-2"]),
    "gpt": ("train_gpt", ["--steps", "3"]),
}


def run_example(name: str) -> dict:
    """Run example ``name`` of :data:`RUNS`; its losses per step."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # as `python examples/x.py` has it
    module, argv = RUNS[name]
    return {"losses": importlib.import_module(module).main(argv)}
