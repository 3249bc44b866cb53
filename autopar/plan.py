"""``Plan``: what the planner chose, frozen, with its JSON round trip (data; the tables, pictures
and explanations of a plan are in :mod:`autopar.report`)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence


from autopar.errors import PlanError

__all__ = ["Collective", "DEGREES", "NodePlan", "PipelinePlan", "PipelinePrediction", "Plan",
           "PLAN_FORMAT", "Prediction"]

PLAN_FORMAT = 2  # 2: pipeline plans (Plan.pipeline, Collective.stage); format 1 files still load
DEGREES = ("dp", "tp", "pp", "cp", "ep")  # every plan's degrees name these (1 when unused)


def _alternative(a: dict[str, Any]) -> dict[str, Any]:
    """An alternative as saved, with its JSON lists back to tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in a.items()}


class _Fields(Mapping):
    """Read-only mapping view of a frozen dataclass's set fields, so that a prediction reads as
    ``plan.predicted["step_time_s"]`` and saves under the same JSON keys as the dicts it
    replaces. Fields left ``None`` are absent; ``extra`` holds keys of older plan files."""

    def __getitem__(self, key: str) -> Any:
        if key != "extra" and key in self._names():
            value = getattr(self, key)
            if value is not None:
                return value
        return dict(self.extra)[key]

    def __iter__(self) -> Iterator[str]:
        yield from (k for k in self._names() if k != "extra" and getattr(self, k) is not None)
        yield from (k for k, _ in self.extra)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, data: Mapping[str, Any], lenient: bool = False) -> Any:
        """``data`` (a mapping of field names) as this type. Unknown keys raise
        :class:`PlanError`, or with ``lenient`` (a plan file of an older autopar) are kept in
        ``extra``."""
        if isinstance(data, cls):
            return data
        names = set(cls._names()) - {"extra"}
        unknown = [k for k in data if k not in names]
        if unknown and not lenient:
            raise PlanError(f"{cls.__name__} has no field(s) {unknown}; its fields are "
                            f"{sorted(names)}.")
        known = {k: _plain(v) for k, v in data.items() if k in names}
        return cls(**known, extra=tuple((k, _plain(data[k])) for k in unknown))


def _plain(v: Any) -> Any:
    """A JSON-able value: numpy scalars as Python numbers, lists as tuples."""
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    return v.item() if hasattr(v, "item") and not isinstance(v, (int, float)) else v


@dataclass(frozen=True, eq=True)
class Prediction(_Fields):
    """The cost model's prediction of one plan's training step, per device (also a read-only
    mapping of its set fields, as the dict it replaces: ``plan.predicted["step_time_s"]``).

    ``step_time_s``: forward and backward of one step as ``pmodel.step()`` runs them, without
    the optimizer's update (``optimizer_s``); ``compute_s`` / ``comm_s``: the compute and the
    collectives in it (overlapped, so they need not add up); ``forward_s``: its forward part;
    ``peak_memory_bytes`` and its ``state_bytes`` (parameters, gradients, optimizer states);
    ``saved_bytes``: the values held from the forward into the backward (what each further
    pipeline microbatch in flight adds); ``held_bytes``: what a pipeline stage holds while
    another stage of its rank runs (the rest of its peak is not alive then); ``ahead_bytes``:
    a ZeRO-3 pipeline stage's gather in flight while the action before it computes (in its peak,
    beside its own gathered copy); ``ilp_objective_s``: the intra-operator ILP's objective; ``model_flops`` / ``mfu``: the
    model's FLOPs per step and the utilisation they give; ``bubble_fraction``: a pipeline's idle
    share; ``search_step_time_s`` / ``search_peak_memory_bytes``: the setup search's closed-form
    price of the chosen setup (with the optimizer), next to the per-operator one.
    """

    step_time_s: float
    compute_s: float | None = None
    comm_s: float | None = None
    optimizer_s: float | None = None
    peak_memory_bytes: float | None = None
    forward_s: float | None = None
    state_bytes: float | None = None
    saved_bytes: float | None = None
    held_bytes: float | None = None
    ahead_bytes: float | None = None
    ilp_objective_s: float | None = None
    model_flops: float | None = None
    mfu: float | None = None
    bubble_fraction: float | None = None
    search_step_time_s: float | None = None
    search_peak_memory_bytes: float | None = None
    extra: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, eq=True)
