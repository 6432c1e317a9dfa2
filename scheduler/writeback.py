"""Write back: a :class:`solvers.core.schedule.Schedule` -> the FX graph it was solved for.

:func:`apply_schedule` rewrites the graph in four steps:

1. **Reorder.** The graph's nodes are moved into the schedule's step order: a node step places
   its compute/view node, an issue step places the prologue nodes (single-use casts / views)
   and the collective of every member of the bucket, a wait step places the members' wait
   nodes, then their epilogue nodes (casts / views of a result that only the graph output
   reads); placeholders come first and the output last. For eager and ``aot_eager`` execution
   the node order of the graph is the execution order.
2. **Merge.** Every bucket of more than one collective is merged with torch's own functions
   (``torch._inductor.fx_passes.bucketing.merge_all_gather_bucket`` /
   ``merge_reduce_scatter_bucket`` / ``merge_all_reduce_bucket``: a DDP or HSDP gradient
   all-reduce bucket is a cat, one all-reduce and a split, as a reduce-scatter bucket), with
   the merged collective inserted at the bucket's issue
   position and the merged wait (plus the copy-out) at its wait position.
3. **Streams.** The all-gathers of each group the schedule splits
   (:attr:`~solvers.core.schedule.Schedule.split_groups`) move to a second process group of the
   same ranks (:func:`second_group`: created once per set of ranks, then reused), so that they
   run on a stream of their own beside the group's reduce-scatters, as the graph trainer's
   ``reassign_collective_pgs_pass`` does.
4. **Pin (optional).** Control dependencies
   (``torch._inductor.fx_passes.control_dependencies.preserve_node_ordering``) so that
   inductor, which reorders by itself (torch 2.14: its ``simple_overlap`` pass), keeps the
   overlap: every collective and wait is chained between the extern compute nodes (matmuls)
   before and after it (:func:`_pin_order`).
5. ``graph.lint()`` and ``gm.recompile()``.

Requirements of torch's merge functions (checked up front, with a message saying what to fix):
an initialised process group in which the graph's group names resolve (a fake group is
enough), FakeTensors in ``meta['val']`` (trace with fake tensors), and exactly one user (the
wait) per collective. A single-use dtype cast feeding an all-gather is folded into the bucket
copy by torch.

Consistency with the simulator: re-exporting a rewritten graph and simulating it as traced
reproduces the schedule's simulation exactly when nothing is merged, and its peak equals the
reference liveness count of the rewritten graph (:mod:`scheduler.check.judge`; the export knows that
``copy_``, ``all_gather_into_tensor_out`` and ``wait_tensor`` return their buffer). With merged
buckets the communication agrees exactly; step time differs by what torch's merge emits that
the simulator prices as one copy-in and one copy-out per bucket: a ``cat`` and a ``copy_``
(into which the member casts are folded) at issue, one ``clone`` per member at the wait
(``benchmarks/writeback_agreement.py`` measures the difference).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from solvers.core.schedule import Schedule, ScheduleError

if TYPE_CHECKING:
    import torch.fx

    from solvers.core.problem import Problem

logger = logging.getLogger(__name__)

PayloadOrder = Literal["registration", "execution"]


def apply_schedule(
    gm: "torch.fx.GraphModule",
    problem: "Problem",
    schedule: Schedule,
    *,
    payload_order: PayloadOrder = "registration",
    control_deps: bool = False,
    bucket_mode: str = "default",
    move_all_gathers: bool = True,
) -> "torch.fx.GraphModule":
    """Rewrite ``gm`` in place to run ``schedule``; returns ``gm`` (torch pass convention).

    Args:
        gm: the graph the schedule's problem was exported from (:func:`scheduler.export_dag`);
            DAG node names are FX node names.
        problem: the :class:`solvers.Problem` of that export.
        schedule: a schedule of ``problem``. Validate it first
            (:func:`scheduler.validate_schedule`): this function checks dependencies while
            reordering but not memory.
        payload_order: order of the members' data in a merged bucket buffer.
            ``"registration"`` (default): by the collectives' ``param_index`` (parameter
            registration order, as FSDP2 does; keeps reduce-scatter numerics bitwise equal to
            eager FSDP2); members without a ``param_index`` keep execution order.
            ``"execution"``: the bucket's member order in the schedule.
        control_deps: add control dependencies that pin the overlap for inductor (default
            False). The pinned graph runs eagerly too, but it can no longer be re-exported.
        bucket_mode: torch's merge implementation (``"default"``: cat + copy into the bucket
            buffer; ``"custom_ops"``: torch's ``bucketing._pre_bucket_all_gather`` op).
        move_all_gathers: move the all-gathers of the schedule's split groups to their second
            group (step 3). False leaves them on their group: the choice among candidates judges
            copies so (:func:`scheduler.check.written.write_and_judge`), so that a second group is
            made only when a schedule is installed, which every rank does for the same schedule.

    Raises:
        ScheduleError: the schedule does not fit the graph (unknown node names, an order that
            breaks a data dependency), or torch's merge preconditions do not hold.
    """
    if payload_order not in ("registration", "execution"):
        raise ValueError(f"payload_order must be 'registration' or 'execution', got {payload_order!r}")
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    order = _step_order(problem, schedule, by_name)
    merged = [b for b in schedule.buckets if len(b.members) > 1]
    if merged:  # checked before anything moves, so that a refusal leaves gm untouched
        _check_merge_preconditions(problem, schedule, by_name)
    # groups are resolved (a new one made) before anything moves, so that a refusal leaves gm
    # untouched
    seconds = {g: second_group(g) for g in schedule.split_groups} if move_all_gathers else {}
    _move_into_order(graph, order)

    with merge_traces_reused():  # buckets of one shape trace alike: trace each once
        for bucket in merged:
            members = _payload_order(problem, bucket.members, payload_order)
            # the reorder placed the members' collectives and waits in member order: the last
            # member's nodes close the issue and wait groups
            last = bucket.members[-1]
            _merge_bucket(
                graph,
                problem,
                [by_name[m] for m in members],
                [by_name[problem.colls[m].wait] for m in members],
                last_coll=by_name[last],
                last_wait=by_name[problem.colls[last].wait],
                bucket_mode=bucket_mode,
            )
    _streams_pins_and_code(gm, seconds, control_deps)
    logger.debug(
        "applied schedule %s: %d buckets (%d merged), payload order %s",
        schedule.digest()[:12],
        len(schedule.buckets),
        len(merged),
        payload_order,
    )
    return gm


def install_schedule(
    gm: "torch.fx.GraphModule",
    problem: "Problem",
    schedule: Schedule,
    *,
    written: "torch.fx.GraphModule | None" = None,
    payload_order: PayloadOrder = "registration",
    control_deps: bool = False,
) -> "torch.fx.GraphModule":
    """Make ``gm`` run ``schedule``: :func:`apply_schedule` on ``gm``, or, given ``written`` (a
    :func:`copy_module` of ``gm`` that ``apply_schedule(..., control_deps=False,
    move_all_gathers=False)`` wrote ``schedule`` on, with this ``payload_order``: the copy a
    candidate was judged on), ``written``'s graph copied into ``gm``'s own
    (:func:`refill_graph`) and steps 3 and 4 done there. Both give the graph that was judged:
    the merges, which cost most of a write-back, are not done twice.

    Raises:
        ScheduleError: as :func:`apply_schedule`.
    """
    if written is None:
        return apply_schedule(gm, problem, schedule, payload_order=payload_order, control_deps=control_deps)
    # resolved (a second group made) before anything changes, so that a refusal leaves gm untouched
    seconds = {g: second_group(g) for g in schedule.split_groups}
    refill_graph(gm.graph, written.graph)
    _streams_pins_and_code(gm, seconds, control_deps)
    return gm


def _streams_pins_and_code(gm: "torch.fx.GraphModule", seconds: dict[str, str], control_deps: bool) -> None:
    """Steps 3 to 5 of :func:`apply_schedule` on a graph whose buckets are merged and ordered:
    the all-gathers of each group of ``seconds`` (group -> its second group) moved there, the
    order pinned (``control_deps``), the graph linted and its code made."""
    if seconds:
        moved = _split_all_gathers(gm.graph, seconds)
        logger.debug("moved %d all-gathers to a second group of the same ranks", moved)
    if control_deps:
        n_deps = _pin_order(gm.graph)
        logger.debug("added control dependencies to %d nodes", n_deps)
    gm.graph.lint()
    gm.recompile()


# --------------------------------------------------------------------------------------------
# 1. reorder
# --------------------------------------------------------------------------------------------
def _step_order(problem: "Problem", schedule: Schedule, by_name: dict[str, "torch.fx.Node"]) -> list:
    """Every FX node of the graph, in the schedule's execution order."""
    names: list[str] = []
    for step in schedule.steps:
        if step.kind == "node":
            names.append(step.ref)  # type: ignore[arg-type]
        elif step.kind == "issue":
            for m in schedule.buckets[step.ref].members:  # type: ignore[index]
                names.extend(problem.colls[m].prologue)
                names.append(m)
        else:
            members = schedule.buckets[step.ref].members  # type: ignore[index]
            # all waits first: a merge moves the merged wait to just after the last one, and
            # every epilogue (a cast of a wait's result) must come after that
            names.extend(problem.colls[m].wait for m in members)
            for m in members:
                names.extend(problem.colls[m].epilogue)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ScheduleError(
            f"the schedule names nodes the graph does not have: {unknown[:5]}; was the problem "
            "exported from this graph module (and the graph not modified since)?"
        )
    placed = set(names)
    if len(placed) != len(names):
        raise ScheduleError("the schedule places a node twice; validate it with validate_schedule()")
    head = [n for n in by_name.values() if n.op in ("placeholder", "get_attr")]
    tail = [n for n in by_name.values() if n.op == "output"]
    missing = [
        n.name for n in by_name.values() if n.name not in placed and n.op not in ("placeholder", "get_attr", "output")
    ]
    if missing:
        raise ScheduleError(
            f"the schedule does not place the graph nodes {missing[:5]}; was the problem exported from "
            "this graph module (and the graph not modified since)?"
        )
    return head + [by_name[n] for n in names] + tail


