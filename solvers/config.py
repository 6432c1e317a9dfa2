"""Configuration shared by both model backends: the decision space and the search around it.

:class:`ModelConfig` bounds the decision space (:mod:`solvers.model`); :class:`SearchConfig`
steers the solve loop (:mod:`solvers.driver`) and the decomposition of large graphs
(:mod:`solvers.decompose`). :class:`SolverConfig` holds both; each backend extends it with
its own solver knobs (:class:`solvers.cpsat.CpSatConfig`, :class:`solvers.milp.MilpConfig`).
"""

from __future__ import annotations

import dataclasses

#: default time limit of a solve (s of deterministic work, see :class:`SearchConfig`): on one core
#: of the 2-core CI machine a 16-layer graph gets its final schedule in 3 to 10 s, within 1 % of
#: what 60 s finds (``benchmarks/solve_time.py``, BENCHMARKS.md section 12). Larger graphs want
#: more: pass ``time_limit_s``
DEFAULT_TIME_LIMIT_S = 6.5
#: calibration of work limits given in seconds for the polish on the simulator
#: (:mod:`solvers.minimax`): DAG nodes per second that one core of the CI machine simulates, or
#: builds a schedule over (llama3-8b backward at 8 layers, 2357 nodes: a simulation 7.6 ms, a
#: build 9.6 ms; at 16 layers, 4437 nodes: 23.7 and 13.9 ms); a limit of ``work_s`` seconds is
#: ``work_s * SIMULATED_NODES_PER_S / nodes`` of them, a number of the graph and the limit only,
#: so every rank polishes alike (:meth:`solvers.minimax.MinimaxConfig.for_work`)
SIMULATED_NODES_PER_S = 2e5


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The decision space of the model."""

    #: how many anchors before its first use an all-gather may be issued (and how far after
    #: its gradient a reduce-scatter may be issued); about two transformer blocks by default
    window_anchors: int = 64
    #: how many anchors after its issue a reduce-scatter may be waited
    wait_window_anchors: int = 64
    #: largest bucket payload in bytes (None: no cap beyond the windows)
    max_bucket_bytes: int | None = None
    #: anchors modelled on each side of a window's decisions (its model covers only that range;
    #: the incumbent fixes the state where the range starts)
    lns_range_margin_anchors: int = 8
    #: trust region of a window (and of a template window): each decided collective is issued
    #: (and a reduce-scatter waited) at most this many anchors from the incumbent's position,
    #: or as far as the neighbour in its chain it could merge with (None: anywhere in its issue
    #: window). Sweeps compound the moves. The small model searches far better for the same
    #: deterministic time: on 16-layer graphs (64 ranks) with 1 s windows it found 422.2 ms
    #: against 451.9 ms on the llama3-8b backward at its traced peak and 23.1 against 25.7 ms
    #: on an alternating-width forward (``benchmarks/solve_time.py``, BENCHMARKS.md section 12)
    lns_radius_anchors: int | None = 12

    def __post_init__(self) -> None:
        if self.window_anchors < 1 or self.wait_window_anchors < 0:
            raise ValueError("window_anchors must be >= 1 and wait_window_anchors >= 0")
        if self.max_bucket_bytes is not None and self.max_bucket_bytes <= 0:
            raise ValueError("max_bucket_bytes must be > 0 or None")
        if self.lns_range_margin_anchors < 0:
            raise ValueError("lns_range_margin_anchors must be >= 0")
        if self.lns_radius_anchors is not None and self.lns_radius_anchors < 1:
            raise ValueError("lns_radius_anchors must be >= 1 or None")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """The solve loop and the decomposition of large graphs."""

    #: how many times to re-solve with a tighter budget when the simulated peak exceeds it
    memory_repair_rounds: int = 4
    #: graphs with at most this many movable collectives and no repeating layers are solved as
    #: one model; larger or repeating ones by the decomposition (templates, then windows)
    full_model_max_members: int = 64
    #: collectives freed together in one window of the neighbourhood search (about 3 blocks)
    lns_window_members: int = 27
    #: graphs whose layers repeat (``template_min_blocks`` or more) go to the decomposition even
    #: with at most ``full_model_max_members`` collectives: templates first
    decompose_repeating: bool = True
    #: at most this many sweeps over the graph (0.3 s windows make sweeps cheap: on a 16-layer
    #: tied-embedding forward every one of 4 sweeps still gained, and 8 reached 15.89 against
    #: 16.19 ms within the default limit; no row of ``benchmarks/solve_time.py`` reaches 4)
    lns_max_sweeps: int = 8
    #: deterministic limit of one window, in seconds of the backend's calibrated clock (CP-SAT:
    #: ``window_units_per_second``); never derived from the wall clock, so that every rank runs
    #: the same windows with the same limits. The driver raises it to 1/100 of the solve's time
    #: limit (:func:`solvers.driver.scaled_search`). 0.3 s: with the trust region
    #: (``lns_radius_anchors``) and CP-SAT's windows run without probing, short windows find
    #: as much per second as long ones, and sweeps compound their moves
    lns_window_s: float = 0.3
    #: windows whose buckets expose at most this much communication (ms, in the incumbent's
    #: simulation) are skipped: they can gain only on copy costs (13 of 22 windows of a
    #: 16-layer llama backward, none of which ever improved)
    lns_min_exposed_ms: float = 1e-6
    #: rounds of the per-layer template (0: off): solve a window around the middle block of the
    #: repeating layers, copy its decisions onto every layer (see
    #: :func:`solvers.decompose.template_search`)
    template_rounds: int = 6
    #: blocks in the template's window (the middle one is copied); with a period of k blocks
    #: (alternating layers), at least 2k + 1
    template_window_blocks: int = 3
    #: deterministic limit of one template window (s, as ``lns_window_s``; raised to 1/30 of
    #: the time limit)
    template_window_s: float = 1.0
    #: fewest repeating blocks for the template to be tried
    template_min_blocks: int = 6
    #: longest period, in blocks, of the repetition the template looks for (2: alternating
    #: layers, 6 for widths alternating every 2 with every 3rd wider; see ``signature_period``
    #: in :mod:`scheduler.structure`)
    template_max_period_blocks: int = 6
    #: split buckets spanning more than this many blocks at block boundaries before the windows
    #: (a window frees whole buckets: one bucket of everything would free the whole graph)
    split_blocks_over: int = 2
    #: when the decomposition converges with at least this share of the time limit left, it
    #: searches again from the fastest start of the other bucket granularity
    #: (:func:`solvers.warmstart.other_family`) and keeps the faster result
    restart_share: float = 0.25
    #: most work of the final polish, as a share of the time limit, out of the work the search
    #: left (:mod:`solvers.minimax` with the solve's one cost model: merges and small issue /
    #: wait moves checked on the simulator, which prices merges exactly where the model
    #: approximates them). A solve that uses its whole limit is not polished (the API polishes
    #: the written candidates again, :func:`scheduler.verify.minimax_candidates`). 0: no polish.
    #: Reserving work out of the search's limit instead cost short solves more than the polish
    #: gave back (synthetic 6-layer forwards at 2 s: 15.28 against 14.97 ms); giving it on top
    #: of the limit took the 16-layer llama backward's default solve past 10 s, and all the
    #: work left (1.0) the 16-layer llama forward's to 15 s (its simulations cost about three
    #: times the calibration). A fifth leaves the 16-layer alternating backward 5 % short of
    #: what a 60 s solve's polish reaches (BENCHMARKS.md section 12)
    polish_share: float = 0.2
    #: calibration of the polish's work limit: graph nodes simulated per second of work
    #: (:data:`SIMULATED_NODES_PER_S`)
    polish_nodes_per_s: float = SIMULATED_NODES_PER_S
    #: wall-clock safety cap, as a multiple of the time limit: only against a stuck or starved
    #: process. The search's limits are deterministic; when the cap is hit the result is
    #: reported (a note) and is no longer rank-deterministic
    wall_clock_factor: float = 4.0
    #: seconds added to every wall-clock cap (one solve's and the whole search's): short limits
    #: are dominated by fixed costs (model loading, presolve) that a loaded machine stretches
    wall_clock_slack_s: float = 10.0

    def __post_init__(self) -> None:
        if self.memory_repair_rounds < 0:
            raise ValueError("memory_repair_rounds must be >= 0")
        if self.lns_window_s <= 0 or self.wall_clock_factor < 1 or self.wall_clock_slack_s < 0:
            raise ValueError("lns_window_s must be > 0, wall_clock_factor >= 1 and wall_clock_slack_s >= 0")
        if self.template_max_period_blocks < 1 or self.split_blocks_over < 1:
            raise ValueError("template_max_period_blocks and split_blocks_over must be >= 1")
        if self.template_rounds < 0 or self.template_window_blocks < 1 or self.template_window_s <= 0:
            raise ValueError("template_rounds must be >= 0, template_window_blocks >= 1, template_window_s > 0")
        if self.lns_min_exposed_ms < 0:
            raise ValueError("lns_min_exposed_ms must be >= 0")
        if not 0 < self.restart_share:
            raise ValueError(f"restart_share must be > 0 (a share of the time limit; above 1: never), got "
                             f"{self.restart_share}")
        if not 0 <= self.polish_share <= 1 or self.polish_nodes_per_s <= 0:
            raise ValueError(f"polish_share must be in [0, 1] and polish_nodes_per_s > 0, got {self.polish_share} "
                             f"and {self.polish_nodes_per_s}")
        if self.full_model_max_members < 0 or self.lns_window_members < 2:
            raise ValueError("full_model_max_members must be >= 0 and lns_window_members >= 2")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SolverConfig(ModelConfig, SearchConfig):
    """Everything both backends share: the decision space and the search."""

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)
        SearchConfig.__post_init__(self)