class PipelinePrediction(_Fields):
    """The schedule's part of a pipelined plan's prediction (a read-only mapping too).

    ``step_time_s`` and ``bubble_fraction`` of the simulated schedule; per stage
    ``stage_time_s`` (forward and backward of one microbatch) and ``stage_memory_bytes``; per
    pipeline rank ``peak_memory_bytes``; ``p2p_s``: one boundary send; ``weight_fraction``: the
    share of a backward computing weight gradients (zero-bubble); ``search_estimate_s``: the
    setup's price before its stages were solved.
    """

    step_time_s: float
    bubble_fraction: float | None = None
    stage_time_s: tuple[float, ...] | None = None
    peak_memory_bytes: tuple[float, ...] | None = None
    stage_memory_bytes: tuple[float, ...] | None = None
    p2p_s: float | None = None
    weight_fraction: float | None = None
    search_estimate_s: float | None = None
    extra: tuple[tuple[str, Any], ...] = ()


def _json_fields(p: Mapping[str, Any]) -> dict[str, Any]:
    """A prediction's set fields as JSON values (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in p.items()}


@dataclass(frozen=True)
class Collective:
    """One collective of a training step.

    ``bytes``: per rank, the unsharded-on-this-axis buffer (all-reduced tensor, all-gather output,
    reduce-scatter input). ``layer``: module path of the layer that needs it (``blocks.3``; ``""``
    outside repeated layers). ``node``: the graph node whose input (or the output) it feeds.
    ``stage``: in a pipelined plan, the pipeline stage whose ranks issue it (``None`` for a
    collective over the ``pp`` axis, issued by every pipeline rank).
    """

    kind: str
    axis: str
    bytes: int
    phase: str
    layer: str
    node: str
    stage: int | None = None


@dataclass(frozen=True)
class NodePlan:
    """Chosen placements of one node: outputs and required inputs, in text form per mesh axis.

    ``op``: the aten op (``aten.mm``), ``module``: the innermost module path that ran it
    (``blocks.0.attn.qkv``; ``""`` outside any submodule), ``layer``: its repeated layer
    (``blocks.0``; ``""`` outside them), ``phase``: ``"forward"`` or ``"backward"``.
    ``compute_s``: its predicted compute seconds per step on one device; ``comm_s``: the
    predicted seconds of the collectives that bring its inputs to the placements it needs (and
    a graph output it computes to its final placement).
    """

    outputs: tuple[tuple[str, ...] | None, ...]
    inputs: tuple[tuple[str, ...], ...]
    op: str = ""
    module: str = ""
    layer: str = ""
    phase: str = ""
    compute_s: float = 0.0
    comm_s: float = 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NodePlan":
        """Inverse of ``dataclasses.asdict`` (plans saved before the cost fields load too)."""
        t = lambda x: tuple(x) if x is not None else None  # noqa: E731
        return cls(tuple(t(o) for o in d["outputs"]), tuple(tuple(i) for i in d["inputs"]),
                   str(d.get("op", "")), str(d.get("module", "")), str(d.get("layer", "")),
                   str(d.get("phase", "")), float(d.get("compute_s", 0.0)),
                   float(d.get("comm_s", 0.0)))


@dataclass(frozen=True)
class PipelinePlan:
    """The pipeline part of a plan (``degrees["pp"] > 1``).

    Attributes:
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` or ``"zero-bubble"``.
        microbatches / microbatch_size: ``m`` microbatches of ``microbatch_size`` samples each.
        virtual_stages: stages (model chunks) per pipeline rank; stage ``j`` runs on rank
            ``j % pp``.
        units: the layer units in order (``pre``: before the repeated blocks, each block,
            ``post``: after them); ``stage_of_unit[i]`` is the stage of ``units[i]``.
        stages: one intra-operator plan per stage, on the (dp, tp) submesh, for one microbatch.
        predicted: ``step_time_s``, ``bubble_fraction``, per-stage ``stage_time_s`` list and
            per-rank ``peak_memory_bytes`` list.
        cut_solver: status, backend and solve time of the stage-cut solver.
    """

    schedule: str
    microbatches: int
    microbatch_size: int
    virtual_stages: int
    units: tuple[str, ...]
    stage_of_unit: tuple[int, ...]
    stages: tuple["Plan", ...] = field(repr=False)
    predicted: PipelinePrediction = field(default_factory=lambda: PipelinePrediction(0.0))
    cut_solver: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "predicted", PipelinePrediction.of(self.predicted))

    @property
    def num_stages(self) -> int:
        """Number of stages (pipeline ranks times virtual stages)."""
        return max(self.stage_of_unit) + 1 if self.stage_of_unit else len(self.stages)

    def stage_units(self, stage: int) -> tuple[str, ...]:
        """The layer units of ``stage``."""
        return tuple(u for u, s in zip(self.units, self.stage_of_unit) if s == stage)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PipelinePlan":
        """Inverse of ``dataclasses.asdict`` (called by :meth:`Plan.from_dict`)."""
        return cls(d["schedule"], int(d["microbatches"]), int(d["microbatch_size"]),
                   int(d["virtual_stages"]), tuple(d["units"]), tuple(d["stage_of_unit"]),
                   tuple(Plan.from_dict({**s, "format": PLAN_FORMAT}) for s in d["stages"]),
                   PipelinePrediction.of(d.get("predicted") or {"step_time_s": 0.0}, lenient=True),
                   dict(d.get("cut_solver", {})))


@dataclass(frozen=True)
class Plan:
    """A complete parallelization plan for one model, mesh and config.

    Attributes:
        degrees: ``{"dp": .., "tp": .., "pp": .., "cp": .., "ep": ..}`` (each present, 1 when
            unused; ep's ranks are data-parallel ranks too, counted in dp).
        mesh_shape / axis_names: the logical mesh the plan runs on (row-major over ranks).
        params: parameter name -> placement per axis (e.g. ``("R", "S(0)")``).
        inputs: placement per flattened user input.
        output_placements: placement of each joint-graph output (loss replicated, gradients in
            their parameter's placement; ``None`` for outputs that are not computed).
        nodes: joint-graph node name -> :class:`NodePlan`.
        collectives: every collective of one step, in execution order.
        grad_buckets: output indices of the parameter gradients reduced together, one
            all-reduce per bucket, in the order they are issued (:mod:`autopar.planning.buckets`).
        predicted: ``step_time_s``, ``compute_s``, ``comm_s``, ``peak_memory_bytes`` (per device).
        solver: status, gap, backend, solve time, variable counts.
        warnings: ops replicated for lack of a rule, solver time limits, ...
        model_fingerprint: hash of the traced graph; a plan only applies to that model.
        pipeline: stages, schedule and microbatches when ``degrees["pp"] > 1`` (then
            ``mesh_shape`` starts with the ``pp`` axis, ``nodes`` is empty and each stage's
            per-node choices are in ``pipeline.stages``), else ``None``.
        techniques: the memory and communication techniques the plan uses: ``recompute``
            (``"none"``, ``"selective"``, ``"full"``), ``zero`` (0, 1 or 3), ``sequence_parallel``
            (whether the layer norms run sharded on the sequence dim over tp),
            ``mixed_precision`` (``"bf16-autocast"`` or the parameters' dtype); the cluster
            search adds the microbatch size and count.
        alternatives: the next best setups the search found, each with its predicted
            ``step_time_s``.
    """

    model_fingerprint: str
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    degrees: dict[str, int]
    params: dict[str, tuple[str, ...]]
    inputs: tuple[tuple[str, ...], ...]
    output_placements: tuple[tuple[str, ...] | None, ...]
    nodes: dict[str, NodePlan] = field(repr=False)
    collectives: tuple[Collective, ...] = field(repr=False)
    predicted: Prediction
    solver: dict[str, Any]
    warnings: tuple[str, ...]
    topology: str
    config: dict[str, Any]
    input_shapes: tuple[tuple[int, ...], ...] = ()
    alternatives: tuple[dict[str, Any], ...] = ()
    pipeline: PipelinePlan | None = None
    techniques: dict[str, Any] = field(default_factory=dict)
    grad_buckets: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "predicted", Prediction.of(self.predicted))
        # every plan names every degree (1 when unused); plans saved before cp existed load
        object.__setattr__(self, "degrees", {**dict.fromkeys(DEGREES, 1), **self.degrees})

    # ---- pictures ----------------------------------------------------------------------------
    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write the simulated step (per pipeline rank: each microbatch's forward and backward,
        and the point-to-point sends) as Chrome trace JSON, for Perfetto or chrome://tracing."""
        from autopar.report.timeline import to_chrome_trace

        return to_chrome_trace(self, path)

    def to_svg(self, path: str | Path) -> Path:
        """Write the simulated step as an SVG timeline that opens in a browser."""
        from autopar.report.timeline import to_svg

        return to_svg(self, path)

    def explain(self, target: str | None = None, max_nodes: int = 4,
                max_alternatives: int = 6) -> Any:
        """Why the solver placed ``target`` as it did: each strategy of its node with its
        compute, communication and memory, every other node held at its choice (see
        :mod:`autopar.report.explain`). ``target``: a node name (``plan.operator_table(expand=True)``),
        a parameter name, or a module or layer path (its costliest ``max_nodes`` nodes).
        Without a target, the setups (degrees, techniques) the planner compared.

        Needs a plan made in this process by :func:`autopar.plan`; print the result.
        """
        from autopar.report.explain import explain

        return explain(self, target, max_nodes, max_alternatives)

    # ---- persistence -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (``format`` versioned)."""
        d = asdict(self)
        d["predicted"] = _json_fields(self.predicted)
        if self.pipeline is not None:
            d["pipeline"]["predicted"] = _json_fields(self.pipeline.predicted)
            d["pipeline"]["stages"] = [s.to_dict() for s in self.pipeline.stages]
        d["format"] = PLAN_FORMAT
        return d

    def to_json(self) -> str:
        """JSON text of :meth:`to_dict`."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON to ``path``."""
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        """Inverse of :meth:`to_dict`; raises :class:`PlanError` on a malformed plan."""
        try:
            if d.get("format") not in (1, PLAN_FORMAT):
                raise PlanError(f"plan format {d.get('format')!r}, this autopar reads 1 and {PLAN_FORMAT}")
            t = lambda x: tuple(x) if x is not None else None  # noqa: E731
            return cls(
                model_fingerprint=d["model_fingerprint"], mesh_shape=tuple(d["mesh_shape"]),
                axis_names=tuple(d["axis_names"]), degrees=dict(d["degrees"]),
                params={k: tuple(v) for k, v in d["params"].items()},
                inputs=tuple(tuple(x) for x in d["inputs"]),
                output_placements=tuple(t(o) for o in d["output_placements"]),
                nodes={k: NodePlan.from_dict(v) for k, v in d["nodes"].items()},
                collectives=tuple(Collective(**c) for c in d["collectives"]),
                predicted=Prediction.of(d["predicted"], lenient=True), solver=dict(d["solver"]),
                warnings=tuple(d["warnings"]), topology=d["topology"], config=dict(d["config"]),
                input_shapes=tuple(tuple(s) for s in d.get("input_shapes", ())),
                alternatives=tuple(_alternative(a) for a in d.get("alternatives", ())),
                pipeline=PipelinePlan.from_dict(d["pipeline"]) if d.get("pipeline") else None,
                techniques=dict(d.get("techniques", {})),
                grad_buckets=tuple(tuple(b) for b in d.get("grad_buckets", ())),
            )
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"malformed plan ({type(e).__name__}: {e}); re-create it with autopar.plan(...)") from e

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """Read a plan saved by :meth:`save`; a corrupt file raises :class:`PlanError`."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(f"cannot read plan file {str(path)!r}: {e}") from e
        return cls.from_dict(data)

    def digest(self) -> str:
        """Hash of what the ranks execute (placements, collectives, degrees), not of timings."""
        import hashlib

        d = self.to_dict()
        keep = {k: d[k] for k in ("model_fingerprint", "mesh_shape", "axis_names", "degrees",
                                  "params", "inputs", "output_placements", "collectives",
                                  "grad_buckets")}
        keep["nodes"] = {k: [v["outputs"], v["inputs"]] for k, v in d["nodes"].items()}
        if self.pipeline is not None:
            p = d["pipeline"]
            keep["pipeline"] = [p["schedule"], p["microbatches"], p["virtual_stages"],
                                p["stage_of_unit"], [Plan.from_dict({**s, "format": PLAN_FORMAT}).digest()
                                                     for s in p["stages"]]]
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()

    # ---- views -------------------------------------------------------------------------------
    def step_breakdown(self) -> dict[str, float]:
        """The predicted training step, split into ``compute_s``, ``exposed_comm_s`` (the
        collectives and pipeline sends no compute hides), ``bubble_s`` (pipeline fill and
        drain), ``optimizer_s`` (the optimizer's update); ``total_s`` is their sum.

        ``predicted["step_time_s"]`` is the forward and backward as ``pmodel.step()`` runs them
        (the optimizer is the user's ``opt.step()``); ``total_s`` includes the optimizer (so did
        the step of a planning view saved by an earlier ``autopar.search``).
        """
        p = self.predicted
        step, opt = p.get("step_time_s", 0.0), p.get("optimizer_s", 0.0)
        if self.solver.get("status") == "search":
            total, bubble = step, p.get("bubble_s", 0.0)
        else:
            total, bubble = step + opt, 0.0
            if self.pipeline is not None:  # the busiest rank's idle time ([MEG] sec. 2.2)
                times, pp = self.pipeline.predicted.get("stage_time_s", []), self.degrees["pp"]
                busy = self.pipeline.microbatches * max(
                    (sum(times[r::pp]) for r in range(pp)), default=0.0)
                # the fill and the drain each wait for pp - 1 sends of a microbatch's
                # activations (gradients): exposed communication, not idle compute
                sends = min(max(step - busy, 0.0),
                            2 * (pp - 1) * self.pipeline.predicted.get("p2p_s", 0.0))
                bubble = max(step - busy - sends, 0.0)
        compute = p.get("compute_s", 0.0)
        return {"compute_s": compute, "exposed_comm_s": max(total - compute - bubble - opt, 0.0),
                "bubble_s": bubble, "optimizer_s": opt, "total_s": total}

    def operator_table(self, expand: bool | Sequence[str] = False) -> str:
        """Per operator: its placements per mesh axis and predicted compute and communication
        milliseconds per step (:func:`autopar.report.tables.operator_table`)."""
        from autopar.report.tables import operator_table

        return operator_table(self, expand)

    def _collectives_of(self, phase: str | None, axis: str | None, pp_rank: int | None
                        ) -> list[Collective]:
        """The collectives of one phase, axis and/or pipeline rank (``None``: all). A
        pipeline rank's are its stages' collectives and those over the ``pp`` axis."""
        def mine(c: Collective) -> bool:
            if pp_rank is None or c.stage is None or self.pipeline is None:
                return True
            return c.stage % self.degrees["pp"] == pp_rank

        return [c for c in self.collectives
                if (phase is None or c.phase == phase) and (axis is None or c.axis == axis) and mine(c)]

    def collective_counts(self, phase: str | None = None, axis: str | None = None,
                          pp_rank: int | None = None) -> Counter:
        """Count collectives by kind, optionally for one phase, axis and/or pipeline rank.

        ``pp_rank`` keeps what the ranks of that pipeline rank issue: their stages' collectives
        and those over the ``pp`` axis.
        """
        return Counter(c.kind for c in self._collectives_of(phase, axis, pp_rank))

    def collective_bytes(self, phase: str | None = None, axis: str | None = None,
                         pp_rank: int | None = None) -> Counter:
        """Bytes per rank and step by collective kind (see :class:`Collective` for what a
        collective's bytes are), filtered as :meth:`collective_counts`;
        :class:`autopar.runtime.profile.CommMeter` measures the same quantity."""
        out: Counter = Counter()
        for c in self._collectives_of(phase, axis, pp_rank):
            out[c.kind] += c.bytes
        return out

    def compare(self, other: "Plan") -> str:
        """What differs between this plan and ``other`` (:func:`autopar.report.tables.compare`)."""
        from autopar.report.tables import compare

        return compare(self, other)

    def __str__(self) -> str:
        from autopar.report.tables import render

        return render(self)
