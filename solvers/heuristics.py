"""Baseline heuristics: the schedules that today's FSDP stacks would produce, on our model.

Each heuristic is listed in :data:`HEURISTICS` (by name) and returns a
:class:`SolveResult` with status ``HEURISTIC``, its objective and peak from the simulator
(:mod:`solvers.core.simulator`, torch-free) and the analytic lower bound as best bound:

- ``"traced"``: the graph as traced (every collective alone, where it was).
- ``"fsdp2"``: FSDP2 eager: one bucket per transformer block per chain, all-gathers prefetched
  one block ahead (the first one exposed), each block's reduce-scatter issued after its last
  gradient and waited just before the next block's is issued.
- ``"perblock"``: the graph trainer's per-block plan as torch's manual scheduler runs it: FSDP2's
  buckets and pattern, the all-gather prefetch crossing from the forward into the backward
  (FSDP2-like's on a partitioned graph).
- ``"simplefsdp"``: torchtitan SimpleFSDP greedy auto-bucketing: adjacent chain members merged
  up to a size cap, issued where the earliest member was traced, waited before first use.
- ``"autoparallel"``: AutoParallel auto-bucketing on torch's overlap scheduler: primary-group
  bucketing by size cap, all-gathers prefetched up to 50 compute nodes ahead, reduce-scatters
  in flight over at most 8 compute nodes.

Memory budget: when the simulated peak of a heuristic's schedule exceeds ``mem_budget_bytes``,
it walks down a ladder of less memory-hungry settings (less prefetch, shorter reduce-scatter
overlap, smaller buckets) and returns the first that fits, or raises
:class:`InfeasibleBudgetError` with the smallest peak it reached.

Buckets are always runs of consecutive members of one chain (:attr:`Problem.chains`) whose
issue ranges intersect (``max ready <= min needed``); positions are clamped into that range.

Joint graphs (forward, loss and backward in one graph): a chain holds both directions (the
all-gathers of the forward, then the re-gathers of the backward). Every heuristic plans each
direction apart (:func:`phase_parts`), as the graph trainer's joint pass buckets per block and
per direction: no bucket holds a forward gather and a backward re-gather (which would keep the
re-gathered parameter alive from the forward on), and FSDP2-like prefetch stays inside its
direction (the first backward bucket is exposed, as in FSDP2 eager); the per-block plan's
prefetch crosses into the backward (the first backward buckets are gathered during the last
forward ones), as torch's manual scheduler pairs them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence, Set as AbstractSet

from solvers.core.evaluate import Evaluation, evaluate
from solvers.core.plan import PlannedBucket
from solvers.core.problem import Problem
from solvers.core.schedule import Bucket, InfeasibleBudgetError, Schedule, SolveResult, SolveStatus, Step, order_gap

logger = logging.getLogger(__name__)

#: torch 2.13 ``fx_passes.bucketing.bucket_cap_mb_by_bucket_idx_default``: 2000 MiB, the cap
#: that ``greedy_bucket_collective_by_mb`` uses (bucketing_*_fx passes, SimpleFSDP) when no
#: ``bucket_size_determinator`` is configured. Each member counts max(input, output) bytes.
TORCH_GREEDY_BUCKET_CAP_BYTES = 2000 * 1024 * 1024
#: torch 2.13 ``OverlapScheduler`` buckets with ``OverlapPreservingBucketer(max_bucket_memory_gb=2.0)``
#: (hard-coded), which AutoParallel's aten mode uses.
TORCH_OVERLAP_BUCKET_CAP_BYTES = 2 * 1024**3

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# --------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------
def heuristic_result(
    problem: Problem,
    schedule: Schedule,
    solver_name: str,
    status: SolveStatus,
    t0: float,
    notes: Sequence[str] = (),
    sim: Evaluation | None = None,
) -> SolveResult:
    """``schedule`` as a :class:`SolveResult`, with the simulator's numbers
    (:func:`solvers.core.evaluate.evaluate`).

    Args:
        t0: ``time.perf_counter()`` at the start of the solve; solve time is measured from it.
        notes: remarks stored on the result.
        sim: the schedule's evaluation when the caller has it already.
    """
    sim = sim or evaluate(problem, schedule)
    return SolveResult(
        schedule=schedule,
        status=status,
        solver=solver_name,
        objective_ms=sim.step_ms,
        best_bound_ms=problem.lower_bound_ms(),
        solve_time_s=time.perf_counter() - t0,
        peak_bytes=sim.peak_bytes,
        notes=tuple(notes),
    )


def issue_range(problem: Problem, members: Sequence[str]) -> tuple[int, int]:
    """(earliest issue gap, latest wait gap) of a bucket: ``(max ready, min needed)``."""
    return (
        max(problem.colls[m].ready for m in members),
        min(problem.colls[m].needed for m in members),
    )


def split_feasible(problem: Problem, members: Sequence[str]) -> list[tuple[str, ...]]:
    """Split a run of chain members greedily into runs whose issue ranges intersect."""
    runs: list[tuple[str, ...]] = []
    cur: list[str] = []
    for m in members:
        if cur:
            lo, hi = issue_range(problem, [*cur, m])
            if lo > hi:
                runs.append(tuple(cur))
                cur = []
        cur.append(m)
    if cur:
        runs.append(tuple(cur))
    return runs


def phase_parts(problem: Problem, members: Sequence[str]) -> list[list[str]]:
    """``members`` (one chain, in chain order) in maximal runs of one direction
    (:attr:`Collective.phase`); a chain of a partitioned graph is one run."""
    parts: list[list[str]] = []
    for m in members:
        if parts and problem.colls[parts[-1][-1]].phase == problem.colls[m].phase:
            parts[-1].append(m)
        else:
            parts.append([m])
    return parts


def split_by_bytes(problem: Problem, members: Sequence[str], cap_bytes: int) -> list[tuple[str, ...]]:
    """Greedy runs of at most ``cap_bytes`` (each member counts max(input, output) bytes, as
    torch's ``greedy_bucket_collective_by_mb``); a member larger than the cap is alone."""
    runs: list[tuple[str, ...]] = []
    cur: list[str] = []
    size = 0
    for m in members:
        c = problem.colls[m]
        b = max(c.payload_bytes, c.out_bytes)
        if cur and size + b > cap_bytes:
            runs.append(tuple(cur))
            cur, size = [], 0
        cur.append(m)
        size += b
    if cur:
        runs.append(tuple(cur))
    return runs


def fixed_buckets(problem: Problem) -> list[PlannedBucket]:
    """Collectives the scheduler may not move: alone, at their traced gaps."""
    return [
        PlannedBucket(Bucket((c.name,)), c.traced_issue, c.traced_wait)
        for c in problem.colls.values()
        if not c.movable
    ]


def compute_gaps(problem: Problem) -> list[int]:
    """``cnt[p]`` = number of compute nodes (kind "compute", not views) in ``seq[:p]``, so that
    distances between gaps can be counted in compute nodes, as torch's overlap scheduler does."""
    cnt = [0]
    for name in problem.seq:
        cnt.append(cnt[-1] + (problem.dag.nodes[name]["kind"] == "compute"))
    return cnt


def schedule_from_plan(problem: Problem, plan: Sequence[PlannedBucket], *,
                       waits_first: AbstractSet[Bucket] = frozenset()) -> Schedule:
    """The heuristics' :class:`Schedule` of a plan (:mod:`solvers.core.plan`).

    Buckets are numbered by (issue gap, traced issue of the first member). Inside a gap the
    steps run as: the waits of ``waits_first`` (FSDP2 waits the previous reduce-scatter before
    issuing the next), issues (earliest needed first, so the FIFO stream serves the nearest
    consumer first), other waits; a data dependency between two steps of one gap (a fixed
    collective reading another's wait) overrides that order.
    """
    n = problem.n
    plan = sorted(plan, key=lambda b: (b.issue_at, problem.colls[b.members[0]].traced_issue, b.members))
    for b in plan:
        lo, hi = issue_range(problem, b.members)
        if not (0 <= b.issue_at <= b.wait_at <= n):
            raise ValueError(f"bucket {b.members[:2]}...: bad positions issue={b.issue_at} wait={b.wait_at}")
        if problem.colls[b.members[0]].movable and not (lo <= b.issue_at and b.wait_at <= hi):
            raise ValueError(
                f"bucket {b.members[:2]}...: positions ({b.issue_at}, {b.wait_at}) outside its issue range ({lo}, {hi})"
            )
    order_idx = {name: i for i, name in enumerate(problem.dag.graph["order"])}
    after = problem.bucket_reads([b.members for b in plan])
    # a bucket that reads another's result is issued after that one's wait
    issue_at, wait_at = problem.after_waits([b.bucket for b in plan], after, [b.issue_at for b in plan],
                                            [b.wait_at for b in plan])
    plan = [b if (b.issue_at, b.wait_at) == (i, w) else PlannedBucket(b.bucket, i, w)
            for b, i, w in zip(plan, issue_at, wait_at)]
    # events per gap: ("issue" | "wait", bucket index)
    per_gap: list[list[tuple[str, int]]] = [[] for _ in range(n + 1)]
    for i, b in enumerate(plan):
        per_gap[b.issue_at].append(("issue", i))
        per_gap[b.wait_at].append(("wait", i))

    def priority(ev: tuple[str, int]) -> tuple:
        kind, i = ev
        b = plan[i]
        c0 = problem.colls[b.members[0]]
        phase = 1 if kind == "issue" else (0 if b.bucket in waits_first else 2)
        return (phase, issue_range(problem, b.members)[1], order_idx[c0.name], i)

    steps: list[Step] = []
    for p in range(n + 1):
        if per_gap[p]:  # most gaps hold no issue or wait
            steps.extend(order_gap(per_gap[p], priority, after))
        if p < n:
            steps.append(Step("node", problem.seq[p]))
    return Schedule(tuple(b.bucket for b in plan), tuple(steps))


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(v, hi))


