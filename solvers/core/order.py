"""The same graph in another compute order: the problem a schedule's own order defines.

A :class:`solvers.core.schedule.Schedule` lists every compute and view node in the order it
runs them, and write-back places every node of the graph in that order. The search keeps the
order of the problem it solves, the traced one by default; torch's overlap scheduler moves
compute nodes too (it runs the producers of a collective's input early so that the collective
can be issued early), and a schedule found over torch's order is a schedule of the same graph
in another order. The DAG's edges are the graph's data dependencies (the export adds every
one), so any order that runs each node after its inputs computes the same.

:func:`in_order` is ``problem`` over another order of its DAG's nodes; :func:`problem_of` the
problem a given schedule is a schedule of (``problem`` itself when the schedule keeps its
order), so that a schedule found over any order is validated, simulated and written back as
one of its own order.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from solvers.core.problem import Problem
from solvers.core.schedule import Schedule, ScheduleError


def node_order(schedule: Schedule) -> tuple[str, ...]:
    """The compute and view nodes in the order ``schedule`` runs them."""
    return tuple(step.ref for step in schedule.steps if step.kind == "node")  # type: ignore[misc]


def in_order(problem: Problem, order: Sequence[str]) -> Problem:
    """``problem``'s graph with its DAG's nodes run in ``order``: its traced schedule is that
    order, its issue ranges are counted in it.

    Raises:
        ScheduleError: ``order`` does not name every node of the DAG once, or runs a node before
            one of its inputs (the message names the first).
    """
    dag = problem.dag
    position = {name: i for i, name in enumerate(order)}
    if len(position) != len(order) or len(order) != dag.number_of_nodes() or any(n not in position for n in dag):
        unknown = [n for n in order if n not in dag][:3]
        missing = [n for n in dag if n not in position][:3]
        raise ScheduleError(f"an order of the graph names each of its {dag.number_of_nodes()} nodes once: "
                            f"{len(order)} given (unknown {unknown}, missing {missing})")
    for u, v in dag.edges:
        if position[u] >= position[v]:
            raise ScheduleError(f"the order runs {v!r} before its input {u!r}")
    if list(order) == list(dag.graph["order"]):
        return problem
    # the same nodes and edges, read through a frozen view (problems never change their DAG);
    # only the graph's attributes, which hold the order, are its own
    reordered = nx.graphviews.generic_graph_view(dag)
    reordered.graph = {**dag.graph, "order": list(order)}
    return Problem.from_dag(reordered)


def problem_of(problem: Problem, schedule: Schedule) -> Problem:
    """The problem ``schedule`` is a schedule of: ``problem`` when it runs the compute and view
    nodes in ``problem``'s order, else ``problem``'s graph in the schedule's order (the graph's
    inputs first, then every node where the schedule runs it, a collective's prologue with its
    issue and its wait and epilogue with its wait, then the output).

    Raises:
        ScheduleError: the schedule names nodes ``problem`` does not have, or its order runs a
            node before one of its inputs.
    """
    if node_order(schedule) == problem.seq:
        return problem
    names: list[str] = []
    for step in schedule.steps:
        if step.kind == "node":
            names.append(step.ref)  # type: ignore[arg-type]
            continue
        members = schedule.buckets[step.ref].members  # type: ignore[index]
        unknown = [m for m in members if m not in problem.colls]
        if unknown:
            raise ScheduleError(f"the schedule names collectives the graph does not have: {unknown[:3]}")
        if step.kind == "issue":
            for m in members:
                names += [*problem.colls[m].prologue, m]
        else:
            names += [problem.colls[m].wait for m in members]
            for m in members:
                names += problem.colls[m].epilogue
    nodes = problem.dag.nodes
    placed = set(names)
    head = [n for n in problem.dag.graph["order"] if n not in placed and nodes[n]["kind"] != "output"]
    tail = [n for n in problem.dag.graph["order"] if n not in placed and nodes[n]["kind"] == "output"]
    return in_order(problem, head + names + tail)
