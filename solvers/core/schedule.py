"""The plain-data result types shared by every solver, heuristic, the simulator and write-back.

A :class:`Schedule` says, for one graph, which collectives are merged into buckets and where
every bucket is issued and waited relative to the compute nodes. It refers to DAG nodes by
name only, so it is JSON-serialisable and identical on every rank for the identical graph.

Positions are *gaps* of the compute sequence ``seq`` (the DAG's schedulable compute and view
nodes in execution order, see :mod:`solvers.core.problem`): gap ``p`` lies just before ``seq[p]``;
gap ``len(seq)`` is the end of the graph, just before its output. Inside one gap, steps run in
the order the schedule lists them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from typing import Any


class ScheduleError(RuntimeError):
    """A schedule could not be produced; the message says what to change."""


class InfeasibleBudgetError(ScheduleError):
    """No schedule of the graph keeps peak memory under the requested budget.

    ``mem_budget_bytes`` is that budget; ``min_peak_bytes`` the smallest peak any schedule in
    the search space reaches (as found by the solver), so that the caller can raise the budget
    to at least that value; ``least_peak_bytes`` a peak no schedule goes below, where it is
    known (:meth:`solvers.core.peaks.MemoryModel.least_peak`: a budget under it cannot hold);
    ``stages`` the :class:`StageRecord` s of the work done before the refusal (the search's
    starts), for a report that goes on without them.
    """

    def __init__(self, message: str, *, mem_budget_bytes: int, min_peak_bytes: int | None,
                 least_peak_bytes: int | None = None):
        super().__init__(message)
        self.mem_budget_bytes = mem_budget_bytes
        self.min_peak_bytes = min_peak_bytes
        self.least_peak_bytes = least_peak_bytes
        self.stages: list[StageRecord] = []

    @property
    def budget_bytes(self) -> int:
        """Deprecated name of :attr:`mem_budget_bytes` (for one release)."""
        warnings.warn("InfeasibleBudgetError.budget_bytes is deprecated and will be removed in the next release: use "
                      "InfeasibleBudgetError.mem_budget_bytes", DeprecationWarning, stacklevel=2)
        return self.mem_budget_bytes


class SolveStatus(str, Enum):
    """Outcome of a solve, comparable across solvers and heuristics."""

    OPTIMAL = "optimal"  #: proven optimal for the solver's model
    FEASIBLE = "feasible"  #: valid, optimality not proven (limit reached)
    HEURISTIC = "heuristic"  #: produced by a heuristic, no optimality claim
    FALLBACK = "fallback"  #: the solver failed or timed out; a heuristic schedule is returned


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One merged collective.

    Attributes:
        members: DAG names of the collectives merged into this bucket, in payload order
            (the order of their data in the bucket buffer). All share type, process group,
            dtype and (reduce-scatter) reduce op. A single member means "not merged".
    """

    members: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("a bucket needs at least one collective")
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"bucket lists a collective twice: {self.members}")