def _with_budget(
    problem: Problem,
    name: str,
    configs: Iterable[object],
    build: Callable[[Problem, object], Schedule],
    mem_budget_bytes: int | None,
    t0: float,
) -> SolveResult:
    """Return the first config's result whose simulated peak fits the budget.

    Raises:
        InfeasibleBudgetError: no config fits; ``min_peak_bytes`` is the smallest peak seen.
    """
    best_peak: int | None = None
    first = True
    for cfg in configs:
        sched = build(problem, cfg)
        sim = evaluate(problem, sched)
        res = heuristic_result(problem, sched, name, SolveStatus.HEURISTIC, t0, notes=() if first else (f"shrunk to {cfg}",),
                       sim=sim)
        peak = sim.peak_bytes
        if mem_budget_bytes is None or peak <= mem_budget_bytes:
            if not first:
                logger.info("%s: fits %d B with %s (peak %d B)", name, mem_budget_bytes, cfg, peak)
            return res
        best_peak = peak if best_peak is None else min(best_peak, peak)
        first = False
    raise InfeasibleBudgetError(
        f"heuristic {name!r} cannot keep peak memory under {mem_budget_bytes} B (smallest peak "
        f"{best_peak} B); raise the budget to at least that, or use solver='cpsat'",
        mem_budget_bytes=int(mem_budget_bytes or 0),
        min_peak_bytes=best_peak,
    )