def _move_into_order(graph: "torch.fx.Graph", order: Sequence["torch.fx.Node"]) -> None:
    """Move nodes into ``order`` after checking it respects every data dependency."""
    seen: set = set()
    for node in order:
        for inp in node.all_input_nodes:
            if inp not in seen:
                raise ScheduleError(
                    f"the schedule runs {node.name!r} before its input {inp.name!r}; "
                    "validate it with validate_schedule() before writing it back"
                )
        seen.add(node)
    output = order[-1]
    for node in order[:-1]:
        output.prepend(node)


# --------------------------------------------------------------------------------------------
# 2. merge
# --------------------------------------------------------------------------------------------
def _payload_order(problem: "Problem", members: Sequence[str], payload_order: PayloadOrder) -> list[str]:
    if payload_order == "execution":
        return list(members)
    indices = [problem.colls[m].param_index for m in members]
    if any(i is None for i in indices):
        logger.debug("bucket %s: collectives without param_index keep execution order", members[:3])
        return list(members)
    return sorted(members, key=lambda m: problem.colls[m].param_index)  # type: ignore[arg-type, return-value]


def require_group_for_merges(schedule: Schedule) -> None:
    """Raise when ``schedule`` merges buckets and no process group is initialised: torch's merge
    functions resolve the graph's process groups by name."""
    import torch.distributed as dist

    if any(len(b.members) > 1 for b in schedule.buckets) and not (dist.is_available() and dist.is_initialized()):
        raise ScheduleError(
            "writing merged buckets back needs an initialised process group in which the graph's groups "
            "resolve; a fake one is enough: torch.distributed.init_process_group('fake', store=FakeStore(), "
            "rank=0, world_size=W) with FakeStore from torch.testing._internal.distributed.fake_pg, or "
            "models.capture.fake_process_group(W) as a context manager")