@dataclasses.dataclass(frozen=True)
class Step:
    """One entry of a schedule's execution order.

    ``kind`` is ``"node"`` (``ref`` = a DAG compute or view node name), ``"issue"`` or
    ``"wait"`` (``ref`` = index of the bucket in :attr:`Schedule.buckets`).
    """

    kind: str
    ref: str | int

    def __post_init__(self) -> None:
        if self.kind == "node":
            if not isinstance(self.ref, str):
                raise ValueError(f"node step needs a node name, got {self.ref!r}")
        elif self.kind in ("issue", "wait"):
            if not isinstance(self.ref, int):
                raise ValueError(f"{self.kind} step needs a bucket index, got {self.ref!r}")
        else:
            raise ValueError(f"unknown step kind {self.kind!r}; use 'node', 'issue' or 'wait'")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Buckets plus the full execution order of compute nodes, bucket issues and waits.

    Attributes:
        buckets: every modelled collective of the graph appears in exactly one bucket.
        steps: execution order. Each bucket is issued once and waited once, after its issue.
            Node steps list the schedulable compute/view nodes; collectives' prologue nodes
            (casts and views that only feed one collective) run with the bucket's issue and
            are not listed.
        split_groups: process groups whose all-gathers run on a second process group of the
            same ranks, a stream of their own beside the group's other collectives (sorted;
            :mod:`solvers.core.streams` prices the link they share, the write-back moves the
            all-gathers to that group). Empty: every collective runs on its own group.
    """

    buckets: tuple[Bucket, ...]
    steps: tuple[Step, ...]
    split_groups: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if tuple(sorted(set(self.split_groups))) != tuple(self.split_groups):
            raise ValueError(f"split_groups must be sorted and distinct, got {self.split_groups!r}")

    def with_split(self, split_groups: Sequence[str]) -> "Schedule":
        """This schedule with the all-gathers of ``split_groups`` on a second stream (none:
        every collective on its own group)."""
        split = tuple(sorted(set(split_groups)))
        return self if split == self.split_groups else Schedule(self.buckets, self.steps, split)

    @staticmethod
    def from_positions(
        seq: Sequence[str],
        buckets: Sequence[Bucket],
        issue_at: Sequence[int],
        wait_at: Sequence[int],
        *,
        after: Mapping[int, Iterable[int]] | None = None,
    ) -> "Schedule":
        """Build a schedule from gap positions (see module docstring).

        Inside a gap: first the waits of buckets issued in earlier gaps, then the issues, then
        the waits of buckets issued in this gap (each in bucket order). Waiting first frees
        reduce-scatter inputs before new buckets allocate; on one FIFO stream it costs no
        communication time, since the waited bucket finishes before a newly issued one could
        start anyway. ``after`` (bucket -> buckets whose result its issue reads, as
        :meth:`solvers.core.problem.Problem.schedule_at` gives it) overrides that order where
        they share a gap: the issue follows those waits.
        """
        n = len(seq)
        if not (len(buckets) == len(issue_at) == len(wait_at)):
            raise ValueError("buckets, issue_at and wait_at must have the same length")
        # (gap, phase, bucket): in a gap the waits of buckets issued before it, then the issues,
        # then the waits of buckets issued in it, each in bucket order, unless ``after`` orders
        # an issue after a wait of the same gap
        events: list[tuple[int, int, int]] = []
        for b, (i, w) in enumerate(zip(issue_at, wait_at)):
            if not (0 <= i <= w <= n):
                raise ValueError(f"bucket {b}: need 0 <= issue_at ({i}) <= wait_at ({w}) <= {n}")
            events.append((i, 1, b))
            events.append((w, 2 if i == w else 0, b))
        events.sort()
        nodes = _node_steps(seq)
        reading = gaps_reading_in_gap(issue_at, wait_at, after) if after else set()
        steps: list[Step] = []
        at, k = 0, 0
        while k < len(events):
            gap = events[k][0]
            end = k
            while end < len(events) and events[end][0] == gap:
                end += 1
            steps.extend(nodes[at:gap])
            at = gap
            group = events[k:end]
            if gap in reading:
                steps.extend(order_gap([("issue" if ph == 1 else "wait", b) for _, ph, b in group],
                                       lambda e: (1 if e[0] == "issue" else (2 if issue_at[e[1]] == wait_at[e[1]] else 0),
                                                  e[1]), after))
            else:
                steps.extend(Step("issue" if ph == 1 else "wait", b) for _, ph, b in group)
            k = end
        steps.extend(nodes[at:])
        return Schedule(tuple(buckets), tuple(steps))

    def positions(self) -> tuple[list[int], list[int]]:
        """Gap index of every bucket's issue and wait (number of node steps before it)."""
        issue = [-1] * len(self.buckets)
        wait = [-1] * len(self.buckets)
        nodes_seen = 0
        for s in self.steps:
            if s.kind == "node":
                nodes_seen += 1
            elif s.kind == "issue":
                issue[s.ref] = nodes_seen  # type: ignore[index]
            else:
                wait[s.ref] = nodes_seen  # type: ignore[index]
        return issue, wait

    def node_order(self) -> list[str]:
        return [s.ref for s in self.steps if s.kind == "node"]  # type: ignore[misc]

    # --- serialisation -------------------------------------------------------------------
    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "buckets": [list(b.members) for b in self.buckets],
            "steps": [[s.kind, s.ref] for s in self.steps],
        }
        if self.split_groups:  # absent when empty: a schedule that splits nothing hashes as before
            out["split_groups"] = list(self.split_groups)
        return out

    @staticmethod
    def from_json(data: dict) -> "Schedule":
        try:
            buckets = tuple(Bucket(tuple(m)) for m in data["buckets"])
            steps = tuple(Step(k, r) for k, r in data["steps"])
            split = tuple(str(g) for g in data.get("split_groups", ()))
            return Schedule(buckets, steps, split)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a schedule JSON object ({e}); expected keys 'buckets', 'steps' and optionally "
                             "'split_groups'") from e

    def digest(self) -> str:
        """A stable hash of the schedule: equal on every rank iff the schedules are equal."""
        cached = self.__dict__.get("_digest")
        if cached is None:  # a schedule never changes: hash it once
            payload = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
            cached = hashlib.sha256(payload.encode()).hexdigest()
            object.__setattr__(self, "_digest", cached)
        return cached

    def bucket_of(self) -> dict[str, int]:
        """Map collective name -> index of its bucket."""
        return {m: i for i, b in enumerate(self.buckets) for m in b.members}


