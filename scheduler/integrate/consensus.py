"""Rank agreement: every rank of a process group writes back the same schedule, or none does.

Collectives only match across ranks when every rank runs the same collectives in the same
order. Each rank solves its own graph; a wall-clock safety cap, a fallback after an error or
a different torch build on one rank gives that rank another schedule, and the job deadlocks
in the first mismatched collective without a message. A rank that fails while the others
succeed leaves them waiting in the next collective ("Connection closed by peer").

:func:`optimize_schedule <scheduler.api.optimize_schedule>` therefore runs three small rounds
over the agreement group (default: the world), one before solving, one before writing back and
one after:

0. :func:`agree_on_budget`, before solving: one all-gather of four integers per rank (status,
   whether it has a budget, the budget, its source rank). Every rank solves with the smallest
   budget of any rank, so that the one schedule they install holds every rank's own budget (a
   job that sets the budget from each rank's free memory gives them different ones); ranks
   whose source ranks differ (``broadcast_from`` given to some ranks only) fail on every rank,
   since each would wait for its own source's broadcast.

1. :func:`agree_on_schedule`, before writing back: one all-gather of a 33-byte record per
   rank (a status byte and the schedule's sha256 digest).

   - every rank solved and the digests are equal: each rank writes back its own schedule;
   - the digests differ (or, with ``broadcast_from``, only the source rank solved): the
     source rank (rank 0 unless told) broadcasts its answer as JSON text; every rank whose
     digest differs takes it, to check on its own graph and budget before writing it back;
   - a rank failed: every rank learns which and why (a second all-gather, of the messages)
     and all of them leave the graph unchanged, or, when every rank failed, all re-raise.

2. :func:`agree_on_outcome`, after writing back: one all-gather of a status byte. A rank
   whose write-back failed, or whose check or decoding of a received answer did, makes every
   rank restore its graph as it was.

Between the first collective of round 0 and the last of round 2 nothing may raise on one rank
alone: the others would wait for it in the next round for ever. These functions raise only
where every rank raises alike; a failure of this rank inside a round (encoding the answer it
sends, a source rank that could not send) is returned in :attr:`Agreement.error` for the
caller to tell every rank in round 2, and the caller runs everything between round 1 and
round 2 under one guard that does the same.

The rounds use real (not fake) tensors on the group's device: CPU for gloo, the current
CUDA device for NCCL. They are collectives: every rank of the group must call them for the
same graph in the same order, which holds for SPMD training (every rank compiles the same
graphs). With pipeline parallelism, stages compile different graphs: pass the group of the
ranks that compile the same graph (e.g. one stage's data-parallel group) or disable the
agreement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator
from typing import Any

from solvers.core.schedule import ScheduleError
from solvers.core.units import fmt_bytes

logger = logging.getLogger(__name__)

#: status byte of a rank in the first round
OK, FAILED, IDLE = 0, 1, 2
_DIGEST_BYTES = 32  # sha256
#: at most this many characters of an error message travel to the other ranks
_MAX_ERROR_CHARS = 2000


@dataclasses.dataclass(kw_only=True)
class BudgetAgreement:
    """What the ranks agreed on in :func:`agree_on_budget` (identical on every rank)."""

    #: the smallest budget of the ranks that gave one (bytes); None when none did
    mem_budget_bytes: int | None
    #: why the ranks cannot solve together (their source ranks differ); None when they can
    problem: str | None = None
    #: lines for the report
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(kw_only=True)
class Agreement:
    """What the ranks agreed on in :func:`agree_on_schedule`."""

    #: ``"apply"``: write back :attr:`schedule`, or the answer in :attr:`received`; ``"skip"``:
    #: leave the graph unchanged; ``"raise"``: every rank failed, re-raise the local error
    action: str
    #: this rank's own schedule (or answer) to write back; None unless ``action == "apply"``
    #: and this rank keeps its own
    schedule: Any = None
    #: the source rank's answer as JSON text (its ``to_json()``), when this rank takes it: to
    #: decode and check on this rank's graph and budget before writing it back
    received: str | None = None
    #: group rank whose answer this rank took; None when it keeps its own
    adopted_from: int | None = None
    #: group ranks whose schedule differed from the source rank's
    disagreeing_ranks: list[int] = dataclasses.field(default_factory=list)
    #: group rank -> error message, for every rank that failed
    failures: dict[int, str] = dataclasses.field(default_factory=dict)
    #: lines for the report
    notes: list[str] = dataclasses.field(default_factory=list)
    #: a failure of this rank in this round (it could not encode the answer it sends, or the
    #: source rank could not send one): every rank must learn of it in round 2
    #: (:func:`agree_on_outcome`) and keep its graph
    error: BaseException | None = None


def agreement_group(group: Any = None) -> Any | None:
    """The process group to agree over, or None when there is nothing to agree on (no
    initialised process group, or a group of one rank). ``group`` None means the world."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = group if group is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def agree_on_budget(mem_budget_bytes: int | None, *, failed: bool, src: int, group: Any) -> BudgetAgreement:
    """Round 0, before solving: the budget every rank solves with, the smallest of every rank's
    (module docstring).

    Args:
        mem_budget_bytes: this rank's budget (bytes, < 2**63), None for none.
        failed: this rank's arguments failed their check (its budget is not known; the failure
            is told in round 1).
        src: this rank's source rank (group rank whose schedule wins: ``broadcast_from``'s,
            else 0).
        group: the process group (from :func:`agreement_group`).
    """
    import torch.distributed as dist

    records = _all_gather_ints([FAILED if failed else OK, mem_budget_bytes is not None, mem_budget_bytes or 0, src],
                               group)
    ok = [(r, rec) for r, rec in enumerate(records) if rec[0] == OK]
    budgets = {r: rec[2] for r, rec in ok if rec[1]}
    sources = sorted({rec[3] for _, rec in ok})
    if len(sources) > 1:
        named = ", ".join(f"rank {r}: {rec[3]}" for r, rec in ok)
        return BudgetAgreement(mem_budget_bytes=None, problem=(
            f"the ranks take their schedule from different source ranks (broadcast_from; {named}); give every "
            "rank the same AgreementOptions"))
    if not budgets:
        return BudgetAgreement(mem_budget_bytes=None)
    smallest = min(budgets, key=lambda r: (budgets[r], r))
    budget = budgets[smallest]
    if len(budgets) == len(ok) and len(set(budgets.values())) == 1:
        return BudgetAgreement(mem_budget_bytes=budget)
    each = ", ".join(f"rank {r}: {fmt_bytes(budgets[r]) if r in budgets else 'none'}" for r, _ in ok)
    note = (f"the ranks' memory budgets differ ({each}); every rank solves with the smallest, {fmt_bytes(budget)} "
            f"({budget} B, rank {smallest}'s), so that the one schedule they install holds each rank's own")
    if dist.get_rank(group) == 0:
        logger.warning("fsdp-sched: %s", note)
    return BudgetAgreement(mem_budget_bytes=budget, notes=[note])