# --------------------------------------------------------------------------------------------
# traced
# --------------------------------------------------------------------------------------------
def solve_traced(
    problem: Problem,
    *,
    mem_budget_bytes: int | None = None,
    work_limit: float = 30.0,
    seed: int = 0,
    hint: Schedule | None = None,
    num_workers: int = 1,
) -> SolveResult:
    """The graph as traced; raises :class:`InfeasibleBudgetError` if its peak exceeds the budget."""
    t0 = time.perf_counter()
    return _with_budget(problem, "traced", [None], lambda p, _: p.traced_schedule(), mem_budget_bytes, t0)


# --------------------------------------------------------------------------------------------
# FSDP2
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BlockGroups:
    """Consecutive blocks that share one bucket of a chain.

    From the ``start``-th block bucket of the chain (counted in the order the chain runs:
    need order for all-gathers, gradient order for reduce-scatters) on, every ``size``
    consecutive blocks form one bucket; the blocks before ``start`` and the root's collectives
    (embeddings, final norm, output) keep one bucket each. ``size=1`` is FSDP2's one bucket per
    block. Bigger buckets pay the per-collective cost less often (a cost model whose time grows
    slower than the payload, as torch's NCCL estimator does, rewards that) and hold more memory.
    """

    size: int = 1
    start: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or self.start < 0:
            raise ValueError(f"BlockGroups needs size >= 1 and start >= 0, got {self}")

    def apply(self, runs: list[tuple[str, ...]], is_block: Callable[[tuple[str, ...]], bool]) -> list[tuple[str, ...]]:
        """Merge ``runs`` (one per block, in chain order) into groups as described above; runs
        that are not blocks (``is_block`` false) are never merged and end a group."""
        if self.size == 1:
            return runs
        out: list[tuple[str, ...]] = []
        seen, group, members = 0, 0, []
        for run in runs:
            if not is_block(run):
                if members:
                    out.append(tuple(members))
                    members, group = [], 0
                out.append(run)
                continue
            seen += 1
            if seen <= self.start:
                out.append(run)
                continue
            members += run
            group += 1
            if group == self.size:
                out.append(tuple(members))
                members, group = [], 0
        if members:
            out.append(tuple(members))
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class FSDP2Config:
    """Settings of the FSDP2-like schedule."""

    prefetch_blocks: int = 1
    """All-gather buckets issued this many buckets ahead of need (FSDP2: 1; 0: none)."""
    overlap_reduce_scatter: bool = True
    """Wait each reduce-scatter when the next is issued (FSDP2); False: wait right at issue."""
    block_buckets: bool = True
    """One bucket per block; False: every collective alone (smallest buffers)."""
    gather_groups: BlockGroups = BlockGroups()
    """Several blocks per all-gather bucket (not FSDP2's own setting: :mod:`solvers.starts`
    searches it); the default, one block per bucket, is FSDP2's."""
    reduce_groups: BlockGroups = BlockGroups()
    """Several blocks per reduce-scatter bucket, as ``gather_groups``."""
    prefetch_across_phases: bool = False
    """On a joint graph, count the all-gather buckets of both directions as one sequence for
    prefetch, so that the first backward buckets are issued during the last forward ones (the
    per-block plan as torch's manual scheduler walks it); False: the first backward bucket is
    issued where it is needed, as FSDP2 eager, whose backward starts with no prefetch."""

    def __post_init__(self) -> None:
        if self.prefetch_blocks < 0:
            raise ValueError(f"prefetch_blocks must be >= 0, got {self.prefetch_blocks}")


