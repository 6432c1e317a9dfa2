"""Configuration of the window model and its two backends.

:class:`ModelConfig` bounds the decision space of one window (:mod:`solvers.model`);
:class:`SolverConfig` adds the wall-clock safety cap; each backend extends it with its own
solver knobs (:class:`CpSatConfig` for :mod:`solvers.cpsat`, :class:`MilpConfig` for
:mod:`solvers.milp`). The search's stages around the windows are tuned by
:class:`solvers.objective.SearchConfig`, which holds one config of each backend
(``SearchConfig.cpsat``, ``SearchConfig.milp``), so that ``SolverOptions.search`` reaches them.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import TypeVar

_C = TypeVar("_C")


def renamed_fields(**old_to_new: str) -> Callable[[type[_C]], type[_C]]:
    """Class decorator of a frozen dataclass whose fields were renamed: for one release each old
    name still works, with a :class:`DeprecationWarning`, as a keyword of the constructor (and so
    of ``dataclasses.replace``) and as an attribute. Given with the new name, the old one wins,
    since ``dataclasses.replace`` passes every field by its new name."""

    def wrap(cls: type[_C]) -> type[_C]:
        init = cls.__init__

        def warn(old: str, new: str) -> None:
            warnings.warn(f"{cls.__name__}.{old} is deprecated and will be removed in the next release: use "
                          f"{cls.__name__}.{new}", DeprecationWarning, stacklevel=3)

        @functools.wraps(init)
        def __init__(self, *args, **kwargs) -> None:
            for old, new in old_to_new.items():
                if old in kwargs:
                    warn(old, new)
                    kwargs[new] = kwargs.pop(old)
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[method-assign]
        for old, new in old_to_new.items():
            def read(self, old=old, new=new):
                warn(old, new)
                return getattr(self, new)

            setattr(cls, old, property(read, doc=f"Deprecated name of :attr:`{new}`."))
        return cls

    return wrap


#: the reach fields' names before they were told apart from the search's windows; every
#: config class takes them, since a dataclass writes each subclass an ``__init__`` of its own
_OLD_REACH_NAMES = {"window_anchors": "issue_reach_anchors", "wait_window_anchors": "wait_reach_anchors"}


@renamed_fields(**_OLD_REACH_NAMES)
@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The decision space of the model."""

    #: how many anchors before its first use an all-gather may be issued (and how far after
    #: its gradient a reduce-scatter may be issued): the reach of a collective's issue range;
    #: about two transformer blocks by default. Was ``window_anchors``, which still works for
    #: one release
    issue_reach_anchors: int = 64
    #: how many anchors after its issue a reduce-scatter may be waited: the reach of its wait
    #: range. Was ``wait_window_anchors``, which still works for one release
    wait_reach_anchors: int = 64
    #: largest bucket payload in bytes (None: no cap beyond the collectives' issue ranges)
    max_bucket_bytes: int | None = None
    #: anchors modelled on each side of a window's decisions (its model covers only that range;
    #: the incumbent fixes the state where the range starts)
    lns_range_margin_anchors: int = 8
    #: trust region of a window (and of a template window): each decided collective is issued
    #: (and a reduce-scatter waited) at most this many anchors from the incumbent's position,
    #: or as far as the neighbour in its chain it could merge with (None: anywhere in its issue
    #: range). Sweeps compound the moves. The small model searches far better for the same
    #: deterministic time than a window free to move anything anywhere
    lns_radius_anchors: int | None = 12

    def __post_init__(self) -> None:
        if self.issue_reach_anchors < 1 or self.wait_reach_anchors < 0:
            raise ValueError("issue_reach_anchors must be >= 1 and wait_reach_anchors >= 0")
        if self.max_bucket_bytes is not None and self.max_bucket_bytes <= 0:
            raise ValueError("max_bucket_bytes must be > 0 or None")
        if self.lns_range_margin_anchors < 0:
            raise ValueError("lns_range_margin_anchors must be >= 0")
        if self.lns_radius_anchors is not None and self.lns_radius_anchors < 1:
            raise ValueError("lns_radius_anchors must be >= 1 or None")


@renamed_fields(**_OLD_REACH_NAMES)
@dataclasses.dataclass(frozen=True, kw_only=True)
class SolverConfig(ModelConfig):
    """Everything both backends share: the decision space, and the wall-clock safety cap of
    one solve."""

    #: wall-clock safety cap of one solve, as a multiple of its deterministic limit: only
    #: against a stuck or starved process (the limits are deterministic; when the cap is hit
    #: the result is reported and is no longer rank-deterministic)
    wall_clock_factor: float = 4.0
    #: seconds added to every wall-clock cap: short limits are dominated by fixed costs (model
    #: loading) that a loaded machine stretches
    wall_clock_slack_s: float = 10.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.wall_clock_factor < 1 or self.wall_clock_slack_s < 0:
            raise ValueError("wall_clock_factor must be >= 1 and wall_clock_slack_s >= 0")


@renamed_fields(**_OLD_REACH_NAMES)
@dataclasses.dataclass(frozen=True, kw_only=True)
class CpSatConfig(SolverConfig):
    """Knobs of the CP-SAT backend (the shared ones: :class:`SolverConfig`)."""

    #: CP-SAT deterministic time units per work unit of a limit (a completion solve's; a work
    #: unit is about one second of one core, ``SolverOptions.work_limit``): its deterministic
    #: clock runs slower than one core's wall time, so this scale keeps a limit of T units near
    #: T s of wall time while the amount of search (hence the schedule) stays the same on every
    #: rank and machine
    deterministic_units_per_second: float = 0.25
    #: the same for the windows, which run without probing and SAT inprocessing
    #: (:meth:`CpSatBackend.solve_window`): their clock runs slower against the wall clock
    window_units_per_second: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.deterministic_units_per_second > 0 and self.window_units_per_second > 0):
            raise ValueError("deterministic_units_per_second and window_units_per_second must be > 0")


@renamed_fields(**_OLD_REACH_NAMES)
@dataclasses.dataclass(frozen=True, kw_only=True)
class MilpConfig(SolverConfig):
    """Knobs of the MILP backend (the shared ones: :class:`SolverConfig`)."""

    #: "auto" (HiGHS when installed, else CBC), "cbc" or "highs"
    backend: str = "auto"
    #: absolute optimality gap in microseconds; every objective value is an integer number of
    #: microseconds, so any gap below 1 still proves optimality
    abs_gap_us: float = 0.5
    #: branch-and-bound node limit (None: none); unlike the wall-clock limit it is deterministic
    max_nodes: int | None = None
    #: fraction of the work limit for completing the warm start (times for its decisions)
    warm_start_share: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backend not in ("auto", "cbc", "highs"):
            raise ValueError(f"backend must be 'auto', 'cbc' or 'highs', got {self.backend!r}")
        if not 0.0 <= self.abs_gap_us < 1.0:
            raise ValueError("abs_gap_us must be in [0, 1): a gap of 1 us may cut off the optimum")
        if self.max_nodes is not None and self.max_nodes < 1:
            raise ValueError("max_nodes must be >= 1 or None")
        if not 0.0 < self.warm_start_share < 1.0:
            raise ValueError("warm_start_share must be in (0, 1)")
