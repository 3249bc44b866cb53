"""The intra-operator ILP's linear model (Alpa's formulation, :mod:`autopar.solver.ilp`) written
as one OR-Tools ``MPModelProto`` with numpy, and loaded into a ``pywraplp`` solver.

Why not ``pywraplp``'s own calls: they cost a Python call per variable and per coefficient. A
DeepSeek-V3 pipeline stage on a (dp, ep, tp) mesh has 0.4-0.9 million edge variables; built
call by call its LP took 7.6 s to build, against 2.1 s written here and loaded (0.8 s to write,
1.3 s to load; measured on a 2-core machine, the ILP of stage 0 of
``benchmarks/moe_plan_scale.py --rows deepseek-v3 --plan``: 880k variables, 58k constraints). OR-Tools' vectorised
``model_builder`` needs scipy for its sparse matrices, which this project does not depend on.

The variables are written as fixed-size protobuf records by numpy (field numbers and wire types
of ``linear_solver.proto``, checked against protobuf's own encoding in ``tests/unit/test_ilp.py``);
the constraints through protobuf's message API, one call per constraint; both halves are parsed
as one message (protobuf merges repeated fields of concatenated messages). The model lists its
variables and constraints in the order the call-by-call build did, so that a backend given the
same problem takes the same path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from ortools.linear_solver import linear_solver_pb2, pywraplp

from autopar.errors import AutoparError

__all__ = ["Formulation", "LoadedModel", "formulate", "load", "variable_records"]

# MPModelProto.variable is field 3; MPVariableProto's lower_bound 1, upper_bound 2,
# objective_coefficient 3 (doubles, wire type 1), is_integer 4 (varint, wire type 0)
_VARIABLE_TAG, _LOWER_TAG, _UPPER_TAG, _OBJECTIVE_TAG, _INTEGER_TAG = 0x1A, 0x09, 0x11, 0x19, 0x20


def variable_records(lower: np.ndarray, upper: np.ndarray, objective: np.ndarray,
                     integer: bool) -> bytes:
    """``MPModelProto.variable`` entries, serialised: one per element of the three arrays (equal
    lengths), all integer or all continuous. Unnamed."""
    fields = [("tag", "u1"), ("size", "u1"), ("t_lower", "u1"), ("lower", "<f8"),
              ("t_upper", "u1"), ("upper", "<f8"), ("t_objective", "u1"), ("objective", "<f8")]
    if integer:
        fields += [("t_integer", "u1"), ("integer", "u1")]
    record = np.zeros(len(objective), np.dtype(fields))  # (packed: no padding between fields)
    record["tag"], record["size"] = _VARIABLE_TAG, record.dtype.itemsize - 2
    record["t_lower"], record["lower"] = _LOWER_TAG, lower
    record["t_upper"], record["upper"] = _UPPER_TAG, upper
    record["t_objective"], record["objective"] = _OBJECTIVE_TAG, objective
    if integer:
        record["t_integer"], record["integer"] = _INTEGER_TAG, 1
    return record.tobytes()


@dataclass(frozen=True)
class Formulation:
    """The model of one presolved problem: ``proto``, and the index of the first ``x`` variable
    of each open group (``starts[i]`` to ``starts[i + 1]``: group ``i``'s strategies). The
    message is shared by every backend that loads it: read it, never change it."""

    proto: linear_solver_pb2.MPModelProto
    starts: tuple[int, ...]


def formulate(costs: Sequence[np.ndarray], edges: Sequence[tuple[int, int, np.ndarray]],
              extra_memory: Sequence[np.ndarray] | None, slack: float, integer: bool) -> Formulation:
    """Alpa's model over open groups ``0..len(costs)-1``: ``x[g, s]`` (binary when ``integer``,
    else in [0, 1]) with ``sum_s x[g, s] = 1`` and objective ``costs[g]``; per edge ``(u, v,
    mat)`` (in the order given) ``y[s, t]`` in [0, 1] with ``sum_t y[s, t] = x[u, s]``,
    ``sum_s y[s, t] = x[v, t]`` and objective ``mat``; with ``extra_memory``, ``sum extra[g, s]
    x[g, s] <= slack`` (coefficients that are 0 left out). Costs are taken as given (already
    scaled by the caller)."""
    sizes = [len(c) for c in costs]
    _check(sizes, edges, extra_memory)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    model = linear_solver_pb2.MPModelProto()
    add = model.constraint.add
    for g, k in enumerate(sizes):
        add(lower_bound=1.0, upper_bound=1.0, var_index=range(starts[g], starts[g] + k),
            coefficient=[1.0] * k)
    objective = [np.asarray(c, dtype=np.float64) for c in costs]
    first = int(starts[-1])
    for u, v, mat in edges:
        ku, kv = mat.shape
        ys = first + np.arange(ku * kv, dtype=np.int64).reshape(ku, kv)
        for s in range(ku):
            add(lower_bound=0.0, upper_bound=0.0, var_index=[int(starts[u]) + s, *ys[s].tolist()],
                coefficient=[-1.0] + [1.0] * kv)
        for t in range(kv):
            add(lower_bound=0.0, upper_bound=0.0, var_index=[int(starts[v]) + t, *ys[:, t].tolist()],
                coefficient=[-1.0] + [1.0] * ku)
        objective.append(np.asarray(mat, dtype=np.float64).ravel())
        first += ku * kv
    if extra_memory is not None:
        index = [int(starts[g]) + s for g, e in enumerate(extra_memory) for s in np.flatnonzero(e)]
        value = [float(e[s]) for e in extra_memory for s in np.flatnonzero(e)]
        add(lower_bound=-np.inf, upper_bound=slack, var_index=index, coefficient=value)
    obj = np.concatenate(objective) if objective else np.zeros(0)
    nx, ny = int(starts[-1]), len(obj) - int(starts[-1])
    data = (variable_records(np.zeros(nx), np.ones(nx), obj[:nx], integer)
            + variable_records(np.zeros(ny), np.ones(ny), obj[nx:], False)
            + model.SerializeToString())
    return Formulation(linear_solver_pb2.MPModelProto.FromString(data), tuple(int(s) for s in starts))


def _check(sizes: list[int], edges: Sequence[tuple[int, int, np.ndarray]],
           extra_memory: Sequence[np.ndarray] | None) -> None:
    """Raise ValueError for an edge or memory row that does not fit the groups (written
    unchecked, it would read another group's variables)."""
    n = len(sizes)
    for u, v, mat in edges:
        if not (0 <= u < n and 0 <= v < n) or np.shape(mat) != (sizes[u], sizes[v]):
            raise ValueError(f"edge ({u}, {v}) with a cost matrix of shape {np.shape(mat)}; required: "
                             f"groups in 0..{n - 1} and the shape (strategies of u, strategies of v)"
                             f"{f' = {(sizes[u], sizes[v])}' if 0 <= u < n and 0 <= v < n else ''}.")
    if extra_memory is not None and [len(e) for e in extra_memory] != sizes:
        raise ValueError(f"memory rows of lengths {[len(e) for e in extra_memory]}; required one per "
                         f"group, as long as its strategies: {sizes}.")


@dataclass(frozen=True)
class LoadedModel:
    """A :class:`Formulation` loaded into ``solver``: ``x[i]`` the variables of open group ``i``."""

    solver: pywraplp.Solver
    x: tuple[tuple[pywraplp.Variable, ...], ...]


def load(solver: pywraplp.Solver, form: Formulation) -> LoadedModel:
    """Load ``form`` into ``solver`` (minimising). Raises :class:`AutoparError` with OR-Tools'
    message when the solver refuses the model (a bug of :func:`formulate`)."""
    error = solver.LoadModelFromProto(form.proto)
    if error:
        raise AutoparError(f"OR-Tools refused the intra-operator model ({error}); required: a valid "
                           f"MPModelProto. This is a bug of autopar.solver.formulation, please report it.")
    s = form.starts
    return LoadedModel(solver, tuple(tuple(solver.variable(j) for j in range(s[i], s[i + 1]))
                                     for i in range(len(s) - 1)))