def fsdp2_blocks(problem: Problem) -> dict[str, str]:
    """Block id of every collective, FSDP2's module groups: ``"block:N"`` for the parameters of
    repeated block N as the export inferred it (:mod:`scheduler.export.structure`) and ``"root"`` for
    the others (embeddings, final norm, output: FSDP2's root group). A DAG without inferred
    blocks (an old file) falls back to its FQNs: ``"layers.N"``, ``"root"`` for other module
    parameters, ``"coll:<name>"`` (its own block) when only a placeholder name is known."""
    out: dict[str, str] = {}
    inferred = any(c.block is not None for c in problem.colls.values())
    for name, c in problem.colls.items():
        fqn = c.fqns[0] if c.fqns else ""
        m = _LAYER_RE.search(fqn)
        if inferred:
            out[name] = f"block:{c.block}" if c.block is not None else "root"
        elif m:
            out[name] = f"layers.{m.group(1)}"
        elif "." in fqn:
            out[name] = "root"
        else:
            out[name] = f"coll:{name}"
    return out


def _runs_by_block(problem: Problem, members: Sequence[str], blocks: dict[str, str]) -> list[tuple[str, ...]]:
    runs: list[list[str]] = []
    for m in members:
        if runs and blocks[runs[-1][-1]] == blocks[m]:
            runs[-1].append(m)
        else:
            runs.append([m])
    return [r for run in runs for r in split_feasible(problem, run)]