def _check_merge_preconditions(problem: "Problem", schedule: Schedule, by_name: dict[str, "torch.fx.Node"]) -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    require_group_for_merges(schedule)
    for bucket in schedule.buckets:
        if len(bucket.members) == 1:
            continue
        for m in bucket.members:
            node = by_name[m]
            c = problem.colls[m]
            if c.coll_type not in _MERGE_FUNCTIONS:
                raise ScheduleError(f"bucket {bucket.members[:3]}: cannot merge {c.coll_type} {m!r}")
            if len(node.users) != 1:
                raise ScheduleError(
                    f"collective {m!r} has {len(node.users)} users; torch's merge functions need exactly "
                    "one (its wait_tensor)"
                )
            if not isinstance(node.meta.get("val"), FakeTensor):
                raise ScheduleError(
                    f"collective {m!r} has no FakeTensor in meta['val']; torch's merge functions trace "
                    "with the graph's fake mode: capture the graph with fake tensors (aot_autograd, or "
                    "make_fx(..., tracing_mode='fake'))"
                )


def _merge_bucket(
    graph: "torch.fx.Graph",
    problem: "Problem",
    colls: list["torch.fx.Node"],
    waits: list["torch.fx.Node"],
    *,
    last_coll: "torch.fx.Node",
    last_wait: "torch.fx.Node",
    bucket_mode: str,
) -> None:
    """Merge one bucket in place.

    The merged collective (with its copy-in) goes just before the first node after the
    members' issue group that is not one of the bucket's own nodes; the merged wait (with its
    copy-out) just before the node after the members' last wait. The reorder put the members'
    collectives (and their waits) next to each other, so these are the issue and wait
    positions of the schedule.
    """
    from torch._inductor.fx_passes import bucketing

    own = set(colls) | set(waits)
    insert_before = last_coll.next
    while insert_before in own:
        insert_before = insert_before.next
    wait_insertion_point = last_wait.next
    c0 = problem.colls[colls[0].name]
    merge = getattr(bucketing, _MERGE_FUNCTIONS[c0.coll_type])
    fqns = [f for n in colls for f in problem.colls[n.name].fqns]
    indices = [problem.colls[n.name].param_index for n in colls]
    # torch records each merged node's provenance with a deep copy of every member's own
    # provenance chain, per new node, and aot_autograd's chains are long. The chains are
    # shared instead (provenance is read, never changed), so the record is the same.
    provenance = {n.name: n.meta.pop("from_node") for n in colls if "from_node" in n.meta}
    try:
        new_nodes, _ = merge(
            graph,
            colls,
            mode=bucket_mode,  # type: ignore[arg-type]
            insert_before=insert_before,
            wait_insertion_point=wait_insertion_point,
        )
    except BaseException:
        for n in colls:
            if n.name in provenance:
                n.meta["from_node"] = provenance[n.name]
        raise
    for n in new_nodes:
        for source in n.meta.get("from_node", ()):
            info = getattr(source, "node_info", None)
            if info is not None and info.name in provenance:
                source.from_node = list(provenance[info.name])
    new_coll = next(n for n in new_nodes if _is_collective(n))
    # Keep the FSDP annotations on the merged collective (reports, re-export).
    new_coll.meta["fsdp_fqn"] = fqns
    new_coll.meta["fsdp_role"] = "fsdp"
    new_coll.meta["fsdp_param_index"] = next((i for i in indices if i is not None), None)
    new_coll.meta["fsdp_sched_members"] = [n.name for n in colls]


