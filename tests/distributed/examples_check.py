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
    # 2 steps saved to a checkpoint, then a second run resumes there and goes to step 4
    "gpt-resume": ("train_gpt", ["--steps", "2", "--timeout", "300"]),
}


def run_example(name: str, workdir: str) -> dict:
    """Run example ``name`` of :data:`RUNS`; its losses per step (``gpt-resume``: of the first
    run and of the resumed run)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # as `python examples/x.py` has it
    module, argv = RUNS[name]
    main = importlib.import_module(module).main
    if name != "gpt-resume":
        return {"losses": main(argv)}
    ckpt = ["--checkpoint", str(Path(workdir) / "example-ckpt")]
    first = main(argv + ckpt)
    return {"losses": first, "resumed": main(["--steps", "4", *ckpt])}