def fsdp2_schedule(problem: Problem, config: FSDP2Config = FSDP2Config()) -> Schedule:
    """The FSDP2-like schedule of ``problem`` (see :class:`FSDP2Config`)."""
    blocks = fsdp2_blocks(problem)
    plan = fixed_buckets(problem)
    waits_first: set[Bucket] = set()

    def bucketed(key: tuple, part: list[str]) -> list[tuple[str, ...]]:
        if not config.block_buckets:
            return [(m,) for m in part]
        runs = _runs_by_block(problem, part, blocks)
        groups = config.gather_groups if key[0] == "all_gather" else config.reduce_groups
        runs = groups.apply(runs, lambda run: blocks[run[0]].startswith(("block:", "layers.")))
        return [r for run in runs for r in split_feasible(problem, run)]

    # buckets never mix directions; prefetch runs over ``sequences``: one per direction, or
    # one per all-gather chain when it crosses from the forward into the backward
    sequences = []
    for key, chain in problem.chains.items():
        parts = [bucketed(key, part) for part in phase_parts(problem, chain)]
        if key[0] == "all_gather" and config.prefetch_across_phases:
            parts = [[run for part in parts for run in part]]
        sequences += [(key, runs) for runs in parts]
    for key, runs in sequences:
        ranges = [issue_range(problem, r) for r in runs]
        if key[0] == "all_gather":
            for i, (run, (lo, hi)) in enumerate(zip(runs, ranges)):
                # issued where the bucket `prefetch_blocks` earlier is needed
                j = i - config.prefetch_blocks
                at = ranges[j][1] if j >= 0 else hi
                plan.append(PlannedBucket(Bucket(run), _clamp(at, lo, hi), hi))
        else:
            issue = [lo for lo, _ in ranges]
            for i, (run, (lo, hi)) in enumerate(zip(runs, ranges)):
                if config.overlap_reduce_scatter:
                    wait = _clamp(issue[i + 1], issue[i], hi) if i + 1 < len(runs) else hi
                else:
                    wait = issue[i]
                plan.append(PlannedBucket(Bucket(run), issue[i], wait))
                waits_first.add(plan[-1].bucket)
    return schedule_from_plan(problem, plan, waits_first=waits_first)


def _fsdp2_ladder(start: FSDP2Config) -> list[FSDP2Config]:
    out = [dataclasses.replace(start, prefetch_blocks=d) for d in range(start.prefetch_blocks, -1, -1)]
    last = out[-1]
    if last.overlap_reduce_scatter:
        last = dataclasses.replace(last, overlap_reduce_scatter=False)
        out.append(last)
    if last.block_buckets:
        out.append(dataclasses.replace(last, block_buckets=False))
    return out


def solve_fsdp2(
    problem: Problem,
    *,
    mem_budget_bytes: int | None = None,
    work_limit: float = 30.0,
    seed: int = 0,
    hint: Schedule | None = None,
    num_workers: int = 1,
    config: FSDP2Config = FSDP2Config(),
) -> SolveResult:
    """FSDP2 eager's schedule, shrunk (prefetch, reduce-scatter overlap, buckets) to fit the budget."""
    t0 = time.perf_counter()
    return _with_budget(problem, "fsdp2", _fsdp2_ladder(config), fsdp2_schedule, mem_budget_bytes, t0)


# --------------------------------------------------------------------------------------------
# the per-block plan
# --------------------------------------------------------------------------------------------
#: the graph trainer's per-block plan: FSDP2's buckets and pattern, with the prefetch walking
#: from the forward into the backward
PER_BLOCK_PLAN = FSDP2Config(prefetch_across_phases=True)


def solve_perblock(
    problem: Problem,
    *,
    mem_budget_bytes: int | None = None,
    work_limit: float = 30.0,
    seed: int = 0,
    hint: Schedule | None = None,
    num_workers: int = 1,
    config: FSDP2Config = PER_BLOCK_PLAN,
) -> SolveResult:
    """The per-block plan as torch's manual scheduler runs it for the graph trainer: one bucket
    per block and direction, each all-gather bucket issued one bucket ahead, the first backward
    bucket during the last forward one, each reduce-scatter waited when the next is issued;
    shrunk as FSDP2-like's to fit the budget. On a partitioned graph it is FSDP2-like's."""
    t0 = time.perf_counter()
    return _with_budget(problem, "perblock", _fsdp2_ladder(config), fsdp2_schedule, mem_budget_bytes, t0)


