"""Pictures of simulated schedules: Gantt chart, memory curve, Pareto frontier.

Each function draws with matplotlib's Agg canvas (no display, no global backend switch, so
notebooks keep their own backend), writes a PNG to ``path`` and returns the path.
Times are in ms, memory is shown in the binary unit (KiB / MiB / GiB) that fits its peak.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from solvers.core.simulator import SimResult
from solvers.core.problem import Problem

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: colour of collectives / buckets outside the repeated layers (embeddings, final norm, output)
_OTHER_COLOUR = "#7f7f7f"
_COMPUTE_COLOUR = "#a6b8d4"


def layer_of(fqns: Sequence[str]) -> int | None:
    """The decoder layer index of a bucket: the smallest ``N`` in member FQNs ``...layers.N....``,
    None when no member belongs to a layer."""
    layers = [int(m.group(1)) for f in fqns if (m := _LAYER_RE.search(f))]
    return min(layers) if layers else None


def _mem_unit(peak_bytes: float) -> tuple[str, float]:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if peak_bytes >= f:
            return unit, float(f)
    return "B", 1.0


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _layer_colours(n_layers: int):
    from matplotlib import colormaps

    if n_layers <= 8:  # tab10 without red (blocked time) and grey (other parameters)
        tab10 = colormaps["tab10"]
        palette = [tab10(i) for i in (0, 1, 2, 4, 5, 6, 8, 9)]
        return lambda i: palette[i]
    cmap = colormaps["viridis"]
    return lambda i: cmap(i / max(n_layers - 1, 1))


def gantt(sim: SimResult, problem: Problem, path: str | Path, *, title: str | None = None) -> Path:
    """Gantt chart of one simulated schedule.

    Rows: the compute stream (nodes, with the time blocked in waits drawn in red), then one
    row per communication stream (process group). Buckets are coloured by the first decoder
    layer of their members (``layers.N.`` in the parameter FQNs; grey for other parameters)
    and labelled with their member count and, when they span layers, the layer range.

    Args:
        sim: :func:`solvers.core.simulator.simulate` result (its ``schedule`` names the buckets).
        problem: the :class:`~solvers.core.problem.Problem` the schedule belongs to.
        path: PNG to write (parent directories are created).
        title: figure title; default: the DAG's name and the step time.
    """
    schedule = sim.schedule
    groups: list[str] = []
    bars: list[tuple[str, float, float, int | None, str]] = []  # group, start, end, layer, label
    for b, (_issue, start, end, _done) in sorted(sim.bucket_times.items()):
        members = schedule.buckets[b].members if schedule is not None else ()
        colls = [problem.colls[m] for m in members if m in problem.colls]
        group = f"{colls[0].coll_type} (group {colls[0].group_name})" if colls else "comm"
        if group not in groups:
            groups.append(group)
        fqns = [f for c in colls for f in c.fqns]
        span = sorted({lay for f in fqns if (lay := layer_of([f])) is not None})
        label = f"x{len(members)}" if len(members) > 1 else ""
        if len(span) > 1:  # coloured by its first layer; say which layers it spans
            label += f" L{span[0]}-{span[-1]}"
        bars.append((group, start, end, layer_of(fqns), label.strip()))
    layers = sorted({lay for *_, lay, _n in bars if lay is not None})
    colour = _layer_colours(len(layers))
    layer_colour = {lay: colour(i) for i, lay in enumerate(layers)}

    rows = ["compute", *groups]
    fig = Figure(figsize=(12, 1.2 + 0.7 * len(rows)))
    ax = fig.add_subplot()
    y = {r: len(rows) - 1 - i for i, r in enumerate(rows)}
    h = 0.6
    # compute stream: nodes and the gaps in it (blocked in waits or copies) in red
    spans = sorted(sim.node_times.values())
    ax.broken_barh([(s, e - s) for s, e in spans], (y["compute"] - h / 2, h), facecolors=_COMPUTE_COLOUR)
    gaps, t = [], 0.0
    for s, e in spans:
        if s > t + 1e-9:
            gaps.append((t, s - t))
        t = max(t, e)
    if sim.step_ms > t + 1e-9:
        gaps.append((t, sim.step_ms - t))
    if gaps:
        ax.broken_barh(gaps, (y["compute"] - h / 2, h), facecolors="#d62728", alpha=0.8)
    for group, s, e, lay, label in bars:
        fc = layer_colour.get(lay, _OTHER_COLOUR) if lay is not None else _OTHER_COLOUR
        ax.broken_barh([(s, e - s)], (y[group] - h / 2, h), facecolors=fc, edgecolors="black", linewidth=0.4)
        if label and (e - s) > 0.04 * max(sim.step_ms, 1e-9):
            ax.text((s + e) / 2, y[group], label, ha="center", va="center", fontsize=7)
    ax.set_yticks([y[r] for r in rows], rows)
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, max(sim.step_ms, 1e-6) * 1.01)
    ax.grid(axis="x", alpha=0.3)
    name = problem.dag.graph.get("name", "graph")
    ax.set_title(title or f"{name}: step {sim.step_ms:.3f} ms, exposed comm {sim.exposed_comm_ms:.3f} ms, "
                          f"{sim.n_collectives} collectives")

    from matplotlib.patches import Patch

    handles = [Patch(facecolor=_COMPUTE_COLOUR, label="compute"),
               Patch(facecolor="#d62728", label="blocked (wait / copy)")]
    if len(layers) <= 12:
        handles += [Patch(facecolor=layer_colour[lay], label=f"layer {lay}") for lay in layers]
    else:
        handles += [Patch(facecolor=layer_colour[layers[0]], label=f"layer {layers[0]}"),
                    Patch(facecolor=layer_colour[layers[-1]], label=f"layer {layers[-1]}")]
    if any(lay is None for *_, lay, _n in bars):
        handles.append(Patch(facecolor=_OTHER_COLOUR, label="other params"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return _save(fig, path)


def _memory_curve(sim: SimResult) -> tuple[list[float], list[int]]:
    """(time_ms, live_bytes) as a step curve: during each step its peak (allocations done,
    frees not yet), then what is left after it; ``sim.memory`` alone misses in-step peaks."""
    mem, during = sim.memory, sim.step_live_bytes
    if len(during) != len(mem) - 1:
        return [t for t, _ in mem], [b for _, b in mem]
    times, live = [mem[0][0]], [mem[0][1]]
    for k, peak in enumerate(during):
        times += [mem[k][0], mem[k + 1][0]]
        live += [peak, mem[k + 1][1]]
    return times, live


def memory(sim: SimResult, path: str | Path, budget_bytes: int | None = None, *,
           title: str | None = None, label: str = "live memory") -> Path:
    """Live memory over time of one simulated schedule, against ``budget_bytes`` (bytes;
    None draws no budget line). The peak is marked."""
    times, live = _memory_curve(sim)
    top = max([sim.peak_bytes, *(live or [0]), budget_bytes or 0])
    unit, f = _mem_unit(top)
    fig = Figure(figsize=(10, 3.5))
    ax = fig.add_subplot()
    ax.step(times, [b / f for b in live], where="post", color=_COMPUTE_COLOUR, label=label)
    if live:
        k = max(range(len(live)), key=live.__getitem__)
        ax.plot([times[k]], [live[k] / f], "o", color="black")
        ax.annotate(f"peak {live[k] / f:.2f} {unit}", (times[k], live[k] / f), textcoords="offset points",
                    xytext=(6, 6), fontsize=8)
    if budget_bytes:
        ax.axhline(budget_bytes / f, color="#d62728", linestyle="--", label=f"budget {budget_bytes / f:.2f} {unit}")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_ylim(0, top / f * 1.12)
    ax.set_xlim(0, max(sim.step_ms, 1e-6))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title or f"memory: peak {sim.peak_bytes / f:.2f} {unit}")
    return _save(fig, path)


def _xy(p: Any) -> tuple[float, float]:
    if isinstance(p, Mapping):
        return float(p["peak_bytes"]), float(p["step_ms"])
    if hasattr(p, "peak_bytes"):
        return float(p.peak_bytes), float(p.step_ms)
    peak, step = p[0], p[1]
    return float(peak), float(step)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The non-dominated (peak, step) points, by increasing peak (both minimised)."""
    front: list[tuple[float, float]] = []
    for peak, step in sorted(points):
        if not front or step < front[-1][1] - 1e-12:
            front.append((peak, step))
    return front