#: node steps of the sequences schedules were built over lately (a schedule's node steps are the
#: same objects for every schedule of one problem): id(seq) -> (seq, steps)
_NODE_STEPS: dict[int, tuple[Sequence[str], tuple[Step, ...]]] = {}


def _node_steps(seq: Sequence[str]) -> tuple[Step, ...]:
    cached = _NODE_STEPS.get(id(seq))
    if cached is None or cached[0] is not seq or len(cached[1]) != len(seq) or (seq and (
            cached[1][0].ref != seq[0] or cached[1][-1].ref != seq[-1])):
        if len(_NODE_STEPS) >= 64:
            _NODE_STEPS.clear()
        cached = _NODE_STEPS[id(seq)] = (seq, tuple(Step("node", name) for name in seq))
    return cached[1]


def gaps_reading_in_gap(issue_at: Mapping[int, int] | Sequence[int], wait_at: Mapping[int, int] | Sequence[int],
                        after: Mapping[int, Iterable[int]]) -> set[int]:
    """The gaps in which a bucket is issued that reads the result of a bucket waited in the same
    gap (``issue_at`` / ``wait_at``: each bucket's gaps; ``after``: bucket -> the buckets whose
    results its issue reads). In any other gap :func:`order_gap` orders the steps as they are
    sorted (its priority is their phase, then their bucket), so it need not run."""
    return {issue_at[b] for b, ds in after.items() if any(d != b and wait_at[d] == issue_at[b] for d in ds)}


