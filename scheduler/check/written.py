"""Check: a schedule written back, judged on the graph it gives, and the one installed.

What is written back is what counts. :func:`write_and_judge` writes a schedule back on a copy
of the graph and judges the copy as written (:func:`judge_graph`): re-exported with the cost
model and simulated in its node order, its peak memory taken by the re-export's simulation and
by the reference liveness count (:func:`scheduler.check.judge.liveness_peak`): the memory the written
graph holds, and what the budget bounds. torch's ``MemoryTracker`` rules (a collective's input
freed at the collective, every wait's result a fresh storage) are counted too and reported, not
held: a wait returns its input, so the fresh storage is the estimator's, not the GPU's; and
torch's own ``MemoryTracker`` tells storages apart by their FakeTensors, so it takes a
recomputed copy (to which torch's remat passes give the forward original's FakeTensor) for an
alias of the original and keeps the original alive through the backward: held, it refused
every budget on joint graphs with selective checkpointing, their own peak included.
:func:`choose` takes the
search's schedule, then its next best starts, then the graph as traced, and keeps the first
whose written graph holds the budget by both counts it holds (the re-export's and the
liveness count). The search evaluates schedules on the
simulator, whose step time and memory counts equal those of the written graph; a written
graph over the budget is therefore rare, and the next candidate (never a slower one than the
traced order) is the answer, with the reason in the report.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from scheduler.check.judge import liveness_peak
from scheduler.export.dag import export_dag
from scheduler.writeback import apply_schedule, copy_module, require_group_for_merges
from solvers.core import InfeasibleBudgetError, Problem, Schedule, ScheduleError, fmt_bytes, simulate

if TYPE_CHECKING:
    import torch.fx

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# judging a written graph
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class Figures:
    """A rewritten graph as judged on itself (times in ms, memory in bytes)."""

    #: re-exported step time under the primary cost model
    step_ms: float
    #: peak of the re-export simulated as written
    peak_bytes: int
    #: reference liveness count of the rewritten graph
    liveness_peak_bytes: int
    #: torch's MemoryTracker rules on the rewritten graph, read from its structure (the
    #: re-export simulated): reported, not held (module docstring)
    tracker_peak_bytes: int
    n_collectives: int
    exposed_comm_ms: float

    @property
    def max_peak_bytes(self) -> int:
        """The larger of the re-export's and the liveness count's peaks: what a budget holds."""
        return max(self.peak_bytes, self.liveness_peak_bytes)

    @property
    def decided_by(self) -> str:
        """Which count the budget is held by (the larger)."""
        return "liveness" if self.liveness_peak_bytes > self.peak_bytes else "re-export"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def judge_graph(gm: "torch.fx.GraphModule", cost_model: Any = None, cluster: Any = None,
                split_groups: tuple[str, ...] = ()) -> Figures:
    """Judge ``gm`` as written: re-export it with ``cost_model`` on ``cluster`` and simulate it
    in its node order (step time, its peak by the execution model and by torch's tracker rules);
    take its liveness peak. ``split_groups``: groups whose all-gathers the installed graph will
    run on a second group (:attr:`Schedule.split_groups`), priced so although ``gm`` keeps them
    on their group."""
    # the traced graph's export said what the cost model priced from its data
    problem = Problem.from_dag(export_dag(gm, cost_model=cost_model, cluster=cluster, coverage_check=None))
    sim = simulate(problem.dag, problem.traced_schedule().with_split(split_groups), problem=problem)
    return Figures(step_ms=sim.step_ms, peak_bytes=sim.peak_bytes, liveness_peak_bytes=liveness_peak(gm),
                   tracker_peak_bytes=sim.tracker_peak_bytes, n_collectives=sim.n_collectives,
                   exposed_comm_ms=sim.exposed_comm_ms)


def graph_digest(gm: "torch.fx.GraphModule | torch.fx.Graph") -> str:
    """sha256 of a graph's node sequence: each node's op, target and arguments, with nodes
    named by position (equal graphs give equal digests whatever their node names)."""
    import torch.fx

    graph = getattr(gm, "graph", gm)
    index: dict[torch.fx.Node, int] = {}
    h = hashlib.sha256()

    def arg(a: Any) -> Any:
        return f"%{index.get(a, -1)}" if isinstance(a, torch.fx.Node) else a

    for i, n in enumerate(graph.nodes):
        index[n] = i
        args = torch.fx.node.map_aggregate((n.args, n.kwargs), arg)
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", repr(n.target))
        h.update(f"{n.op}|{getattr(n.target, '__module__', '')}.{target}|{args!r}\n".encode())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# the choice
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(kw_only=True)
class Candidate:
    """A schedule over the traced graph's problem, and how its written graph was judged."""

    name: str
    schedule: Schedule
    figures: Figures | None = None
    #: why it was not installed (None for the chosen one)
    dropped: str | None = None
    #: the copy of the graph it was written on and judged on (:func:`written_and_judged`), kept
    #: for the chosen one only; None for the traced order
    written: "torch.fx.GraphModule | None" = None

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "digest": self.schedule.digest(),
                "figures": self.figures.to_json() if self.figures else None,
                "peak_decided_by": self.figures.decided_by if self.figures else None, "dropped": self.dropped}