def copy_graph(graph: "torch.fx.Graph") -> "torch.fx.Graph":
    """A copy of ``graph`` with the same node names, each node's ``meta`` a shallow copy (its
    values, FakeTensors included, shared: a write-back sets meta entries, never changes their
    values), to restore a graph or to write a schedule on a copy."""
    import torch.fx

    out = torch.fx.Graph()
    out._codegen = copy.deepcopy(graph._codegen)
    value, output_node = out.graph_copy(graph, {}, return_output_node=True)
    new_output = out.output(value, type_expr=output_node.type)
    new_output.meta = dict(output_node.meta)
    return out


def refill_graph(graph: "torch.fx.Graph", source: "torch.fx.Graph") -> None:
    """Make ``graph``, the same object, hold a copy of ``source``'s nodes with their names, each
    node's ``meta`` a shallow copy (as :func:`copy_graph`). An inductor pass is handed the graph
    object and must leave its answer there (inductor keeps reading that object), so a graph is
    restored or replaced by refilling it, never by assigning ``gm.graph`` another one."""
    import torch.fx

    for node in reversed(graph.nodes):
        graph.erase_node(node)
    # an erased node's name stays taken in the graph's namespace: a fresh one lets every copy
    # keep its name
    graph._graph_namespace = torch.fx.graph._Namespace()
    value, output_node = graph.graph_copy(source, {}, return_output_node=True)
    new_output = graph.output(value, type_expr=output_node.type)
    new_output.meta = dict(output_node.meta)