# --------------------------------------------------------------------------------------------
# SimpleFSDP
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class SimpleFSDPConfig:
    """Settings of the SimpleFSDP-like greedy auto-bucketing."""

    bucket_cap_bytes: int = TORCH_GREEDY_BUCKET_CAP_BYTES
    """Size cap of a bucket (bytes, each member counted as max(input, output) bytes)."""
    wait_reduce_scatter_at_use: bool = True
    """Wait reduce-scatter buckets before first use (end of graph for gradients); False: at
    the issue (as traced), which frees their full-size inputs at once."""

    def __post_init__(self) -> None:
        if self.bucket_cap_bytes < 0:
            raise ValueError(f"bucket_cap_bytes must be >= 0, got {self.bucket_cap_bytes}")


def simplefsdp_schedule(problem: Problem, config: SimpleFSDPConfig = SimpleFSDPConfig()) -> Schedule:
    """Greedy size-capped buckets of adjacent chain members; all-gathers issued at the earliest
    member's traced issue (no prefetch beyond it), reduce-scatters after their last gradient;
    every bucket waited before its first use."""
    plan = fixed_buckets(problem)
    for key, chain in ((k, part) for k, c in problem.chains.items() for part in phase_parts(problem, c)):
        for capped in split_by_bytes(problem, chain, config.bucket_cap_bytes):
            for run in split_feasible(problem, capped):
                lo, hi = issue_range(problem, run)
                traced = min(problem.colls[m].traced_issue for m in run)
                issue = _clamp(traced, lo, hi)
                wait = hi if (key[0] == "all_gather" or config.wait_reduce_scatter_at_use) else issue
                plan.append(PlannedBucket(Bucket(run), issue, wait))
    return schedule_from_plan(problem, plan)


def _simplefsdp_ladder(problem: Problem, start: SimpleFSDPConfig) -> list[SimpleFSDPConfig]:
    out = [start]
    smallest = min((max(c.payload_bytes, c.out_bytes) for c in problem.colls.values()), default=0)
    cap = start.bucket_cap_bytes
    while cap >= smallest and cap > 0:
        cap //= 2
        out.append(dataclasses.replace(start, bucket_cap_bytes=cap))
    if start.wait_reduce_scatter_at_use:
        out.append(dataclasses.replace(out[-1], wait_reduce_scatter_at_use=False))
    return out


def solve_simplefsdp(
    problem: Problem,
    *,
    mem_budget_bytes: int | None = None,
    work_limit: float = 30.0,
    seed: int = 0,
    hint: Schedule | None = None,
    num_workers: int = 1,
    config: SimpleFSDPConfig = SimpleFSDPConfig(),
) -> SolveResult:
    """SimpleFSDP's greedy bucketing, with the cap halved until the budget fits."""
    t0 = time.perf_counter()
    return _with_budget(
        problem, "simplefsdp", _simplefsdp_ladder(problem, config), simplefsdp_schedule, mem_budget_bytes, t0
    )


# --------------------------------------------------------------------------------------------
# AutoParallel
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoParallelConfig:
    """Settings of the AutoParallel-like schedule.

    Reading of AutoParallel's auto-bucketing (torch ``schedule_overlap_bucketing`` with
    ``max_compute_pre_fetch`` raised from 5 to 50, and consecutive compute between
    reduce-scatters capped at 8): an all-gather bucket is issued at most
    ``max_prefetch_compute_nodes`` compute nodes before its first consumer; a reduce-scatter
    bucket is issued after its last gradient and stays in flight over at most
    ``max_rs_compute_nodes`` compute nodes before it is waited, which bounds how long its
    full-size gradient input stays alive. Only the primary process group (most payload bytes)
    is bucketed, by size cap.
    """

    max_prefetch_compute_nodes: int = 50
    """All-gather prefetch distance, in compute nodes (views do not count)."""
    max_rs_compute_nodes: int = 8
    """Compute nodes a reduce-scatter bucket may overlap before its wait."""
    bucket_cap_bytes: int = TORCH_OVERLAP_BUCKET_CAP_BYTES
    """Size cap of a bucket (bytes, each member counted as max(input, output) bytes)."""
    primary_group_only: bool = True
    """Bucket only the process group with the most collective payload; others stay alone."""

    def __post_init__(self) -> None:
        for f in ("max_prefetch_compute_nodes", "max_rs_compute_nodes", "bucket_cap_bytes"):
            if getattr(self, f) < 0:
                raise ValueError(f"AutoParallelConfig.{f} must be >= 0, got {getattr(self, f)}")


