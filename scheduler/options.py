"""The options of :func:`scheduler.optimize_schedule`: how to solve, how ranks agree, how to
write back. Frozen dataclasses, every field documented and checked when built, so that a bad
value fails in the caller's own line, before any collective."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from scheduler.torch_overlap import TORCH, VARIANTS
from solvers.config import renamed_fields
from solvers.core.schedule import Schedule
from solvers.registry import SOLVERS, available_solvers
from solvers.objective import SearchConfig
from solvers.search import ALL_GATHER_STREAMS, DEFAULT_WORK_LIMIT

#: the orders of compute :attr:`SolverOptions.compute_order` accepts
COMPUTE_ORDERS = ("traced", "torch", "choose", "starts")


@renamed_fields(time_limit_s="work_limit")
@dataclasses.dataclass(frozen=True, kw_only=True)
class SolverOptions:
    """How the schedule is found (:mod:`solvers.search`)."""

    #: ``"cpsat"`` (default) or ``"milp"``: the search of :mod:`solvers.search` with that model
    #: backend for its windows (its knobs: ``search.cpsat``, ``search.milp``); a heuristic's
    #: name (``solvers.available_solvers()``): that heuristic's schedule alone; or a callable
    #: ``fn(problem, *, mem_budget_bytes, work_limit, seed, hint, num_workers, extra_starts)
    #: -> SolveResult`` in place of the search, every keyword always passed (``hint`` None,
    #: ``extra_starts`` this option's; :data:`solvers.registry.SolverFn`)
    solver: str | Callable[..., Any] = "cpsat"
    #: deterministic work of the search, in work units (about one second of one core each: the
    #: model backend's deterministic clock, the polish's counted evaluations; never the wall
    #: clock): the same stages and the same schedule on every rank whatever the machine's load;
    #: see :mod:`solvers.search` for how it is shared. Was ``time_limit_s``, which still works
    #: for one release (deprecated)
    work_limit: float = DEFAULT_WORK_LIMIT
    #: the model backend's random seed
    seed: int = 0
    #: the model backend's threads (1: deterministic)
    num_workers: int = 1
    #: when the solver fails, answer with the best start that fits (status ``"fallback"``)
    #: instead of raising
    fallback: bool = True
    #: schedules of this graph to start from too (for instance the one installed at a smaller
    #: budget, ``gm.meta[SCHEDULE_KEY]``): the answer is never slower than the fastest that fits
    extra_starts: tuple[Schedule, ...] = ()
    #: where all-gathers run (:mod:`solvers.core.streams`): ``"shared"`` (default) on their own
    #: process group, one FIFO stream with its reduce-scatters; ``"choose"``: the search also
    #: tries each schedule with the all-gathers of every group that also reduces on a second
    #: process group of the same ranks (two streams sharing the link's bandwidth) and keeps
    #: that only where its cost models say it pays; ``"separate"``: always there. A split
    #: schedule's write-back makes the second group (``torch.distributed.new_group`` on the
    #: group's ranks, once per set of ranks; :func:`scheduler.writeback.second_group`)
    all_gather_stream: str = "shared"
    #: let the search merge gradient all-reduces (DDP, HSDP's replicate group) into buckets; they
    #: are placed (issued early, waited late) either way. Off by default because a merged
    #: all-reduce rounds differently: a ring all-reduce sums each element in an order set by its
    #: place in the buffer (bitwise equal on 2 ranks only); DDP's own bucketing does the same
    merge_all_reduces: bool = False
    #: variants of torch's overlap scheduler (``schedule_overlap_bucketing``) run on a copy of
    #: the graph, each written graph read back as a start and a baseline of the search
    #: (:mod:`scheduler.torch_overlap`), so that the answer is no slower than torch's under the
    #: models the search judges by: ``"torch-overlap"`` (torch's default, with its FSDP
    #: pre-bucketing) and ``"torch-overlap-no-prebucketing"``. Each costs most of a pass of
    #: torch's scheduler (run at a start's cost), and an answer as finely bucketed as torch's
    #: costs more to write back; a variant that fails on a graph is skipped (reported). The
    #: default is torch's own pass, what torch.compile runs: the second variant costs as much
    #: again and changed little on the published graphs (BENCHMARKS.md, section 5). Empty: no
    #: torch pass. Taken by the search's solvers (``"cpsat"``, ``"milp"``) only
    torch_starts: tuple[str, ...] = (TORCH,)
    #: the order of the compute nodes the search schedules around: ``"traced"``; ``"torch"``,
    #: the order torch's pass (the first of ``torch_starts``) runs them in, where it moves them
    #: (it runs a collective's input early so that it issues early), over which its schedule is
    #: a start without repairs; ``"choose"``: the search runs in both and keeps the answer no
    #: slower than torch's own schedule under the strict models, then of smaller worst-case
    #: regret, then the traced one (its last stages, links and ahead, on that answer alone;
    #: with no budget, an order whose starts trail by more than ``order_margin`` is not
    #: polished); ``"starts"``: a quicker compile, the starts run in both and
    #: the rest of the search (windows, polish) in the order whose best start has the smaller
    #: worst-case regret (in the other too where that answer ends slower than torch's own
    #: schedule), at some cost in step time where the polish would have turned the choice
    #: (BENCHMARKS.md, section 5; :func:`scheduler.solving.search_in_orders`). Any order runs
    #: every node after its inputs: the graph computes the same
    compute_order: str = "choose"
    #: with ``compute_order="choose"`` and no budget: where one order's best start is slower
    #: than the other's by more than this fraction (the worst ratio over the models of each to
    #: the better of the two), the rest of the search runs in the leading order only, as with
    #: ``"starts"`` (in the other too where that answer ends slower than torch's own schedule).
    #: With no budget the polish moves an order's worst ratio by a percent or two, never past
    #: such a gap on the published graphs; under a budget the starts are cut back to fit and
    #: the polish can gain tens of percent, so both orders are polished there. None: always both
    order_margin: float | None = 0.03
    #: the search's tuning values, with the knobs of each model backend (``SearchConfig.cpsat``,
    #: ``SearchConfig.milp``)
    search: SearchConfig = SearchConfig()
    #: bandwidth factors of the family of cost models (:mod:`scheduler.costs.family`): the
    #: collectives no file measured and no spec names a model for are also priced on the
    #: cluster's bandwidths times each; empty: analytic and torch as given only
    bandwidth_scales: tuple[float, ...] = (0.7, 1.3)
    #: ``hook(problem, schedule) -> Schedule | None`` called on the solved schedule before the
    #: ranks agree: a returned schedule replaces it (validated); it may raise. For edits of a
    #: schedule by hand, and for injecting faults in tests
    schedule_hook: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.solver, str):
            if self.solver not in SOLVERS:
                raise ValueError(f"solver={self.solver!r} is unknown; choose one of {available_solvers()} or pass a "
                                 "callable")
        elif not callable(self.solver):
            raise TypeError(f"solver={self.solver!r} must be a solver name ({available_solvers()}) or a callable")
        if isinstance(self.work_limit, bool) or not isinstance(self.work_limit, (int, float)):
            raise TypeError(f"work_limit={self.work_limit!r} must be a number of work units")
        if not (math.isfinite(self.work_limit) and self.work_limit > 0):
            raise ValueError(f"work_limit={self.work_limit!r} must be a finite number > 0")
        _check_int("seed", self.seed, 0, 2**31 - 1)
        _check_int("num_workers", self.num_workers, 1, 1024)
        _check_bool("fallback", self.fallback)
        if isinstance(self.extra_starts, (str, bytes)) or not isinstance(self.extra_starts, (tuple, list)):
            raise TypeError(f"extra_starts={self.extra_starts!r} must be a tuple of Schedule")
        for start in self.extra_starts:
            if not isinstance(start, Schedule):
                raise TypeError(f"extra_starts holds {start!r}, which is not a Schedule")
        object.__setattr__(self, "extra_starts", tuple(self.extra_starts))
        _check_bool("merge_all_reduces", self.merge_all_reduces)
        if not isinstance(self.torch_starts, tuple) or any(v not in VARIANTS for v in self.torch_starts) or \
                len(set(self.torch_starts)) != len(self.torch_starts):
            raise ValueError(f"torch_starts={self.torch_starts!r} must be a tuple of distinct variants of torch's pass "
                             f"from {tuple(VARIANTS)} (empty: none)")
        if self.all_gather_stream not in ALL_GATHER_STREAMS:
            raise ValueError(f"all_gather_stream={self.all_gather_stream!r} must be one of {ALL_GATHER_STREAMS}")
        if self.compute_order not in COMPUTE_ORDERS:
            raise ValueError(f"compute_order={self.compute_order!r} must be one of {COMPUTE_ORDERS}")
        if self.order_margin is not None and (
                isinstance(self.order_margin, bool) or not isinstance(self.order_margin, (int, float))
                or not (math.isfinite(self.order_margin) and self.order_margin >= 0)):
            raise ValueError(f"order_margin={self.order_margin!r} must be a fraction >= 0 (or None: polish both orders)")
        if not isinstance(self.search, SearchConfig):
            raise TypeError(f"search={self.search!r} must be a solvers.objective.SearchConfig (scheduler.SearchConfig)")
        if not isinstance(self.bandwidth_scales, tuple) or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f > 0
                for f in self.bandwidth_scales):
            raise ValueError(f"bandwidth_scales={self.bandwidth_scales!r} must be a tuple of factors > 0")
        if self.schedule_hook is not None and not callable(self.schedule_hook):
            raise TypeError(f"schedule_hook={self.schedule_hook!r} must be a callable (problem, schedule) -> "
                            "Schedule | None")

    @property
    def solver_name(self) -> str:
        return self.solver if isinstance(self.solver, str) else getattr(self.solver, "__name__", "custom")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgreementOptions:
    """How the ranks of a process group agree on one schedule (:mod:`scheduler.integrate.consensus`)."""

    #: with an initialised process group of more than one rank, the ranks agree before writing
    #: back: one all-gather of schedule digests; on a mismatch every rank takes the source
    #: rank's schedule; if the pass fails on any rank, every rank keeps its graph (if it fails
    #: on every rank, each raises). False: no collective at all, each rank on its own
    enabled: bool = True
    #: the process group whose ranks must agree (None: the world); with pipeline parallelism,
    #: the group of the ranks that compile this graph
    group: Any = None
    #: only this (global) rank solves; the others take its schedule (None: every rank solves,
    #: and the digests are compared)
    broadcast_from: int | None = None

    def __post_init__(self) -> None:
        _check_bool("enabled", self.enabled)
        if self.broadcast_from is not None:
            _check_int("broadcast_from", self.broadcast_from, 0, 2**31 - 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WriteBackOptions:
    """How the schedule is written into the graph (:mod:`scheduler.writeback`)."""

    #: order of the members' data in a merged bucket buffer: ``"registration"`` (parameter
    #: registration order, as FSDP2 does: keeps reduce-scatter numerics bitwise equal to eager
    #: FSDP2) or ``"execution"`` (the bucket's order in the schedule)
    payload_order: str = "registration"
    #: pin the written order with control dependencies for inductor (which reorders by itself)
    control_deps: bool = False

    def __post_init__(self) -> None:
        if self.payload_order not in ("registration", "execution"):
            raise ValueError(f"payload_order={self.payload_order!r} must be 'registration' or 'execution'")
        _check_bool("control_deps", self.control_deps)


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int")
    if not low <= value <= high:
        raise ValueError(f"{name}={value!r} must be in [{low}, {high}]")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False")
