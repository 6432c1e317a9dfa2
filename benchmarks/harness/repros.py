"""Other people's graphs: autoparallel's published FSDP graph repros and their collective tables.

autoparallel (github.com/meta-pytorch/autoparallel, ``autoparallel/tools/overlap_simulator``)
publishes aten-level graphs captured from real FSDP jobs on H100 clusters (``repro_*.py``: a
``Repro`` module, ``load_args``, ``get_pg_config``, ``get_colls_estimations_file`` and, for
DeepSeek-V3, ``get_colls_group_mapping``) and, beside them, collective times measured on those
clusters (``colls*.table``). They are third-party files: this module reads them from a folder
the user fetched; nothing of them is copied into this repository.

:func:`load_repro` traces one repro with ``make_fx`` on fake tensors over a fake process group
whose groups have the ranks a real job gives them, and :func:`table_csv` converts the table it
names into :mod:`scheduler.costs.tables`' CSV for those groups.

How the files are read, and why:

- The repro's tensors live on ``cuda``; on a CPU machine they are traced on ``cpu`` fake tensors
  (the text is rewritten in memory, never on disk). Its ``os.environ`` lines (paths of the job
  that captured it) are dropped. A DeepSeek-V3 repro imports triton for a kernel it only names
  (``triton_kernel_wrapper_functional`` is traced, not run): a stand-in module serves that one
  import when triton is absent, and is removed again before anything else imports triton.
- ``aten.histc`` has no meta kernel in torch 2.13, so fake tensors would run its CPU kernel,
  which refuses the integer input the MoE router gives it: a meta kernel (the output's shape is
  ``(bins,)``) is registered for the process.
- MoE split sizes are read with ``.item()``: the fake mode has a shape environment, so they
  become unbacked symbols as in the original capture.
- Ranks: ``get_pg_config`` gives each group's size only. The tables say which groups are
  inter-node (table group ``"0"``) and intra-node (``"1"``): an intra-node group gets
  consecutive ranks (one node); an inter-node group smaller than the world is the outer mesh
  dimension, strided across nodes (ranks ``0, W/n, 2W/n, ...``); a group of the world size is
  the world. The world size is in the repro's name (``..._64_2d.py``: 64 ranks).
- Table rows: each group is priced by the table group the repro maps it to
  (``get_colls_group_mapping``; else the group of the same name), at the group's own size and
  node count. Sizes are per-rank input MiB (autoparallel's simulator looks them up by the
  collective's input tensor), written as ``input_bytes``.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the graphs of the published comparison: 64 ranks, llama3-8b 1-D and 2-D (FSDP x TP), DeepSeek-V3
PUBLISHED_64 = ("llama3_8b_fw_64_1d", "llama3_8b_bw_64_1d", "llama3_8b_fw_64_2d", "llama3_8b_bw_64_2d",
                "dsv3_fw_64", "dsv3_bw_64")
#: table group names: inter-node and intra-node timings (autoparallel's run.py and repro comments)
INTER_NODE_GROUP, INTRA_NODE_GROUP = "0", "1"
#: the table's collective names -> ours
_TABLE_COLLECTIVES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                      "all_reduce": "all_reduce"}
_MIB = 1 << 20


@dataclass
class Repro:
    """One published graph, traced."""

    name: str
    gm: Any
    world_size: int
    #: group name -> its global ranks (as registered in the fake process group)
    group_ranks: dict[str, list[int]]
    #: the table file the repro names, and how its groups map to the table's
    table_path: Path
    mapping: dict[str, str]


def repro_path(folder: str | Path, name: str) -> Path:
    path = Path(folder) / f"repro_{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: give the folder of autoparallel's "
                                "autoparallel/tools/overlap_simulator (a checkout of github.com/meta-pytorch/autoparallel)")
    return path


def world_size_of(name: str) -> int:
    m = re.search(r"_(\d+)(?:_[12]d)?$", name)
    if m is None:
        raise ValueError(f"no world size in the repro name {name!r} (expected ..._64, ..._64_2d)")
    return int(m.group(1))


def load_repro(folder: str | Path, name: str, *, gpus_per_node: int = 8) -> Repro:
    """Trace ``repro_<name>.py`` of ``folder`` (module docstring) on a fake process group that
    this call initialises (any earlier one is destroyed)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    path = repro_path(folder, name)
    module = _import_repro(path)
    pg_config = module.get_pg_config()
    mapping = module.get_colls_group_mapping() if hasattr(module, "get_colls_group_mapping") else {}
    world = world_size_of(name)
    ranks = group_ranks(pg_config, mapping, world, gpus_per_node)
    _init_groups(ranks, world)
    _register_histc_meta()
    reader = _FakeReader(FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()))
    module.load_args(reader)
    with torch.no_grad():
        gm = make_fx(module.Repro(), tracing_mode="fake")(*reader.args)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return Repro(name=name, gm=gm, world_size=world, group_ranks=ranks,
                 table_path=path.parent / module.get_colls_estimations_file(), mapping=mapping)