def agree_on_schedule(schedule: Any, error: BaseException | None, *, group: Any, src: int = 0) -> Agreement:
    """Make every rank of ``group`` write back the same schedule, or none (round 1).

    Args:
        schedule: this rank's answer: any object with ``digest()`` (64 hex digits) and
            ``to_json()`` (plain JSON values), such as a :class:`Schedule`; None when this rank
            failed (``error`` set) or did not solve (``broadcast_from`` mode, not the source
            rank).
        error: what failed on this rank, or None.
        group: the process group (from :func:`agreement_group`).
        src: group rank whose answer wins on a mismatch (default 0).

    Returns:
        The :class:`Agreement`, identical in ``action`` on every rank; its ``schedule`` (or the
        digest of ``received``) identical on every rank unless some rank's :attr:`Agreement.error`
        is set, which round 2 then tells every rank.
    """
    import torch.distributed as dist

    status = FAILED if error is not None else (OK if schedule is not None else IDLE)
    digest = None
    if status == OK:
        try:  # nothing may raise on one rank before the collective: the others would wait
            digest = schedule.digest()
            if len(bytes.fromhex(digest)) != _DIGEST_BYTES:
                raise ValueError(f"a schedule digest must be {_DIGEST_BYTES} bytes of hex, got {digest!r}")
        except Exception as e:
            error, status, digest = e, FAILED, None
    records = _all_gather_records(status, digest, group)
    statuses = [s for s, _ in records]
    me = dist.get_rank(group)

    if FAILED in statuses:
        message = "" if error is None else f"{type(error).__name__}: {error}"[:_MAX_ERROR_CHARS]
        messages = _all_gather_objects(message, group)
        failures = {r: messages[r] for r, s in enumerate(statuses) if s == FAILED}
        if all(s == FAILED for s in statuses):
            return Agreement(action="raise", failures=failures)
        note = (
            f"the schedule was not written back on any rank: the pass failed on rank(s) {sorted(failures)} "
            f"of {len(statuses)} ({_first_failure(failures)}); every rank keeps the graph as traced"
        )
        logger.warning("fsdp-sched: %s", note)
        return Agreement(action="skip", failures=failures, notes=[note])

    if statuses[src] != OK:  # every rank sees the same statuses: all skip alike
        note = (f"the schedule was not written back on any rank: source rank {src} did not solve (status "
                f"{statuses[src]}); every rank keeps the graph as traced")
        logger.warning("fsdp-sched: %s", note)
        return Agreement(action="skip", notes=[note])
    src_digest = records[src][1]
    disagreeing = [r for r, (s, d) in enumerate(records) if s == OK and d != src_digest]
    if not disagreeing and IDLE not in statuses:
        return Agreement(action="apply", schedule=schedule)

    payload: list[Any] = [None]
    local_error: BaseException | None = None
    if me == src:
        try:  # JSON text pickles on every rank alike; what cannot be encoded is told, not raised
            payload[0] = {"answer": json.dumps(schedule.to_json())}
        except Exception as e:
            local_error = e
            payload[0] = {"error": f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]}
    _broadcast_objects(payload, src, group)
    notes = []
    if disagreeing:
        notes.append(
            f"schedule digests differed across ranks: rank(s) {disagreeing} disagreed with rank {src}; "
            f"every rank took rank {src}'s schedule {src_digest[:16]}"
        )
        logger.warning("fsdp-sched: %s", notes[0])
    if me == src or (statuses[me] == OK and me not in disagreeing):
        return Agreement(action="apply", schedule=schedule, disagreeing_ranks=disagreeing, notes=notes,
                         error=local_error)
    sent = payload[0] if isinstance(payload[0], dict) else {"error": f"an unreadable payload {payload[0]!r:.80}"}
    if "answer" not in sent:
        local_error = ScheduleError(f"rank {src} could not send its schedule: {sent.get('error')}")
    return Agreement(action="apply", received=sent.get("answer"), adopted_from=src, disagreeing_ranks=disagreeing,
                     notes=notes + [f"schedule received from rank {src}"], error=local_error)