def copy_module(gm: "torch.fx.GraphModule") -> "torch.fx.GraphModule":
    """A GraphModule over :func:`copy_graph` of ``gm``'s graph, sharing ``gm``'s attributes and
    a shallow copy of its ``meta``: a copy to write a candidate schedule on, far cheaper than a
    deep copy. Its Python code is made when first read or run, not at every ``recompile``
    (torch's ``_LazyGraphModule``, where this torch has it): a candidate's copy is judged on its
    graph and installed by copying that graph into ``gm`` (:func:`install_schedule`), and torch's
    pass run as a start is read back from its graph, so code made for either copy was made for
    nothing, and on a large graph making it costs as much as copying the graph."""
    import torch.fx

    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule as module_cls
    except ImportError:  # a torch without it: the code is made at once, the copy is the same
        module_cls = torch.fx.GraphModule
    out = module_cls(gm, copy_graph(gm.graph), class_name=type(gm).__name__)
    out.meta = dict(gm.meta)
    return out


# --------------------------------------------------------------------------------------------
# 3. streams
# --------------------------------------------------------------------------------------------
#: ranks -> the name of the second group made for them (checked to resolve before reuse: a
#: process group torn down and made again gives other names)
_SECOND_GROUPS: dict[tuple[int, ...], str] = {}


def second_group(group_name: str) -> str:
    """The name of a second process group of the same ranks as ``group_name``, made with
    ``torch.distributed.new_group(ranks, use_local_synchronization=True)`` the first time (only
    the group's own ranks take part, each once, in the order the schedule lists its split
    groups: identical on every rank, whose schedules agree) and reused after. Only installing a
    schedule makes one, never judging a candidate, so every rank makes the same ones.

    Raises:
        ScheduleError: no process group is initialised, or ``group_name`` does not resolve in it.
    """
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not (dist.is_available() and dist.is_initialized()):
        raise ScheduleError("a schedule that puts all-gathers on a second stream needs an initialised process group "
                            "(a fake one is enough, models.capture.fake_process_group) to make that stream's group")
    try:
        ranks = tuple(dist.get_process_group_ranks(_resolve_process_group(group_name)))
    except Exception as e:
        raise ScheduleError(f"process group {group_name!r} of the graph does not resolve in the initialised process "
                            f"group ({type(e).__name__}: {e}); its all-gathers cannot get a second group") from e
    name = _SECOND_GROUPS.get(ranks)
    if name is not None:
        try:
            _resolve_process_group(name)
            return name
        except Exception:
            pass  # the world was torn down and made again since
    group = dist.new_group(list(ranks), use_local_synchronization=True)
    _SECOND_GROUPS[ranks] = name = group.group_name
    logger.info("fsdp-sched: made process group %s of the ranks of %s for its all-gathers", name, group_name)
    return name


def split_all_gathers(gm: "torch.fx.GraphModule", groups: Sequence[str]) -> int:
    """Move every all-gather of ``groups`` in ``gm`` to a second group of the same ranks
    (:func:`second_group`), as a split schedule's write-back does; for graphs written by other
    passes. Returns how many moved."""
    moved = _split_all_gathers(gm.graph, {g: second_group(g) for g in sorted(groups)})
    gm.recompile()
    return moved


def _split_all_gathers(graph: "torch.fx.Graph", seconds: dict[str, str]) -> int:
    """Point every all-gather of a group in ``seconds`` at its second group; returns how many."""
    moved = 0
    for node in graph.nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", "") != "_c10d_functional":
            continue
        if "all_gather" not in str(node.target):
            continue
        # functional all-gathers take (input, group_size, group_name, *, out)
        args = list(node.args)
        if len(args) > 2 and args[2] in seconds:
            args[2] = seconds[args[2]]
            node.args = tuple(args)
            moved += 1
        elif node.kwargs.get("group_name") in seconds:
            node.kwargs = {**node.kwargs, "group_name": seconds[node.kwargs["group_name"]]}
            moved += 1
    return moved