def write_and_judge(gm: "torch.fx.GraphModule", problem: Problem, schedule: Schedule, *, cost_model: Any,
                    cluster: Any, payload_order: str, control_deps: bool) -> Figures:
    """``schedule`` written back on a copy of ``gm`` and judged there (:func:`written_and_judged`),
    its figures."""
    return written_and_judged(gm, problem, schedule, cost_model=cost_model, cluster=cluster,
                              payload_order=payload_order, control_deps=control_deps)[0]


def written_and_judged(gm: "torch.fx.GraphModule", problem: Problem, schedule: Schedule, *, cost_model: Any,
                       cluster: Any, payload_order: str, control_deps: bool
                       ) -> tuple[Figures, "torch.fx.GraphModule | None"]:
    """``schedule`` written back on a copy of ``gm`` (without control dependencies: a pinned
    graph cannot be re-exported, and pins change no order; all-gathers left on their group: a
    second group is made only at install, :func:`scheduler.writeback.second_group`) and judged
    there, its split groups priced as split; returns the figures and the copy, which
    :func:`scheduler.writeback.install_schedule` installs as it is. The traced order is ``gm``
    itself, judged as it is (nothing written, no copy: None): installing it changes nothing, so
    its figures are the graph's own peak by the counts that judge every candidate."""
    if schedule.digest() == problem.traced_schedule().digest():
        return judge_graph(gm, cost_model, cluster), None
    written = copy_module(gm)
    apply_schedule(written, problem, schedule, payload_order=payload_order, control_deps=False,
                   move_all_gathers=False)
    return judge_graph(written, cost_model, cluster, schedule.split_groups), written


def choose(gm: "torch.fx.GraphModule", problem: Problem, ranked: Sequence[tuple[str, Schedule]],
           mem_budget_bytes: int | None, *, cost_model: Any, cluster: Any, payload_order: str,
           control_deps: bool) -> tuple[Candidate, list[Candidate]]:
    """The first of ``ranked`` (name, schedule), then the graph as traced, whose written graph
    holds ``mem_budget_bytes`` (:attr:`Figures.max_peak_bytes`). Returns it and every candidate
    judged.

    Raises:
        InfeasibleBudgetError: no written graph holds the budget (the smallest peak found).
        ScheduleError: no candidate could be written back and judged.
    """
    # without a process group every candidate with a merge would fail to be written, and the
    # graph be left almost as traced: say so at once, before anything is written
    for _, schedule in ranked:
        require_group_for_merges(schedule)
    traced = problem.traced_schedule()
    seen: set[str] = set()
    judged: list[Candidate] = []
    for name, schedule in [*ranked, ("traced", traced)]:
        if schedule.digest() in seen:
            continue
        seen.add(schedule.digest())
        c = Candidate(name=name, schedule=schedule)
        judged.append(c)
        try:
            c.figures, written = written_and_judged(gm, problem, schedule, cost_model=cost_model, cluster=cluster,
                                                    payload_order=payload_order, control_deps=control_deps)
        except (ScheduleError, ValueError, RuntimeError) as e:
            c.dropped = f"not written back: {type(e).__name__}: {e}"
            logger.warning("fsdp-sched: candidate %s could not be written back: %s", name, e)
            continue
        if mem_budget_bytes is not None and c.figures.max_peak_bytes > mem_budget_bytes:
            c.dropped = (f"its written graph peaks at {fmt_bytes(c.figures.max_peak_bytes)} by "
                         f"{c.figures.decided_by} ({_counts(c.figures)}), over the budget")
            logger.warning("fsdp-sched: candidate %s dropped: %s", name, c.dropped)
            continue
        c.written = written
        return c, judged
    fitted = [c for c in judged if c.figures is not None]
    if not fitted:
        raise ScheduleError("no candidate could be written back and judged: "
                            + "; ".join(f"{c.name}: {c.dropped}" for c in judged))
    least = min(fitted, key=lambda c: c.figures.max_peak_bytes)
    peak = least.figures.max_peak_bytes
    raise InfeasibleBudgetError(
        f"no rewritten graph keeps peak memory under {fmt_bytes(mem_budget_bytes or 0)} ({mem_budget_bytes} B) by "
        f"the re-export and the liveness count; the smallest is {fmt_bytes(peak)} ({peak} B, "
        f"{least.name}): raise mem_budget to at least that", mem_budget_bytes=mem_budget_bytes or 0,
        min_peak_bytes=peak)


def _counts(f: Figures) -> str:
    return (f"re-export {fmt_bytes(f.peak_bytes)}, liveness {fmt_bytes(f.liveness_peak_bytes)}, "
            f"torch's tracker rules {fmt_bytes(f.tracker_peak_bytes)}")