def group_ranks(pg_config: dict[str, dict[str, int]], mapping: dict[str, str], world: int,
                gpus_per_node: int) -> dict[str, list[int]]:
    """Each group's global ranks on rank 0's side (module docstring)."""
    out = {}
    for name, info in pg_config.items():
        size = int(info["size"])
        if size == world:
            out[name] = list(range(world))
        elif mapping.get(name, name) == INTRA_NODE_GROUP or size > world // gpus_per_node:
            out[name] = list(range(size))
        else:
            out[name] = [i * (world // size) for i in range(size)]
    return out


def table_csv(repro: Repro, out: Path, *, gpus_per_node: int = 8) -> Path:
    """The repro's table as :mod:`scheduler.costs.tables` CSV rows for its groups (module
    docstring), written to ``out``."""
    sizes_mib, rows = read_table(repro.table_path)
    lines = ["collective,group_size,nodes,input_bytes,ms"]
    for name, ranks in sorted(repro.group_ranks.items()):
        table_group = repro.mapping.get(name, name)
        nodes = len({r // gpus_per_node for r in ranks})
        for (group, collective), times in sorted(rows.items()):
            if group != table_group or collective not in _TABLE_COLLECTIVES:
                continue
            lines += [f"{_TABLE_COLLECTIVES[collective]},{len(ranks)},{nodes},{mib * _MIB},{ms}"
                      for mib, ms in zip(sizes_mib, times)]
    out.write_text("\n".join(lines) + "\n")
    return out


def read_table(path: Path) -> tuple[list[int], dict[tuple[str, str], list[float]]]:
    """(the size columns in MiB, (table group, collective) -> times in ms) of a ``colls*.table``."""
    lines = path.read_text().splitlines()
    sizes = [int(p[:-2]) for p in lines[0].split() if p.endswith("MB")]
    rows = {}
    for line in lines[2:]:
        parts = line.split()
        if len(parts) >= 3 + len(sizes):
            rows[(parts[0], parts[2])] = [float(x) for x in parts[3:3 + len(sizes)]]
    return sizes, rows


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------
class _FakeReader:
    """``torch._dynamo.debug_utils.InputReader``'s interface, making fake tensors of the shapes
    and dtypes the repro records (no data: the graph is traced, not run)."""

    def __init__(self, mode: Any):
        self.mode, self.args = mode, []

    def storage(self, storage_hash: Any, nbytes: int, *, device: Any = None, dtype_hint: Any = None) -> Any:
        return nbytes

    def tensor(self, storage: Any, shape: Any, stride: Any = None, *, storage_offset: Any = None, dtype: Any = None,
               **kw: Any) -> Any:
        import torch
        from torch._prims_common import make_contiguous_strides_for

        with self.mode:
            t = torch.empty_strided(tuple(shape), tuple(stride) if stride is not None else
                                    make_contiguous_strides_for(tuple(shape)), dtype=dtype or torch.float32)
        self.args.append(t)
        return t

    def symint(self, value: int) -> int:
        self.args.append(value)
        return value


def _import_repro(path: Path) -> types.ModuleType:
    # what the repro imports from torch is imported first, so that the triton stand-in below is
    # seen by the repro's own import only
    for name in ("torch._dynamo", "torch._dynamo.testing", "torch._inductor.config", "torch._inductor.inductor_prims",
                 "torch._functorch.config", "torch._higher_order_ops.triton_kernel_wrap", "torch.fx.experimental._config"):
        importlib.import_module(name)
    src = path.read_text()
    src = re.sub(r"^os\.environ\[.*$", "", src, flags=re.M)
    src = src.replace("device(type='cuda', index=0)", "device(type='cpu')")
    module = types.ModuleType(f"repro_{path.stem}")
    module.__file__ = str(path)
    with _triton_stand_in():
        exec(compile(src, str(path), "exec"), module.__dict__)
    return module


@contextlib.contextmanager
def _triton_stand_in() -> Iterator[None]:
    try:
        import triton  # noqa: F401
        yield
        return
    except ImportError:
        pass
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    triton.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    language.constexpr = object
    triton.language = language
    sys.modules["triton"], sys.modules["triton.language"] = triton, language
    try:
        yield
    finally:
        sys.modules.pop("triton", None)
        sys.modules.pop("triton.language", None)


def _init_groups(ranks: dict[str, list[int]], world: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    default = dist.distributed_c10d._get_default_group()
    groups = {name: default if len(r) == world else dist.new_group(r) for name, r in ranks.items()}
    # the graph names its groups "0", "1", "513": register them under those names
    torch._C._distributed_c10d._unregister_all_process_groups()
    for name, pg in groups.items():
        torch._C._distributed_c10d._register_process_group(name, pg)


_HISTC_LIBRARY: Any = None


def _register_histc_meta() -> None:
    global _HISTC_LIBRARY
    if _HISTC_LIBRARY is not None:
        return
    import torch

    _HISTC_LIBRARY = torch.library.Library("aten", "IMPL", "Meta")
    _HISTC_LIBRARY.impl("histc", lambda self, bins=100, min=0, max=0: self.new_empty((bins,)))