#: torch's merge function (``torch._inductor.fx_passes.bucketing``) of each collective type
_MERGE_FUNCTIONS = {
    "all_gather": "merge_all_gather_bucket",
    "reduce_scatter": "merge_reduce_scatter_bucket",
    "all_reduce": "merge_all_reduce_bucket",
}


def _is_collective(node: "torch.fx.Node") -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", "") == "_c10d_functional" and not (
        "wait_tensor" in str(node.target)
    )


class _TraceMemo:
    """Traces of torch's bucket merge functions, by the fake mode, the function and the
    arguments' shapes: torch's merge functions trace a small function with make_fx for every
    bucket, which costs far more than the rest of a write-back, and a model's repeated blocks
    give buckets of few shapes. A traced function is only copied into a graph (``node_copy``),
    never changed, so one trace serves every bucket of its key, its FakeTensors propagated
    afresh from each bucket's inputs."""

    def __init__(self) -> None:
        import weakref

        #: fake mode -> key -> traced GraphModule (a fake mode's traces go when it does: the
        #: traced nodes carry its FakeTensors, which must not meet another mode's)
        self.by_mode: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
        #: traces reused, and traces made (keyed or not)
        self.hits = 0
        self.misses = 0
        #: a reused trace gets FakeTensors propagated afresh from its bucket's inputs (False only
        #: inside :func:`merge_values_shared`)
        self.fresh_values = True

    @staticmethod
    def key(fn: Any, inps: Any) -> tuple | None:
        """A hashable description of a trace's inputs; None when one is not describable
        (symbolic sizes: a trace may then depend on the shape environment)."""
        import torch
        import torch.utils._pytree as pytree

        parts: list[Any] = [getattr(fn, "__module__", ""), getattr(fn, "__qualname__", repr(fn))]
        for leaf in pytree.tree_leaves(inps):
            if isinstance(leaf, torch.Tensor):
                shape, stride = tuple(leaf.shape), tuple(leaf.stride())
                if not all(isinstance(x, int) for x in (*shape, *stride)):
                    return None
                parts.append(("T", shape, stride, leaf.dtype, str(leaf.device)))
            elif isinstance(leaf, (int, float, str, bool, torch.dtype, torch.device)) or leaf is None:
                parts.append((type(leaf).__name__, leaf))
            else:
                return None
        parts.append(pytree.tree_structure(inps))
        try:
            hash(tuple(parts))
        except TypeError:
            return None
        return tuple(parts)


_MEMO = _TraceMemo()


@contextlib.contextmanager
def merge_traces_reused():
    """While merging: torch's ``bucketing._trace`` memoized (:class:`_TraceMemo`), and its
    ``_populate_node_meta`` run once per bucket (:func:`_shared_node_meta`)."""
    import torch.utils._pytree as pytree
    from torch._dynamo.utils import detect_fake_mode
    from torch._inductor.fx_passes import bucketing
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    original = bucketing._trace
    original_meta = bucketing._populate_node_meta

    def trace(fn: Any, inps: Any) -> Any:
        mode = detect_fake_mode(inps)
        key = _TraceMemo.key(fn, inps) if mode is not None else None
        if key is None:
            _MEMO.misses += 1
            return original(fn, inps)
        traces = _MEMO.by_mode.setdefault(mode, {})
        if key not in traces:
            _MEMO.misses += 1
            traces[key] = original(fn, inps)
            return traces[key]
        _MEMO.hits += 1
        # fresh FakeTensors for this bucket: two buckets must not share a storage, or a count of
        # storages (torch's MemoryTracker, inductor) takes them for one
        traced = traces[key]
        if _MEMO.fresh_values:
            FakeTensorProp(traced, mode).propagate_dont_convert_inputs(*pytree.tree_leaves(inps))
        return traced

    bucketing._trace = trace
    bucketing._populate_node_meta = functools.partial(_shared_node_meta, original_meta)
    try:
        yield
    finally:
        bucketing._trace = original
        bucketing._populate_node_meta = original_meta


@contextlib.contextmanager
def merge_values_shared():
    """Inside :func:`merge_traces_reused`: a reused trace keeps the FakeTensors of the bucket it
    was last propagated for (same shapes, shared storages). Only for graphs whose values nothing
    reads after the merges: a graph read for its structure alone (torch's pass run as a start,
    once its bucketer has decided, :mod:`scheduler.torch_overlap`), never one that is run,
    counted or installed."""
    _MEMO.fresh_values = False
    try:
        yield
    finally:
        _MEMO.fresh_values = True