def agree_on_outcome(error: BaseException | None, *, group: Any) -> dict[int, str]:
    """Round 2, after writing back: group rank -> error message of every rank whose write-back
    failed (empty when all succeeded); identical on every rank."""
    records = _all_gather_records(FAILED if error is not None else OK, None, group)
    if all(s == OK for s, _ in records):
        return {}
    message = "" if error is None else f"{type(error).__name__}: {error}"[:_MAX_ERROR_CHARS]
    messages = _all_gather_objects(message, group)
    return {r: messages[r] for r, (s, _) in enumerate(records) if s == FAILED}


def _first_failure(failures: dict[int, str]) -> str:
    rank = min(failures)
    return f"rank {rank}: {failures[rank]}"


# --------------------------------------------------------------------------------------------
# the collectives (real tensors, also when called under a compiler's fake mode)
# --------------------------------------------------------------------------------------------
def _device(group: Any):
    import torch
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def _eager() -> Iterator[None]:
    """The agreement's collectives as eager code runs them, also inside a compile: no fake mode,
    and no Python dispatcher, which would hold the GIL while gloo waits for its lock, and gloo's
    worker thread may need the GIL to release the tensors of an earlier collective (both ranks
    then wait for ever)."""
    from torch._dispatch.python import no_python_dispatcher
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), no_python_dispatcher():
        yield


def _all_gather_records(status: int, digest: str | None, group: Any) -> list[tuple[int, str | None]]:
    """One all-gather of (status byte, 32 digest bytes) per rank."""
    import torch
    import torch.distributed as dist

    raw = bytes([status]) + (bytes.fromhex(digest) if digest else bytes(_DIGEST_BYTES))
    with _eager():  # compilers run passes under their fake mode and the Python dispatcher
        mine = torch.tensor(list(raw), dtype=torch.uint8, device=_device(group))
        out = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.uint8, device=mine.device)
        dist.all_gather_single(out, mine, group=group)
        rows = out.view(-1, mine.numel()).cpu().tolist()
    return [(row[0], bytes(row[1:]).hex() if row[0] == OK else None) for row in rows]


def _all_gather_ints(values: list[int], group: Any) -> list[list[int]]:
    """One all-gather of ``values`` (int64) per rank."""
    import torch
    import torch.distributed as dist

    with _eager():
        mine = torch.tensor([int(v) for v in values], dtype=torch.int64, device=_device(group))
        out = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.int64, device=mine.device)
        dist.all_gather_single(out, mine, group=group)
        return out.view(-1, mine.numel()).cpu().tolist()


def _all_gather_objects(obj: Any, group: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    with _eager():
        dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast_objects(payload: list[Any], src: int, group: Any) -> None:
    import torch.distributed as dist

    with _eager():
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, src), group=group)


# --------------------------------------------------------------------------------------------
# ranks
# --------------------------------------------------------------------------------------------
def source_rank(group: Any, agreement: Any) -> int:
    """The group rank whose schedule wins: ``broadcast_from``'s, else 0 (a bad value falls back
    to 0 here: its check's error reaches every rank through the agreement)."""
    if group is None or agreement is None or agreement.broadcast_from is None:
        return 0
    import torch.distributed as dist

    if not 0 <= agreement.broadcast_from < dist.get_world_size():
        return 0
    try:
        return dist.get_group_rank(group, agreement.broadcast_from)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"broadcast_from={agreement.broadcast_from} is not a rank of the agreement group "
                         f"({type(e).__name__}: {e}); name a global rank of AgreementOptions.group") from None


def group_rank(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