def order_gap(
    events: Sequence[tuple[str, int]],
    priority: Callable[[tuple[str, int]], Any],
    after: Mapping[int, Iterable[int]],
) -> list[Step]:
    """The issue and wait steps of one gap (events ``(kind, bucket)``) in the order of
    ``priority`` (smallest first) among the steps whose dependencies ran: a bucket's wait
    follows its issue, and its issue the waits of the buckets ``after[bucket]`` in this gap.

    Raises:
        ValueError: the dependencies form a cycle (an inconsistent graph).
    """
    present = set(events)
    preds: dict[tuple[str, int], set[tuple[str, int]]] = {e: set() for e in events}
    for e in events:
        kind, b = e
        if kind == "wait" and ("issue", b) in present:
            preds[e].add(("issue", b))
        if kind == "issue":
            preds[e] |= {("wait", d) for d in after.get(b, ()) if d != b and ("wait", d) in present}
    succs: dict[tuple[str, int], list[tuple[str, int]]] = {e: [] for e in events}
    for e, ps in preds.items():
        for q in ps:
            succs[q].append(e)
    indeg = {e: len(ps) for e, ps in preds.items()}
    heap = [(priority(e), e) for e in events if indeg[e] == 0]
    heapq.heapify(heap)
    out: list[Step] = []
    while heap:
        _, e = heapq.heappop(heap)
        out.append(Step(e[0], e[1]))
        for s in succs[e]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, (priority(s), s))
    if len(out) != len(events):
        raise ValueError("collectives of one gap depend on each other in a cycle")
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageRecord:
    """One row of a solve's stage table, the stage as it ran: what tests and benchmarks read of a solve
    (:attr:`SolveResult.stages`, ``ScheduleReport.stages``), never a note's wording."""

    #: the stage's name in the stage table (``"torch"``, ``"starts"``, ``"search"``, ``"repair"``,
    #: ``"polish"``, ``"judge"``, ...; see :mod:`solvers.search`, :mod:`scheduler.torch_overlap`
    #: and :mod:`scheduler.check.written`)
    name: str
    #: wall time of the stage (s)
    wall_s: float
    #: deterministic work charged to the stage (work units of the solve's ``work_limit``)
    work: float = 0.0
    #: schedules evaluated by the stage, one model's evaluation each (starts, polish moves,
    #: candidates); was ``simulations``
    evaluations: int = 0
    #: best simulated (or, for judging, re-exported) step time when the stage ended, ms; None
    #: when the stage produced no schedule
    step_ms: float | None = None
    #: step time gained over what the stage started from, ms (0 when nothing improved)
    gained_ms: float = 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class SolveResult:
    """What every solver and heuristic returns, so that they compare directly.

    Attributes:
        schedule: the chosen schedule (never empty for a graph with collectives).
        status: see :class:`SolveStatus`.
        solver: name of the solver or heuristic that produced it.
        objective_ms: predicted step time of ``schedule`` in the solver's model (ms).
        best_bound_ms: proven lower bound on step time in the solver's model (ms); for
            heuristics the analytic lower bound.
        solve_time_s: wall time of the solve (s).
        peak_bytes: predicted peak memory of ``schedule`` (bytes).
        notes: human-readable remarks (fallback reasons, limits hit).
        history: (seconds since the solve started, simulated step ms) each time the incumbent
            improved, warm start first (filled by the windowed search; empty otherwise).
        alternatives: other schedules of the solve worth judging on the written graph (the
            schedule before the final polish).
        stages: the search's stages that ran, in order (:class:`StageRecord`).
        start: the start of the search the schedule was found from ("" for a solver without
            starts); ``start_step_ms`` its simulated step time under each cost model and
            ``step_ms_by_model`` the schedule's (ms; equal where the start won unchanged).
    """

    schedule: Schedule
    status: SolveStatus
    solver: str
    objective_ms: float
    best_bound_ms: float
    solve_time_s: float
    peak_bytes: int
    notes: tuple[str, ...] = ()
    history: tuple[tuple[float, float], ...] = ()
    #: other schedules of the solve worth judging on the written graph, where counts the model
    #: does not make may decide (the schedule before the final polish)
    alternatives: tuple[Schedule, ...] = ()
    stages: tuple[StageRecord, ...] = ()
    start: str = ""
    start_step_ms: Mapping[str, float] = dataclasses.field(default_factory=dict)
    step_ms_by_model: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def gap(self) -> float:
        """Relative optimality gap (objective - bound) / objective, 0 when proven optimal."""
        if self.objective_ms <= 0:
            return 0.0
        return max(0.0, (self.objective_ms - self.best_bound_ms) / self.objective_ms)