def _shared_node_meta(populate: Any, bucket_nodes: list["torch.fx.Node"], new_nodes: list["torch.fx.Node"]
                      ) -> None:
    """torch's ``_populate_node_meta(bucket_nodes, new_nodes)`` (``populate``) run once, on a
    stand-in node, what it wrote there given to every new node. It gives every new node the same
    record, built from the bucket's members alone, but builds it afresh per node: a provenance
    entry per member and new node, each formatting its member's op, which on a bucket of many
    members costs more than the merge itself. Each node gets its own containers of the same
    (read-only) entries. Should torch's function need more of a node than its ``meta``, it runs
    as torch calls it."""
    stand_in = types.SimpleNamespace(meta={})
    try:
        populate(bucket_nodes, [stand_in])
    except AttributeError:
        populate(bucket_nodes, new_nodes)
        return
    for n in new_nodes:
        n.meta.update({k: copy.copy(v) for k, v in stand_in.meta.items()})


# --------------------------------------------------------------------------------------------
# 4. control dependencies
# --------------------------------------------------------------------------------------------
def pin_order(gm: "torch.fx.GraphModule") -> int:
    """Pin ``gm``'s current order of collectives, waits and extern compute with control
    dependencies (as ``apply_schedule(control_deps=True)`` does after writing a schedule), for
    a graph rewritten by other code (torch's overlap scheduler); returns how many nodes got
    extra dependencies."""
    n_deps = _pin_order(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return n_deps


def _pin_order(graph: "torch.fx.Graph") -> int:
    """Pin the written order of collectives and waits relative to the extern compute around
    them with control dependencies; returns how many nodes got extra dependencies.

    The anchors are the collectives, the waits and the compute nodes inductor lowers to an
    extern kernel (matmuls, attention, custom ops: :func:`_is_extern_compute`), chained in
    graph order: each anchor depends on the one before it. Both sides of every overlap window
    are fixed: an issue can neither rise above the matmul before it nor sink below the one
    after it, and the same for a wait. Matmuls are chained to each other too: inductor moves
    a matmul whose inputs are ready above a wait it does not read. Dependencies that are
    already data dependencies are left out.

    Only extern nodes are pinned, because inductor realises every dependency of a
    control_deps node: a pointwise node that it would otherwise inline into its consumer
    then becomes a buffer of the node's dtype, and a bf16 product that a fused reduction
    used to sum in fp32 gets rounded to bf16 first. An extern kernel's inputs and
    output are buffers anyway.
    """
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    anchors = [n for n in graph.nodes if _is_collective(n) or _is_wait(n) or _is_extern_compute(n)]
    deps: dict = {}
    for before, node in zip(anchors, anchors[1:]):
        if before not in node.all_input_nodes:
            deps[node] = OrderedSet([before])
    # in graph order: a dependency that is itself wrapped earlier is remapped by torch
    preserve_node_ordering(graph, deps)
    return len(deps)


def _is_wait(node: "torch.fx.Node") -> bool:
    from torch._inductor.fx_passes.bucketing import is_wait_tensor

    return is_wait_tensor(node)


def _is_extern_compute(node: "torch.fx.Node") -> bool:
    """A compute node that inductor lowers to an extern kernel, whose inputs it realises and
    whose output is a buffer: a matmul, an op in ``needs_realized_inputs`` (attention,
    convolution, ...) or an op with neither a lowering nor a decomposition (inductor falls
    back to it; custom ops such as a flash attention). The last test is needed because
    inductor adds a fallback to ``needs_realized_inputs`` only when it first lowers it: the
    set depends on what the process compiled before."""
    import torch
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import lowerings, needs_realized_inputs

    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target.namespace == "_c10d_functional":
        return False
    if target.namespace == "aten" and target.overloadpacket.__name__ in _MATMULS:
        return True
    return target in needs_realized_inputs or (target not in lowerings and target not in select_decomp_table())


#: aten matmuls whose lowerings realise their inputs themselves (mm_args) and are not all in
#: ``needs_realized_inputs`` (addmm, baddbmm, _scaled_mm)
_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_int_mm"})
