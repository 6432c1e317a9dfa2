"""Op times from a torch.profiler trace, looked up for FX nodes by aten op and input shapes.

:class:`ProfileTrace` reads the Chrome trace JSON that ``torch.profiler`` exports
(``prof.export_chrome_trace(path)``, recorded with ``record_shapes=True``) of one training
step, and answers :meth:`ProfileTrace.lookup_ms` for an FX node: the mean time of the profiled
calls of the node's op with the node's input shapes, or None when the trace has no such call.
:class:`scheduler.costs.models.ProfileCostModel` prices compute nodes with it
(``cost_model="profile:PATH"``).

It builds on torch's profile-guided estimation
(``torch._inductor.fx_passes.profile_guided_estimation``):

- a GPU trace (kernel events) is parsed by torch's ``ProfileData``: each CPU op is timed by
  the GPU kernels launched under it;
- a CPU trace (no kernel events: ``ProfilerActivity.CPU`` only, as on this machine) has no
  kernels to sum, so each CPU op event is timed by its own duration (inclusive of the ops it
  calls), parsed by the same ``ProfileData`` op parser. On a CPU the thread that runs the
  graph is its compute stream, and it is also busy between two ops: in Python, and issuing
  collectives (gloo's ``c10d`` calls take the calling thread's time). With ``host_time``
  (the default for CPU traces) an op is charged that time too: from its end to the start of
  the next op under the same parent (a collective's issue in between included, time blocked
  in ``wait_tensor`` not: the simulator models waiting), or to the parent's end after the last
  one. Over a graph's ops this adds up to the time its region took less the waits;
- a node is looked up first with torch's key (op name, input shapes, input strides, dtype;
  ``ProfileData.lookup_op`` with torch's own FX-side helpers), then by op name and input
  shapes alone: torch's FX side keys on the node's *output* dtype and skips tensor-list
  arguments (``cat``, ``stack``), while the profile keys on the first input's dtype and lists
  tensor lists, and eager code may run an op on other strides than the traced graph does.

Collectives: a CPU trace of a gloo group holds each collective's run on gloo's worker thread
(``gloo:all_gather``, ``gloo:all_reduce``, ... with the input's dims and dtype): its duration is
what that collective took in the step that was recorded, with the cores shared with compute as
they were, which a table measured on an idle group does not see. :meth:`ProfileTrace.collective_ms`
answers by kind and per-rank input bytes (the convention of ``payload_bytes`` in
:mod:`scheduler.costs.models`; gloo runs a reduce-scatter as an all-reduce of the full input, so
a reduce-scatter is looked up among both). A rank that issues a collective before its peers
waits for them inside it: given the same step's traces of the other ranks (``peer_traces``),
each collective is timed on the rank that started it last, which waited for no one (the
collectives are matched across ranks by their order, as every rank issues them in the same
order; traces whose sequences differ are not combined, with a warning). The events name no
group: two groups running the same kind on the same bytes share one time. A GPU trace's NCCL
kernels are not read here: the measured collective table is the source for them
(:mod:`scheduler.costs.tables`).
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch.fx

logger = logging.getLogger(__name__)


class ProfileTraceError(ValueError):
    """A trace that cannot be read or holds nothing to price with; the message says why."""


class ProfileTrace:
    """Op times of one profiled step, by (op name, input shapes[, strides, dtype]).

    Args:
        path: a Chrome trace JSON file exported by ``torch.profiler`` (``record_shapes=True``).
        host_time: charge each op of a CPU trace the host time up to the next op too (see the
            module docstring); default True for a CPU trace, and a GPU trace never (its ops are
            timed by their kernels).
        peer_traces: the same step's Chrome traces of the other ranks of the group, to time each
            gloo collective on the rank that started it last (module docstring).

    Attributes:
        device: ``"gpu"`` when ops are timed by their kernels, ``"cpu"`` by their own events.
        n_ops: number of op calls read (with their input shapes).

    Raises:
        ProfileTraceError: a missing or unreadable file, a JSON that is not a Chrome trace, or
            a trace without op events carrying input shapes (recorded without
            ``record_shapes=True``).
    """

    def __init__(self, path: str | Path, *, host_time: bool | None = None, peer_traces: "Sequence[str | Path]" = ()):
        from torch._inductor.fx_passes.profile_guided_estimation import ProfileData

        self.path = Path(path)
        events = _trace_events(self.path)
        self.device = "gpu" if any(e.get("cat") == "kernel" for e in events) else "cpu"
        self.host_time = False
        self._data = ProfileData()
        if self.device == "gpu":
            # torch's parser: each CPU op timed by the kernels launched under it
            try:
                self._data.load(str(self.path))
            except Exception as e:  # the events are checked; what torch's parser refuses besides is named here
                raise ProfileTraceError(f"{self.path}: torch's trace parser cannot read it ({type(e).__name__}: {e}); "
                                        "give the Chrome trace torch.profiler exports, unedited") from None
        else:
            self.host_time = True if host_time is None else bool(host_time)
            for i, ev, us in _cpu_op_times(events, self.host_time):
                try:
                    self._data._parse_op(ev.get("name", ""), ev.get("args") or {}, us)
                except Exception as e:  # torch's parser reads the shapes and types in args
                    raise ProfileTraceError(
                        f"{self.path}: traceEvents[{i}] ({_show(ev.get('name'))}): torch's op parser cannot read its "
                        f"args ({type(e).__name__}: {e}); give the Chrome trace torch.profiler exports, unedited"
                    ) from None
            self._data._build_indices()
        self.n_ops = len(self._data.ops)
        if self.n_ops == 0:
            raise ProfileTraceError(
                f"{self.path}: no op events with input shapes; record the step with "
                "torch.profiler.profile(record_shapes=True)"
                + (" (and CUDA activity: a GPU trace times ops by their kernels)" if self.device == "gpu" else ""))
        #: (kind, input bytes) -> mean ms of the trace's gloo collectives (CPU traces)
        self._collectives = {}
        #: the trace's own gloo collective runs (:func:`_gloo_runs`; CPU traces)
        self._runs = _gloo_runs(events) if self.device == "cpu" else []
        if self.device == "cpu":
            runs = [self._runs]
            for peer in peer_traces:
                runs.append(_gloo_runs(_trace_events(Path(peer))))
            self._collectives = _collective_times(runs, self.path)
        by_shapes: dict[tuple, list[float]] = defaultdict(list)
        for rec in self._data.ops:
            by_shapes[(rec.op_name, rec.input_shapes)].append(rec.duration_us)
        self._by_shapes = {k: sum(v) / len(v) for k, v in by_shapes.items()}
        logger.info("%s: %d %s op calls, %d distinct (op, shapes)", self.path, self.n_ops, self.device,
                    len(self._by_shapes))

    @classmethod
    def of_group(cls, paths: "Sequence[str | Path]", *, host_time: bool | None = None) -> list["ProfileTrace"]:
        """Every rank's trace of one step (``paths[r]``: rank r's), each read once, each timing
        its gloo collectives on the rank that started them last, as ``ProfileTrace(paths[r],
        peer_traces=<the others>)`` does."""
        traces = [cls(p, host_time=host_time) for p in paths]
        for t in traces:
            if t.device == "cpu":
                t._collectives = _collective_times([t._runs, *(u._runs for u in traces if u is not t)], t.path)
        return traces

    def lookup_ms(self, fx_node: "torch.fx.Node") -> float | None:
        """Mean profiled time (ms) of the node's op on its input shapes; None when the trace
        has no call of that op on those shapes (or the node is not an op call)."""
        from torch._inductor.fx_passes import profile_guided_estimation as pge

        if getattr(fx_node, "op", None) != "call_function":
            return None
        name = pge._fx_target_to_profile_name(fx_node)
        if name is None:
            return None
        exact = pge._get_node_input_shapes_and_strides(fx_node)
        if exact is not None:
            ms = self._data.lookup_op(name, exact[0], exact[1], pge._get_node_dtype(fx_node))
            if ms is not None:
                return float(ms)
        shapes = _input_shapes(fx_node)
        if shapes is None:
            return None
        us = self._by_shapes.get((name, shapes))
        return None if us is None else us / 1e3


    def collective_ms(self, coll_type: str, payload_bytes: int) -> float | None:
        """Mean time (ms) of the trace's gloo collectives of ``coll_type`` (``all_gather``,
        ``reduce_scatter``, ``all_reduce``, ``all_to_all``) on ``payload_bytes`` of per-rank
        input; None when the trace ran none such (module docstring)."""
        for kind in _GLOO_KINDS.get(coll_type, ()):
            ms = self._collectives.get((kind, int(payload_bytes)))
            if ms is not None:
                return ms
        return None

    def has_collectives(self, coll_type: str) -> bool:
        """Whether the trace ran any gloo collective that can price ``coll_type``."""
        return any(kind in _GLOO_KINDS.get(coll_type, ()) for kind, _ in self._collectives)


#: the gloo collectives that price each kind of FX collective, in the order tried
_GLOO_KINDS = {"all_gather": ("allgather",), "reduce_scatter": ("reducescatter", "allreduce"),
               "all_reduce": ("allreduce",), "all_to_all": ("alltoall",)}
#: bytes per element of the dtypes the profiler names in ``Input type``
_ITEMSIZE = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "int": 4, "long int": 8,
             "signed char": 1, "unsigned char": 1, "short int": 2, "bool": 1}


def _gloo_runs(events: list[Any]) -> list[tuple[str, int, float, float]]:
    """The ``gloo:*`` collective events of a CPU trace, by start: (kind, per-rank input bytes,
    start us, duration us); the kind is the name after ``gloo:`` without underscores
    (``allgather``)."""
    runs = []
    for e in events:
        if not (isinstance(e, dict) and str(e.get("name", "")).startswith("gloo:") and (e.get("dur") or 0) > 0
                and isinstance(e.get("ts"), (int, float))):
            continue
        args = e.get("args") or {}
        dims, types = args.get("Input Dims"), args.get("Input type")
        if not (isinstance(dims, list) and dims and isinstance(dims[0], list) and isinstance(types, list) and types):
            continue
        size = _ITEMSIZE.get(str(types[0]))
        if size is None or not all(isinstance(d, int) for d in dims[0]):
            continue
        runs.append((e["name"][len("gloo:"):].replace("_", "").lower(), size * math.prod(dims[0]), float(e["ts"]),
                     float(e["dur"])))
    runs.sort(key=lambda r: r[2])
    return runs


def _collective_times(runs: list[list[tuple[str, int, float, float]]], path: Path) -> dict[tuple[str, int], float]:
    """(kind, bytes) -> mean ms over the collectives of ``runs`` (this rank's first, then its
    peers'), each timed on the rank that started it last; this rank's own times where the
    ranks' sequences of (kind, bytes) differ."""
    mine = runs[0]
    if len(runs) > 1 and any([r[:2] for r in other] != [r[:2] for r in mine] for other in runs[1:]):
        logger.warning("%s: the peer traces ran other collectives than this one; collectives are timed on this "
                       "rank alone", path)
        runs = [mine]
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    for i, (kind, n, _, _) in enumerate(mine):
        last = max((run[i] for run in runs), key=lambda r: r[2])
        times[(kind, n)].append(last[3] / 1e3)
    return {k: sum(v) / len(v) for k, v in times.items()}


def _is_collective_call(name: str) -> bool:
    """A c10d call that issues a collective (its host time goes to the op before it)."""
    return ("c10d" in name or name == "record_param_comms") and not _is_wait(name)


def _is_wait(name: str) -> bool:
    return name.endswith("wait_tensor") or name.endswith("::wait")


def _cpu_op_times(events: list[Any], host_time: bool) -> list[tuple[int, dict[str, Any], float]]:
    """Every CPU op event, with its index in ``events`` and the time (us) it is charged: its
    duration, plus with ``host_time`` the host time after it up to the next op under the same
    parent (see the module docstring)."""
    index = {id(e): i for i, e in enumerate(events)}
    ops = [e for e in events if isinstance(e, dict) and e.get("cat") == "cpu_op" and (e.get("dur") or 0) > 0
           and isinstance(e.get("ts"), (int, float))]
    if not host_time:
        return [(index[id(e)], e, float(e["dur"])) for e in ops]
    charged = {id(e): float(e["dur"]) for e in ops}
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        children: dict[int, list[dict[str, Any]]] = defaultdict(list)
        parents: dict[int, dict[str, Any]] = {}
        stack: list[dict[str, Any]] = []
        for e in thread:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack:
                children[id(stack[-1])].append(e)
                parents[id(stack[-1])] = stack[-1]
            stack.append(e)
        for pid, kids in children.items():
            parent_end = parents[pid]["ts"] + parents[pid]["dur"]
            ops_at_level = [k for k in kids if not _is_collective_call(k["name"]) and not _is_wait(k["name"])]
            waits = [k for k in kids if _is_wait(k["name"])]
            for i, k in enumerate(ops_at_level):
                end = k["ts"] + k["dur"]
                nxt = ops_at_level[i + 1]["ts"] if i + 1 < len(ops_at_level) else parent_end
                blocked = sum(w["dur"] for w in waits if end <= w["ts"] < nxt)
                charged[id(k)] += max(0.0, nxt - end - blocked)
    return [(index[id(e)], e, charged[id(e)]) for e in ops]


#: event fields this module reads, and what torch.profiler writes in them
_EVENT_FIELDS = {"name": ("a string", lambda v: isinstance(v, str)),
                 "cat": ("a string", lambda v: isinstance(v, str)),
                 "ts": ("a number (us)", lambda v: _is_number(v)),
                 "dur": ("a number (us)", lambda v: _is_number(v)),
                 "args": ("an object", lambda v: isinstance(v, dict))}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _trace_events(path: Path) -> list[dict[str, Any]]:
    """The ``traceEvents`` of the Chrome trace in ``path``, each an object whose fields this
    module reads have the types torch.profiler writes: what is read later never meets a value
    it cannot compare or index.

    Raises:
        ProfileTraceError: the file cannot be read, is not a Chrome trace, or an event is
            malformed (the message names the file, the event and the field).
    """
    events = _load_json(path).get("traceEvents")
    if not isinstance(events, list):
        raise ProfileTraceError(f"{path}: not a Chrome trace (no 'traceEvents' list); export it with "
                                "torch.profiler's prof.export_chrome_trace(path)")
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise ProfileTraceError(f"{path}: traceEvents[{i}] is not an event object but {_show(e)}; give the "
                                    "Chrome trace torch.profiler exports, unedited")
        for field, (accepted, valid) in _EVENT_FIELDS.items():
            if field in e and not valid(e[field]):
                raise ProfileTraceError(
                    f"{path}: traceEvents[{i}] ({_show(e.get('name'))}) has {field!r} {_show(e[field])}; expected "
                    f"{accepted}, as torch.profiler writes it")
    return events


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _load_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ProfileTraceError(f"{path}: no such trace file; give the Chrome trace JSON of one step "
                                "(torch.profiler: prof.export_chrome_trace(path))")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileTraceError(f"{path}: cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise ProfileTraceError(f"{path}: not JSON (line {e.lineno}, column {e.colno}: {e.msg}); give the "
                                "Chrome trace that torch.profiler exports") from None
    except RecursionError:
        raise ProfileTraceError(f"{path}: its JSON is nested too deeply to be a Chrome trace; give the trace "
                                "torch.profiler exports") from None
    if not isinstance(data, dict):
        raise ProfileTraceError(f"{path}: not a Chrome trace (a JSON {type(data).__name__}, not an object)")
    return data


def _input_shapes(fx_node: "torch.fx.Node") -> tuple | None:
    """The node's positional tensor inputs as the profiler lists them: one shape per tensor,
    a tuple of shapes per tensor list; 0-dim tensors and non-tensors are left out (the
    profiler records ``[]`` for both, and torch's parser drops empty entries)."""
    import torch
    import torch.fx
    from torch._inductor.fx_passes.node_runtime_estimation import get_hint

    def shape(n: Any) -> tuple[int, ...] | None:
        val = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return None
        dims = [get_hint(s) for s in val.shape]
        if any(d is None for d in dims):
            raise _Symbolic
        return tuple(int(d) for d in dims)

    out: list[Any] = []
    try:
        for arg in fx_node.args:
            if isinstance(arg, (list, tuple)):
                shapes = [shape(a) for a in arg]
                if shapes and all(s is not None for s in shapes):
                    out.append(tuple(shapes))
                continue
            s = shape(arg)
            if s:  # a 0-dim tensor is recorded as []: dropped on both sides
                out.append(s)
    except _Symbolic:
        return None
    return tuple(out) if out else None


class _Symbolic(Exception):
    """A shape without a hint: the node cannot be matched by shape."""