def _gap_back(cnt: list[int], hi: int, k: int) -> int:
    """Earliest gap p <= hi with at most k compute nodes in seq[p:hi]."""
    p = hi
    while p > 0 and cnt[hi] - cnt[p - 1] <= k:
        p -= 1
    return p


def _gap_forward(cnt: list[int], lo: int, k: int) -> int:
    """Latest gap p >= lo with at most k compute nodes in seq[lo:p]."""
    n = len(cnt) - 1
    p = lo
    while p < n and cnt[p + 1] - cnt[lo] <= k:
        p += 1
    return p


def autoparallel_schedule(problem: Problem, config: AutoParallelConfig = AutoParallelConfig()) -> Schedule:
    """The AutoParallel-like schedule of ``problem`` (see :class:`AutoParallelConfig`)."""
    cnt = compute_gaps(problem)
    payload: dict[str, int] = {}
    for c in problem.colls.values():
        payload[c.group_name] = payload.get(c.group_name, 0) + c.payload_bytes
    primary = max(sorted(payload), key=lambda g: payload[g]) if payload else None
    plan = fixed_buckets(problem)
    for key, chain in ((k, part) for k, c in problem.chains.items() for part in phase_parts(problem, c)):
        if config.primary_group_only and key[1] != primary:
            capped = [(m,) for m in chain]
        else:
            capped = split_by_bytes(problem, chain, config.bucket_cap_bytes)
        for run in (r for c in capped for r in split_feasible(problem, c)):
            lo, hi = issue_range(problem, run)
            if key[0] == "all_gather":
                issue = _clamp(_gap_back(cnt, hi, config.max_prefetch_compute_nodes), lo, hi)
                plan.append(PlannedBucket(Bucket(run), issue, hi))
            else:
                wait = _clamp(_gap_forward(cnt, lo, config.max_rs_compute_nodes), lo, hi)
                plan.append(PlannedBucket(Bucket(run), lo, wait))
    return schedule_from_plan(problem, plan)


def _autoparallel_ladder(start: AutoParallelConfig) -> list[AutoParallelConfig]:
    out = [start]
    cfg = start
    while cfg.max_prefetch_compute_nodes > 0 or cfg.max_rs_compute_nodes > 0:
        cfg = dataclasses.replace(
            cfg,
            max_prefetch_compute_nodes=cfg.max_prefetch_compute_nodes // 2,
            max_rs_compute_nodes=cfg.max_rs_compute_nodes // 2,
        )
        out.append(cfg)
    while cfg.bucket_cap_bytes > 0:
        cfg = dataclasses.replace(cfg, bucket_cap_bytes=cfg.bucket_cap_bytes // 4)
        out.append(cfg)
    return out


def solve_autoparallel(
    problem: Problem,
    *,
    mem_budget_bytes: int | None = None,
    work_limit: float = 30.0,
    seed: int = 0,
    hint: Schedule | None = None,
    num_workers: int = 1,
    config: AutoParallelConfig = AutoParallelConfig(),
) -> SolveResult:
    """AutoParallel's schedule, prefetch / overlap / bucket cap shrunk until the budget fits."""
    t0 = time.perf_counter()
    return _with_budget(
        problem, "autoparallel", _autoparallel_ladder(config), autoparallel_schedule, mem_budget_bytes, t0
    )


#: every heuristic by name (the solver names of :func:`solvers.solve`); the exact solvers try
#: them all as warm starts (cheap: a few simulations each)
HEURISTICS: dict[str, Callable[..., SolveResult]] = {
    "traced": solve_traced,
    "fsdp2": solve_fsdp2,
    "perblock": solve_perblock,
    "simplefsdp": solve_simplefsdp,
    "autoparallel": solve_autoparallel,
}
