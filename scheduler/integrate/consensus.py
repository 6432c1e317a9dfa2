"""Rank agreement: every rank of a process group writes back the same schedule, or none does.

Collectives only match across ranks when every rank runs the same collectives in the same
order. Each rank solves its own graph; a wall-clock safety cap, a fallback after an error or
a different torch build on one rank gives that rank another schedule, and the job deadlocks
in the first mismatched collective without a message. A rank that fails while the others
succeed leaves them waiting in the next collective ("Connection closed by peer").

:func:`optimize_schedule <scheduler.api.optimize_schedule>` therefore runs two small rounds
over the agreement group (default: the world) before and after it writes back:

1. :func:`agree_on_schedule`, before writing back: one all-gather of a 33-byte record per
   rank (a status byte and the schedule's sha256 digest).

   - every rank solved and the digests are equal: each rank writes back its own schedule;
   - the digests differ (or, with ``broadcast_from``, only the source rank solved): the
     source rank (rank 0 unless told) broadcasts its schedule and report as JSON
     (:meth:`Schedule.to_json`); every rank whose digest differs takes it, and the report
     says so;
   - a rank failed: every rank learns which and why (a second all-gather, of the messages)
     and all of them leave the graph unchanged, or, when every rank failed, all re-raise.

2. :func:`agree_on_outcome`, after writing back: one all-gather of a status byte. A rank
   whose write-back (or whose check of a received schedule) failed makes every rank restore
   its graph as it was.

Both rounds use real (not fake) tensors on the group's device: CPU for gloo, the current
CUDA device for NCCL. They are collectives: every rank of the group must call them for the
same graph in the same order, which holds for SPMD training (every rank compiles the same
graphs). With pipeline parallelism, stages compile different graphs: pass the group of the
ranks that compile the same graph (e.g. one stage's data-parallel group) or disable the
agreement.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from solvers.core.schedule import Schedule

logger = logging.getLogger(__name__)

#: status byte of a rank in the first round
OK, FAILED, IDLE = 0, 1, 2
_DIGEST_BYTES = 32  # sha256
#: at most this many characters of an error message travel to the other ranks
_MAX_ERROR_CHARS = 2000


@dataclasses.dataclass(kw_only=True)
class Agreement:
    """What the ranks agreed on in :func:`agree_on_schedule`."""

    #: ``"apply"``: write back :attr:`schedule`; ``"skip"``: leave the graph unchanged;
    #: ``"raise"``: every rank failed, re-raise the local error
    action: str
    #: the schedule (or choice) to write back (identical on every rank); None unless
    #: ``action == "apply"``
    schedule: Any = None
    #: the source rank's report (JSON) when this rank took the source rank's schedule
    report_json: dict[str, Any] | None = None
    #: group rank whose schedule this rank took; None when it keeps its own
    adopted_from: int | None = None
    #: group ranks whose schedule differed from the source rank's
    disagreeing_ranks: list[int] = dataclasses.field(default_factory=list)
    #: group rank -> error message, for every rank that failed
    failures: dict[int, str] = dataclasses.field(default_factory=dict)
    #: lines for the report
    notes: list[str] = dataclasses.field(default_factory=list)


def agreement_group(group: Any = None) -> Any | None:
    """The process group to agree over, or None when there is nothing to agree on (no
    initialised process group, or a group of one rank). ``group`` None means the world."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = group if group is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def agree_on_schedule(
    schedule: Any,
    report_json: dict[str, Any] | None,
    error: BaseException | None,
    *,
    group: Any,
    src: int = 0,
    decode: Callable[[dict[str, Any]], Any] = Schedule.from_json,
) -> Agreement:
    """Make every rank of ``group`` write back the same schedule, or none (round 1).

    Args:
        schedule: this rank's schedule (a :class:`Schedule`, or any choice with ``digest()``
            and ``to_json()``, such as a :class:`scheduler.check.written.Candidate`); None when this
            rank failed (``error`` set) or did not solve (``broadcast_from`` mode, not the
            source rank).
        report_json: this rank's report as JSON (sent when the others adopt this schedule).
        error: what failed on this rank, or None.
        group: the process group (from :func:`agreement_group`).
        src: group rank whose schedule wins on a mismatch (default 0).
        decode: turns the source rank's ``to_json()`` back into a schedule (default
            :meth:`Schedule.from_json`).

    Returns:
        The :class:`Agreement`, identical in ``action`` and schedule digest on every rank.
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

    if statuses[src] != OK:
        raise ValueError(f"agreement source rank {src} did not solve (status {statuses[src]})")
    src_digest = records[src][1]
    disagreeing = [r for r, (s, d) in enumerate(records) if s == OK and d != src_digest]
    if not disagreeing and IDLE not in statuses:
        return Agreement(action="apply", schedule=schedule)

    payload: list[Any] = [None]
    if me == src:
        payload[0] = {"schedule": schedule.to_json(), "report": report_json}  # type: ignore[union-attr]
    _broadcast_objects(payload, src, group)
    notes = []
    if disagreeing:
        notes.append(
            f"schedule digests differed across ranks: rank(s) {disagreeing} disagreed with rank {src}; "
            f"every rank took rank {src}'s schedule {src_digest[:16]}"
        )
        logger.warning("fsdp-sched: %s", notes[0])
    if me == src or (statuses[me] == OK and me not in disagreeing):
        return Agreement(action="apply", schedule=schedule, disagreeing_ranks=disagreeing, notes=notes)
    received = decode(payload[0]["schedule"])
    return Agreement(
        action="apply",
        schedule=received,
        report_json=payload[0]["report"],
        adopted_from=src,
        disagreeing_ranks=disagreeing,
        notes=notes + [f"schedule received from rank {src}"],
    )


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


def _all_gather_records(status: int, digest: str | None, group: Any) -> list[tuple[int, str | None]]:
    """One all-gather of (status byte, 32 digest bytes) per rank."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    raw = bytes([status]) + (bytes.fromhex(digest) if digest else bytes(_DIGEST_BYTES))
    with unset_fake_temporarily():  # compilers run passes under their fake mode
        mine = torch.tensor(list(raw), dtype=torch.uint8, device=_device(group))
        out = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.uint8, device=mine.device)
        dist.all_gather_into_tensor(out, mine, group=group)
        rows = out.view(-1, mine.numel()).cpu().tolist()
    return [(row[0], bytes(row[1:]).hex() if row[0] == OK else None) for row in rows]


def _all_gather_objects(obj: Any, group: Any) -> list[Any]:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    out: list[Any] = [None] * dist.get_world_size(group)
    with unset_fake_temporarily():
        dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast_objects(payload: list[Any], src: int, group: Any) -> None:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        dist.broadcast_object_list(payload, src=dist.get_global_rank(group, src), group=group)
