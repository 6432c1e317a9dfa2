"""Cost model specs: what a user passes as ``cost_model`` turned into a model.

:func:`resolve_cost_model` turns None, a name of :data:`COST_MODELS`, a spec of parts such as
``"table:PATH"``, ``"profile:PATH"`` or ``"compute:torch+table:PATH"`` (:class:`CostSpec`,
:func:`parse_cost_spec`), or an object into a model. What a file measures is fixed; a component
the spec names no model for is open (one model prices it here: the analytic one; the family of
:mod:`scheduler.costs.family` prices it by each plausible model, :func:`spec_cost_model`).

:class:`ComposedCostModel` takes each cost component from another model: compute (and bucket
copies) from one, collectives from another.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from scheduler.costs.hardware import Cluster, GroupInfo, scale_bandwidth
from scheduler.costs.models import (
    AnalyticCostModel,
    CostModel,
    ProfileCostModel,
    TableCostModel,
    ask_model,
    model_name,
    source_of,
)
from scheduler.costs.profiles import ProfileTrace, ProfileTraceError
from scheduler.costs.tables import CollectiveTable, CostTableError
from scheduler.costs.torch_model import TorchCostModel


#: cost models that can be named: ``export_dag(gm, cost_model="torch")``
COST_MODELS: dict[str, type] = {"analytic": AnalyticCostModel, "torch": TorchCostModel}
#: parts of a spec that name a file (:class:`CostSpec`): ``"table:PATH"`` (measured collective
#: times, :meth:`TableCostModel.from_file`) and ``"profile:PATH"`` (compute times from a
#: torch.profiler trace, :class:`ProfileCostModel`)
FILE_COST_MODELS = ("table", "profile")
#: parts of a spec that name the model of one cost component (:class:`CostSpec`)
PART_COST_MODELS = ("compute", "collectives")
#: where a spec splits into parts: a ``+`` followed by a part's keyword (a path may hold ``+``)
_SPEC_SPLIT = re.compile(
    r"\+(?=\s*(?:(?:table|profile|compute|collectives)\s*:|(?:analytic|torch)\s*(?:\+|$)))", re.IGNORECASE)
_SPEC_GRAMMAR = ("'analytic' or 'torch' (the whole model), 'compute:analytic|torch', 'collectives:analytic|torch', "
                 "'table:PATH' (measured collective times: a CSV or nccl-tests output) or 'profile:PATH' (a "
                 "torch.profiler trace), joined by '+'")


def family_label(base: str, factor: float = 1.0) -> str:
    """``"analytic"`` for the cluster as given, ``"analytic bw-30%"`` for bandwidths x 0.7."""
    return base if factor == 1.0 else f"{base} bw{factor - 1:+.0%}"


@dataclasses.dataclass(frozen=True)
class CostSpec:
    """A cost model spec (:func:`parse_cost_spec`): where each cost component comes from.

    A spec is parts joined by ``+`` (keywords in any case, blanks around parts ignored):

    - ``analytic`` / ``torch``: that model prices compute, bucket copies and collectives;
    - ``compute:analytic`` / ``compute:torch``: that model prices compute and bucket copies;
    - ``collectives:analytic`` / ``collectives:torch``: that model prices collectives;
    - ``table:PATH``: measured collective times (a CSV, nccl-tests output or a directory of
      them, :class:`TableCostModel`) price the collectives of the groups they have rows for;
      the other collectives are priced by the collectives model;
    - ``profile:PATH``: a torch.profiler trace (:class:`ProfileCostModel`) prices the compute
      nodes it timed (and the collectives of a gloo group it ran); the other nodes are priced by
      the compute model.

    Each kind at most once; a whole model and a part of the same component conflict
    (``"torch+compute:analytic"``). Examples: ``"table:colls.csv"``,
    ``"compute:torch+table:colls.csv"``, ``"profile:step.json+table:colls.csv"``,
    ``"torch+table:colls.csv"`` (torch's estimators for everything the table does not cover).

    A component the spec names no model for (compute without ``compute:`` or a whole model;
    collectives without ``collectives:`` or a whole model) is open: what a file measured is
    fixed, the rest is uncertain. :func:`resolve_cost_model` prices an open component by the
    analytic model (one model); ``optimize_schedule`` judges every schedule under the family of
    the spec (:func:`scheduler.costs.family.cost_models`), which prices it by each plausible
    model (analytic and torch's estimators; collectives also on scaled bandwidths).
    """

    #: the model of compute and bucket copies (a name of :data:`COST_MODELS`), None: open
    compute: str | None = None
    #: the model of collectives (a name of :data:`COST_MODELS`), None: open
    collectives: str | None = None
    #: the collective table's path
    table: str | None = None
    #: the profiler trace's path
    profile: str | None = None
    #: the spec as written, blanks around it removed (a lone model name in lower case)
    text: str = ""

    @property
    def open_parts(self) -> tuple[str, ...]:
        """The components no model is named for: ``"compute"``, ``"collectives"``."""
        return tuple(part for part, model in (("compute", self.compute), ("collectives", self.collectives))
                     if model is None)

    @property
    def files(self) -> tuple[str, ...]:
        """The paths the spec reads."""
        return tuple(p for p in (self.table, self.profile) if p is not None)


def parse_cost_spec(text: str) -> CostSpec:
    """The :class:`CostSpec` of ``text`` (its grammar there).

    Raises:
        ValueError: a part that is no model name, keyword or file part, a file part without a
            path, a kind given twice or a component named twice; the message names the part
            and lists the valid parts.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"cost model {text!r} names nothing; valid names are {sorted(COST_MODELS)}, or a spec of "
                         f"{_SPEC_GRAMMAR}")
    fields: dict[str, str] = {}
    given: dict[str, str] = {}  # field -> the part that set it, for the error of a second one

    def put(field: str, value: str, part: str) -> None:
        if field in fields:
            what = f"two {field} files" if field in FILE_COST_MODELS else f"the {field} model twice"
            raise ValueError(f"cost model {text!r} names {what} ({given[field]!r} and {part!r}); give one "
                             + ("(a table may be a directory)" if field == "table" else "model per component"))
        fields[field], given[field] = value, part

    for raw in _SPEC_SPLIT.split(text.strip()):
        part = raw.strip()
        kind, colon, value = part.partition(":")
        kind = kind.strip().lower()
        if not colon:
            if kind not in COST_MODELS:
                within = f" in {text!r}" if part != text.strip() else ""
                raise ValueError(f"unknown cost model {part!r}{within}; valid names are "
                                 f"{sorted(COST_MODELS)}, or a spec of {_SPEC_GRAMMAR}; or pass a cost model object "
                                 "with compute_ms, collective_ms and copy_ms")
            put("compute", kind, part)
            put("collectives", kind, part)
        elif kind in PART_COST_MODELS:
            name = value.strip().lower()
            if name not in COST_MODELS:
                raise ValueError(f"cost model {text!r}: {part!r} names no model of {kind}; write {kind}:NAME with "
                                 f"NAME one of {sorted(COST_MODELS)}")
            put(kind, name, part)
        elif kind in FILE_COST_MODELS:
            if not value.strip():
                raise ValueError(f"cost model {text!r} names no file after {kind!r}:; write {kind}:PATH")
            put(kind, value.strip(), part)
        else:
            raise ValueError(f"cost model {text!r}: {part!r} is not a part of a spec; valid names are "
                             f"{sorted(COST_MODELS)}, or a spec of {_SPEC_GRAMMAR}")
    stripped = text.strip()
    lone = stripped.lower() if stripped.lower() in COST_MODELS else stripped
    return CostSpec(text=lone, **fields)


def spec_cost_model(spec: CostSpec, cluster: Cluster | None = None, *, hedge: str = "analytic",
                    bandwidth_factor: float = 1.0, name: str | None = None) -> CostModel:
    """The model of ``spec`` on ``cluster`` (default :class:`Cluster`) whose open components
    (:attr:`CostSpec.open_parts`) are priced by the model ``hedge`` (a name of
    :data:`COST_MODELS`), its collectives on the cluster's bandwidths times
    ``bandwidth_factor``: one member of the spec's family (:mod:`scheduler.costs.family`); the
    defaults give :func:`resolve_cost_model`'s model. Its ``name`` is ``name``, else the spec's
    text.

    Files are read once per content: a spec resolved again (every rank, every candidate
    judged, every member of a family) reuses what was read while the file's size and
    modification time are unchanged.

    Raises:
        ValueError: an unknown ``hedge``, or a file that cannot be read
            (:class:`~scheduler.costs.tables.CostTableError`,
            :class:`~scheduler.costs.profiles.ProfileTraceError`; the message names the spec,
            the file, the line and the field).
    """
    cluster = cluster or Cluster()
    if hedge not in COST_MODELS:
        raise ValueError(f"hedge={hedge!r} must be one of {sorted(COST_MODELS)}")
    if spec.compute is None and spec.collectives is None:
        base: CostModel = COST_MODELS[hedge](scale_bandwidth(cluster, bandwidth_factor),
                                             name=family_label(hedge, bandwidth_factor))
    elif spec.compute == spec.collectives:
        base = COST_MODELS[spec.compute](cluster)
    else:
        collectives = (COST_MODELS[spec.collectives](cluster) if spec.collectives is not None else
                       COST_MODELS[hedge](scale_bandwidth(cluster, bandwidth_factor),
                                          name=family_label(hedge, bandwidth_factor)))
        base = ComposedCostModel(compute=COST_MODELS[spec.compute or hedge](cluster), collectives=collectives,
                                 cluster=cluster)
    model: Any = base
    try:
        if spec.table is not None:
            model = TableCostModel(collectives=_read_cached("table", spec.table), fallback=model, cluster=cluster,
                                   name=f"table:{spec.table}")
        if spec.profile is not None:
            model = ProfileCostModel(_read_cached("profile", spec.profile), fallback=model, cluster=cluster,
                                     name=f"profile:{spec.profile}")
    except (CostTableError, ProfileTraceError) as e:
        raise type(e)(f"cost model {spec.text!r}: {e}") from None
    model.name = name or spec.text or model.name
    return model


def resolve_cost_model(spec: "CostModel | str | None", cluster: Cluster | None = None) -> CostModel:
    """The cost model ``spec`` stands for, on ``cluster`` (default :class:`Cluster`).

    Args:
        spec: None (the analytic model), a name of :data:`COST_MODELS` (``"analytic"``,
            ``"torch"``; case and surrounding blanks ignored), a spec of parts
            (:class:`CostSpec`: ``"table:PATH"``, ``"profile:PATH"``,
            ``"compute:torch+table:PATH"``, ...; a component it leaves open is priced by the
            analytic model: :func:`spec_cost_model`), or a cost model object (any object with
            ``compute_ms``, ``collective_ms`` and ``copy_ms``), returned as is.

    Raises:
        ValueError: an unknown name or a bad spec, a file that cannot be read (the message
            names the file, the line and the field), or an object that is not a cost model;
            the message lists the valid names.
    """
    cluster = cluster or Cluster()
    if spec is None:
        return AnalyticCostModel(cluster)
    if isinstance(spec, str):
        return spec_cost_model(parse_cost_spec(spec), cluster)
    missing = [m for m in ("compute_ms", "collective_ms", "copy_ms") if not callable(getattr(spec, m, None))]
    if missing:
        raise ValueError(
            f"cost_model {spec!r} is not a cost model (it lacks {', '.join(missing)}); pass one of the "
            f"names {sorted(COST_MODELS)}, a spec of {_SPEC_GRAMMAR}, or an object with compute_ms, "
            "collective_ms and copy_ms"
        )
    return spec


def cost_model_files(spec: Any) -> list[list[Any]]:
    """``[[path, size, mtime_ns], ...]`` of the files a cost model spec reads (empty for
    anything else): for caches keyed by the cost model's name, which must change when a file
    does."""
    try:
        paths = parse_cost_spec(spec).files if isinstance(spec, str) else ()
    except ValueError:
        return []
    out = []
    for path in paths:
        out += [[p, size, mtime] for p, mtime, size in _file_key(path) or ()]
    return out


def _read_cached(kind: str, path: str) -> Any:
    """The table or trace in ``path``, read once per (path, sizes, modification times)."""
    key = _file_key(path)
    if key is None:  # missing: the reader raises the error that says so
        return _READERS[kind](path)
    return _read_file(kind, path, key)


@functools.lru_cache(maxsize=16)
def _read_file(kind: str, path: str, key: tuple) -> Any:
    return _READERS[kind](path)


_READERS: dict[str, Callable[[str], Any]] = {"table": CollectiveTable.read, "profile": ProfileTrace}


def _file_key(path: str) -> tuple | None:
    p = Path(path)
    try:
        files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
        return tuple((str(f.resolve()), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    except OSError:
        return None


class ComposedCostModel:
    """A cost model made of parts of others: compute from one model, collectives from another,
    bucket copies from the compute side (or from ``copies``).

    Each part is a cost model object or anything :func:`resolve_cost_model` takes (a name or a
    spec): ``ComposedCostModel(compute="torch", collectives="table:colls.csv")`` prices compute
    by torch's roofline and collectives by the measured table (a group without a row by the
    table's fallback, the analytic model). The spec ``"compute:torch+table:colls.csv"``
    (:class:`CostSpec`) names a model of the same parts.

    What priced each part (``cost_sources`` of :func:`~scheduler.costs.annotate.annotate_costs`)
    and what was measured (``compute_matched`` / ``collective_matched``) are each part's own
    answers.

    Args:
        compute: prices compute nodes (and, unless ``copies`` is given, bucket copies).
        collectives: prices collectives.
        copies: prices the copies into and out of bucket buffers (default: ``compute``'s:
            they are kernels on the compute stream).
        cluster: the topology names and specs are resolved on (default :class:`Cluster`).
        name: the model's name (default: from its parts).
    """

    def __init__(self, *, compute: Any, collectives: Any, copies: Any = None, cluster: Cluster | None = None,
                 name: str | None = None):
        self.cluster = cluster or Cluster()
        self.compute = resolve_cost_model(compute, self.cluster)
        self.collectives = resolve_cost_model(collectives, self.cluster)
        self.copies = self.compute if copies is None else resolve_cost_model(copies, self.cluster)
        self.name = name or f"{model_name(self.compute)} compute + {model_name(self.collectives)} collectives"

    def compute_ms(self, attrs: Mapping[str, Any], fx_node: Any = None) -> float:
        return self.compute.compute_ms(attrs, fx_node)

    def collective_ms(self, coll_type: str, payload_bytes: int, group: GroupInfo) -> float:
        return self.collectives.collective_ms(coll_type, payload_bytes, group)

    def copy_ms(self, nbytes: int) -> float:
        return self.copies.copy_ms(nbytes)

    def compute_matched(self, attrs: Mapping[str, Any], fx_node: Any = None) -> bool | None:
        return ask_model(self.compute, "compute_matched", attrs, fx_node)

    def collective_matched(self, coll_type: str, group: GroupInfo) -> bool | None:
        return ask_model(self.collectives, "collective_matched", coll_type, group)

    def compute_source(self, attrs: Mapping[str, Any], fx_node: Any = None) -> str:
        return source_of(self.compute, "compute_source", attrs, fx_node)

    def collective_source(self, coll_type: str, group: GroupInfo) -> str:
        return source_of(self.collectives, "collective_source", coll_type, group)

    def copy_source(self) -> str:
        return source_of(self.copies, "copy_source")