def pareto(points: Sequence[Any], path: str | Path, baselines: Mapping[str, Any] | None = None, *,
           title: str | None = None, equal_memory: Sequence[tuple[str, Any, Any]] | None = None) -> Path:
    """Step time against peak memory: every solved point, its Pareto frontier, and baselines.

    Args:
        points: solved schedules, each a mapping with ``peak_bytes`` and ``step_ms`` (extra
            keys such as ``budget_bytes`` are ignored), an object with those attributes (e.g.
            a :class:`SimResult`), or a ``(peak_bytes, step_ms)`` pair.
        path: PNG to write.
        baselines: name -> point in the same forms (e.g. ``{"fsdp2": sim}``), marked and labelled.
        equal_memory: ``(baseline name, baseline point, fsdp-sched point)`` triples: fsdp-sched
            solved at that baseline's peak, drawn as a star with an arrow from the baseline.
    """
    xy = [_xy(p) for p in points]
    base = {k: _xy(v) for k, v in (baselines or {}).items()}
    pairs = [(name, _xy(b), _xy(p)) for name, b, p in (equal_memory or ())]
    top = max([x for x, _ in xy] + [x for x, _ in base.values()] + [p[0] for _, _, p in pairs] + [1.0])
    unit, f = _mem_unit(top)
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    if xy:
        ax.scatter([x / f for x, _ in xy], [y for _, y in xy], color="#9ecae1", label="fsdp-sched (each budget)", zorder=2)
        front = pareto_front(xy)
        ax.step([x / f for x, _ in front], [y for _, y in front], where="post", color=_COMPUTE_COLOUR,
                marker="o", label="Pareto frontier", zorder=3)
    markers = "s^vDPX*<>"
    for i, (name, (x, y)) in enumerate(sorted(base.items())):
        ax.scatter([x / f], [y], marker=markers[i % len(markers)], s=60, color=f"C{(i + 1) % 10}",
                   edgecolors="black", label=name, zorder=4)
    _mark_equal_memory(ax, pairs, f)
    ax.set_xlabel(f"peak memory ({unit})")
    ax.set_ylabel("step time (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(title or "step time vs peak memory")
    return _save(fig, path)


def _mark_equal_memory(ax: Any, pairs: Sequence[tuple[str, tuple[float, float], tuple[float, float]]],
                       f: float) -> None:
    """A star per fsdp-sched point solved at a baseline's peak, an arrow from that baseline."""
    for i, (name, (bx, by), (px, py)) in enumerate(pairs):
        ax.annotate("", xy=(px / f, py), xytext=(bx / f, by),
                    arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.8}, zorder=5)
        ax.scatter([px / f], [py], marker="*", s=140, color=f"C{(i + 4) % 10}", edgecolors="black",
                   label=f"fsdp-sched at peak({name})", zorder=6)
