"""Stage-cut solve time for a 96-layer GPT-like chain at pp = 8, 16, 32 (and v = 2 at pp = 8).

    python benchmarks/stage_cut_scale.py

The chain is an embedding, 96 equal blocks and an LM head three blocks heavy, with per-layer
state and activation sizes of a GPT-3-like layer; 64 microbatches, 1F1B in-flight counts and a
memory budget that binds on the first stages. Prints the ILP's solve time, status and objective
next to the dynamic program's (v = 1).
"""

from __future__ import annotations

import time

from tabulate import tabulate

from autopar.cost_models.pipeline import in_flight
from autopar.solver.stage_cuts import LayerCost, solve_cuts, solve_cuts_dp

BLOCK = LayerCost("block", 1.0e-3, 2.0e-3, 1.6e9, 0.3e9, 2e-5)


def chain() -> list[LayerCost]:
    layers = [LayerCost("pre", 0.2e-3, 0.4e-3, 3.2e9, 0.1e9, 2e-5)]
    layers += [LayerCost(f"blocks.{i}", BLOCK.forward_s, BLOCK.backward_s, BLOCK.state_bytes,
                         BLOCK.activation_bytes, BLOCK.send_s) for i in range(96)]
    layers.append(LayerCost("post", 3.0e-3, 6.0e-3, 3.2e9, 0.4e9, 0.0))
    return layers


def main() -> None:
    layers, m = chain(), 64
    rows = []
    for pp, v in ((8, 1), (16, 1), (32, 1), (8, 2)):
        schedule = "1f1b" if v == 1 else "interleaved-1f1b"
        flight = in_flight(schedule, pp, v, m)
        budget = 80e9 if pp == 8 else None
        t0 = time.perf_counter()
        res = solve_cuts(layers, pp, m, virtual_stages=v, in_flight=flight,
                         memory_budget_bytes=budget, time_limit_s=30.0)
        wall = time.perf_counter() - t0
        dp = (solve_cuts_dp(layers, pp, m, in_flight=flight, memory_budget_bytes=budget).objective_s
              if v == 1 else None)
        rows.append([pp, v, f"{wall:.2f}", res.status, res.backend, f"{res.objective_s:.4f}",
                     f"{dp:.4f}" if dp is not None else "-", "80 GB" if budget else "none"])
    print(tabulate(rows, headers=["pp", "v", "solve s", "status", "backend", "ILP objective s",
                                  "DP objective s", "budget"]))


if __name__ == "__main__":
    main()
