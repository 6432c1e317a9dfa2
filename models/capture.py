"""Capture partitioned forward / backward FX graphs of an FSDP training step, without memory.

The model is built on the meta device at full size, sharded by :mod:`models.fsdp` over a
*fake* process group (``dist.init_process_group("fake", ...)``), and compiled with
``torch.compile(backend=aot_autograd(...), fullgraph=True)``; the fw / bw compilers record the
partitioned graphs (min-cut partitioner, as inductor uses). One step (forward + backward) runs
on meta tensors, which moves no data and allocates nothing.

Annotations written on the captured graphs:

- ``node.meta["fsdp_role"]``: ``"fsdp"`` on parameter all-gathers / reduce-scatters and their
  ``wait_tensor``; ``"tp"`` on tensor-parallel collectives (activation all-reduces) and waits;
  ``"other"`` on expert-parallel all-to-alls (MoE token exchange) and waits.
- ``node.meta["fsdp_fqn"]``: the parameter's FQN in the user's module namespace (e.g.
  ``"layers.0.attention.wq.weight"``), on every FSDP collective and its wait.
- ``node.meta["fsdp_param_index"]``: that parameter's index in ``model.named_parameters()``
  order (registration order).
- ``gm.meta["fsdp_graph_kind"]``: ``"forward"`` or ``"backward"``;
  ``gm.meta["fsdp_param_fqns"]``: the parameter FQNs in registration order.

How FQNs are recovered (by data flow, never by node name):
dynamo's example inputs are the real parameter objects, so each dynamo graph input maps to a
parameter by identity. aot_autograd's forward placeholders follow the dynamo inputs in order,
each DTensor contributing its one local tensor (plus opaque script-object placeholders, which
are skipped). A forward all-gather traces back through casts / views to one such primal. In
backward, output j is the gradient of forward input j, so a reduce-scatter is found by walking
back from output j; a backward re-all-gather traces back to a backward placeholder, which is a
saved forward value of the same name, and from there to a primal.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_compiler
from torch._functorch.partitioners import min_cut_rematerialization_partition

from models.build import split_options
from models.fsdp import FSDPOptions, dp_group_names, mesh_for, parallelize
from models.llama import LlamaConfig, Transformer, get_config
from models.moe import PRESETS as MOE_PRESETS
from models.moe import MoEConfig, MoETransformer, moe_meshes, parallelize_moe
from models.moe import get_config as get_moe_config

logger = logging.getLogger(__name__)

_c10d = torch.ops._c10d_functional
ALL_GATHER = _c10d.all_gather_into_tensor.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
ALL_REDUCE = _c10d.all_reduce.default
ALL_TO_ALL = _c10d.all_to_all_single.default
WAIT = _c10d.wait_tensor.default
COLLECTIVES = frozenset({ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL})

# Ops a parameter passes through between its placeholder and its collective (or between a
# collective's wait and a graph output): dtype casts and views, nothing that mixes tensors.
_PASS_THROUGH = frozenset({
    torch.ops.aten._to_copy.default,
    torch.ops.prims.convert_element_type.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.t.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.contiguous.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.split.Tensor,
    WAIT,
})


@dataclass
class CapturedGraphs:
    """Partitioned graphs of one FSDP training step (forward + backward) and their context."""

    forward: fx.GraphModule
    """aot_autograd forward graph (inputs: primals; outputs: loss, then saved values)."""
    backward: fx.GraphModule
    """aot_autograd backward graph (inputs: saved values, tangents; outputs: input grads)."""
    config: LlamaConfig | MoEConfig
    """Model configuration traced."""
    options: FSDPOptions
    """Parallelism options traced."""
    world_size: int
    """Ranks of the (fake) process group."""
    param_fqns: list[str]
    """Parameter FQNs in registration order (index = node.meta['fsdp_param_index'])."""
    example_inputs: dict[str, list[Any]] = field(default_factory=dict)
    """'forward' / 'backward': the fake example inputs aot_autograd gave each compiler."""
    trace_time_s: float = 0.0
    """Wall-clock seconds of the capture."""


def user_fqn(name: str) -> str:
    """'layers.0.attention.wq.parametrizations.weight.original' -> 'layers.0.attention.wq.weight'."""
    return name.replace(".parametrizations.", ".").removesuffix(".original")


# ---------------------------------------------------------------------------------------------
# process group handling


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """A fake process group of ``world_size`` for the duration of the block.

    Reuses an existing fake group of the same size; replaces a fake group of another size and
    restores it afterwards. Refuses to run over a real (non-fake) group, which tracing would
    have to destroy. ``sys.excepthook`` is restored on exit: every ``init_process_group`` wraps
    it in one more ``[rank0]:`` prefix, which would otherwise pile up, one per block entered.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    previous = None
    if dist.is_initialized():
        backend = dist.get_backend()
        if backend != "fake":
            raise RuntimeError(
                f"a real process group ({backend}) is initialised; capture_fsdp_graphs traces on "
                "a fake group: call it in a process without one (or destroy it first)")
        if dist.get_world_size() == world_size and dist.get_rank() == rank:
            yield
            return
        previous = (dist.get_world_size(), dist.get_rank())
        dist.destroy_process_group()
    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if previous is not None:
            dist.init_process_group("fake", store=FakeStore(), rank=previous[1], world_size=previous[0])
        sys.excepthook = hook


#: the notice torch logs whenever a checkpoint is given a ``context_fn`` under torch.compile
_CHECKPOINT_NOTICE = "context_fn is passed to torch.utils.checkpoint under torch.compile"


class _DropCheckpointNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _CHECKPOINT_NOTICE not in record.getMessage()


@contextlib.contextmanager
def _checkpoint_notice_dropped():
    """torch's notice that a checkpoint was given a ``context_fn`` (asking that the region hold
    no in-place op) left out while aot_autograd traces a capture. Every capture passes one: the
    reshard-after-forward all-gather and the selective block checkpoint of :mod:`models.fsdp`,
    whose regions (a redistribute, a LLaMA block) hold no in-place op, so it says nothing the
    user can act on."""
    logger_ = logging.getLogger("torch._higher_order_ops.wrap")
    notice = _DropCheckpointNotice()
    logger_.addFilter(notice)
    try:
        yield
    finally:
        logger_.removeFilter(notice)


# ---------------------------------------------------------------------------------------------
# annotation


def trace_back_to_placeholder(node: fx.Node) -> fx.Node | None:
    """Follow first arguments through pass-through ops up to a placeholder (None if blocked)."""
    while node.op != "placeholder":
        if node.op != "call_function" or (node.target not in _PASS_THROUGH and not _is_getitem(node)):
            return None
        node = node.args[0]
        if not isinstance(node, fx.Node):
            return None
    return node


def _is_getitem(node: fx.Node) -> bool:
    import operator

    return node.op == "call_function" and node.target is operator.getitem


def gradient_collectives(grad: Any) -> list[fx.Node]:
    """The collectives that reduce a gradient graph output, last first: from the output back
    through dtype casts and views to a wait, its collective, and on through the collective's
    input (HSDP: the all-reduce, then the reduce-scatter whose result it reads)."""
    found = []
    node = grad
    while isinstance(node, fx.Node):
        while node.op == "call_function" and node.target is not WAIT and node.target in _PASS_THROUGH:
            node = node.args[0]
        coll = _collective_of(node) if node.op == "call_function" and node.target is WAIT else None
        if coll is None:
            break
        found.append(coll)
        node = coll.args[0]
    return found


def _collective_of(wait: fx.Node) -> fx.Node | None:
    src = wait.args[0]
    return src if isinstance(src, fx.Node) and src.target in COLLECTIVES else None


def _waits_of(collective: fx.Node) -> list[fx.Node]:
    return [u for u in collective.users if u.target is WAIT]


def _group_name(collective: fx.Node) -> str:
    return str(collective.args[-1])


def mark_collective(collective: fx.Node, role: str, fqn: str | None, index: int | None) -> None:
    """Tag ``collective`` and its waits with their FSDP role (``"fsdp"``, ``"tp"``, ...), the
    parameter's name and its registration index, as the export reads them."""
    for n in [collective, *_waits_of(collective)]:
        n.meta["fsdp_role"] = role
        if fqn is not None:
            n.meta["fsdp_fqn"] = fqn
            n.meta["fsdp_param_index"] = index


class _Annotator:
    """Maps graph placeholders to parameters and writes the node / graph metadata."""

    def __init__(self, param_fqns: list[str], dp_group_names: list[str]) -> None:
        self.param_fqns = param_fqns
        self.index_of = {fqn: i for i, fqn in enumerate(param_fqns)}
        self.dp_group_names = set(dp_group_names)
        self.primal_fqn: dict[str, str] = {}  # forward placeholder name -> parameter FQN
        self.forward_inputs: list[str] = []  # forward placeholder names, in order
        self.forward_nodes: dict[str, fx.Node] = {}

    def map_forward_placeholders(self, gm: fx.GraphModule, dynamo_input_fqns: list[str | None],
                                 dynamo_input_shapes: list[torch.Size | None]) -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.forward_inputs = [n.name for n in placeholders]
        self.forward_nodes = {n.name: n for n in gm.graph.nodes}
        tensors = [n for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)]
        if len(tensors) != len(dynamo_input_fqns):
            raise RuntimeError(f"cannot map {len(tensors)} forward tensor inputs onto "
                               f"{len(dynamo_input_fqns)} dynamo inputs")
        for node, fqn, shape in zip(tensors, dynamo_input_fqns, dynamo_input_shapes):
            if shape is not None and tuple(node.meta["val"].shape) != tuple(shape):
                raise RuntimeError(f"forward input {node.name} {tuple(node.meta['val'].shape)} does not "
                                   f"match dynamo input shape {tuple(shape)} ({fqn})")
            if fqn is not None:
                self.primal_fqn[node.name] = fqn

    def _mark_param(self, collective: fx.Node, fqn: str | None) -> None:
        fsdp = fqn is not None and _group_name(collective) in self.dp_group_names
        role = "fsdp" if fsdp else "other" if collective.target is ALL_TO_ALL else "tp"
        mark_collective(collective, role, fqn, self.index_of.get(fqn) if fqn else None)

    def annotate_forward(self, gm: fx.GraphModule) -> None:
        for node in gm.graph.nodes:
            if node.target in COLLECTIVES:
                ph = trace_back_to_placeholder(node.args[0])
                self._mark_param(node, self.primal_fqn.get(ph.name) if ph is not None else None)
        self._finish(gm, "forward")

    def annotate_backward(self, gm: fx.GraphModule) -> None:
        output = gm.graph.find_nodes(op="output")[0]
        grads = output.args[0]
        marked: set[fx.Node] = set()
        # reduce-scatters: walk back from the gradient outputs (output j = grad of forward input j)
        for j, grad in enumerate(grads):
            if not isinstance(grad, fx.Node) or j >= len(self.forward_inputs):
                continue
            fqn = self.primal_fqn.get(self.forward_inputs[j])
            if fqn is None:
                continue
            for coll in gradient_collectives(grad):
                self._mark_param(coll, fqn)
                marked.add(coll)
        # re-gathers (and anything else): trace back to a saved forward value, then to a primal
        for node in gm.graph.nodes:
            if node.target not in COLLECTIVES or node in marked:
                continue
            fqn = None
            ph = trace_back_to_placeholder(node.args[0])
            if ph is not None:
                fqn = self.primal_fqn.get(ph.name)
                fw_node = self.forward_nodes.get(ph.name)
                if fqn is None and fw_node is not None:
                    fw_ph = trace_back_to_placeholder(fw_node)
                    fqn = self.primal_fqn.get(fw_ph.name) if fw_ph is not None else None
            self._mark_param(node, fqn)
        self._finish(gm, "backward")

    def _finish(self, gm: fx.GraphModule, kind: str) -> None:
        gm.meta["fsdp_graph_kind"] = kind
        gm.meta["fsdp_param_fqns"] = list(self.param_fqns)


# ---------------------------------------------------------------------------------------------


def capture_config(name: str, *, world_size: int, n_layers: int | None = None,
                   **options: Any) -> tuple[LlamaConfig | MoEConfig, FSDPOptions]:
    """The model config and FSDP options of a capture (:func:`capture_fsdp_graphs`,
    :func:`models.joint.capture_joint_graph`) from its arguments: a LLaMA preset
    (:data:`models.llama.PRESETS`) or a MoE preset (:data:`models.moe.PRESETS`), whose config
    fields ``options`` may override.

    Raises ValueError for an unknown preset or world_size < 2, TypeError for unknown options.
    """
    config_type, get = (MoEConfig, get_moe_config) if name in MOE_PRESETS else (LlamaConfig, get_config)
    fsdp_kwargs, cfg_kwargs = split_options(options, config_type)
    config = get(name, n_layers=n_layers, **cfg_kwargs)
    fsdp_options = FSDPOptions(**fsdp_kwargs)
    if world_size < 2:
        raise ValueError(f"FSDP capture needs world_size >= 2, got {world_size}")
    return config, fsdp_options


class _StepTraced(Exception):
    """Raised by the compiled forward of a capture that must not run (module docstring)."""


def capture_fsdp_graphs(name: str, *, world_size: int, n_layers: int | None = None,
                        **options: Any) -> CapturedGraphs:
    """Trace one FSDP training step of preset ``name`` on a fake group of ``world_size`` ranks.

    ``options`` are :class:`models.fsdp.FSDPOptions` fields (``param_dtype`` (default bf16),
    ``reduce_dtype``, ``reshard_after_forward`` (default True), ``activation_checkpointing``,
    ``tp_size``) and overrides of the preset's config (:class:`models.llama.LlamaConfig`:
    ``seq_len``, ``batch_size``, ``loss_chunks``, ...; :class:`models.moe.MoEConfig` for the
    MoE presets, such as ``"dsv3-16b"``: also ``ep_size``). The world size counts all ranks
    (dp * tp). Uses no tensor memory at any size: parameters and activations live on the meta
    device.

    A MoE preset is sharded by :func:`models.moe.parallelize_moe` (FSDP x expert parallelism;
    it supports neither tensor parallelism, HSDP / DDP nor activation checkpointing). Its
    all-to-alls' split sizes are read from data (``.tolist()``), which meta tensors do not hold:
    the step is traced (dynamo, aot_autograd, both graphs partitioned and compiled) but never
    run, and ``example_inputs`` hold the fake inputs the compilers received.

    Raises ValueError for an unknown preset or world_size < 2, TypeError for unknown options.
    """
    config, fsdp_options = capture_config(name, world_size=world_size, n_layers=n_layers, **options)
    moe = isinstance(config, MoEConfig)
    start = time.perf_counter()
    logger.info("capturing %s (%d layers) on a fake group of %d ranks, %s",
                config.name, config.n_layers, world_size, fsdp_options)
    torch._dynamo.reset()  # each capture compiles a fresh model: avoid recompile limits / stale caches
    with fake_process_group(world_size):
        if moe:
            meshes = moe_meshes(world_size, config.ep_size)
            with torch.device("meta"):
                model = MoETransformer(config)
            parallelize_moe(model, meshes, fsdp_options)
            fsdp_groups = [meshes.dp.get_group().group_name]
            if meshes.efsdp is not None:
                fsdp_groups.append(meshes.efsdp.get_group().group_name)
        else:
            mesh = mesh_for(world_size, fsdp_options)
            with torch.device("meta"):
                model = Transformer(config)
            parallelize(model, mesh, fsdp_options)
            fsdp_groups = dp_group_names(mesh, fsdp_options)
        named = list(model.named_parameters())
        param_fqns = [user_fqn(n) for n, _ in named]
        fqn_by_id = {id(p): user_fqn(n) for n, p in named}
        annotator = _Annotator(param_fqns, fsdp_groups)
        captured: dict[str, Any] = {}

        def backend(gm: fx.GraphModule, example_inputs):
            logger.info("dynamo graph: %d nodes (%.1f s)", len(gm.graph.nodes), time.perf_counter() - start)
            # dynamo's example inputs are the real parameter objects: map them by identity
            fqns = [fqn_by_id.get(id(x)) for x in example_inputs]
            shapes = [_local_shape(x) for x in example_inputs]

            def fw_compiler(fw_gm: fx.GraphModule, fw_inputs):
                logger.info("forward graph: %d nodes (%.1f s)", len(fw_gm.graph.nodes),
                            time.perf_counter() - start)
                annotator.map_forward_placeholders(fw_gm, fqns, shapes)
                annotator.annotate_forward(fw_gm)
                captured["forward"], captured["forward_inputs"] = fw_gm, list(fw_inputs)
                return _refuse_to_run if moe else fw_gm

            def bw_compiler(bw_gm: fx.GraphModule, bw_inputs):
                logger.info("backward graph: %d nodes (%.1f s)", len(bw_gm.graph.nodes),
                            time.perf_counter() - start)
                annotator.annotate_backward(bw_gm)
                captured["backward"], captured["backward_inputs"] = bw_gm, list(bw_inputs)
                return bw_gm

            with _checkpoint_notice_dropped():
                return aot_autograd(fw_compiler=make_boxed_compiler(fw_compiler),
                                    bw_compiler=make_boxed_compiler(bw_compiler),
                                    partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)

        compiled = torch.compile(model, backend=backend, fullgraph=True)
        tokens = torch.empty((config.batch_size, config.seq_len), dtype=torch.long, device="meta")
        labels = torch.empty((config.batch_size, config.seq_len), dtype=torch.long, device="meta")
        if moe:
            # split sizes read from data become unbacked symbols; the backward is compiled with
            # the forward, since the step never runs
            with torch._dynamo.config.patch(capture_scalar_outputs=True), \
                    torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                try:
                    compiled(tokens, labels)
                except _StepTraced:
                    pass
        else:
            loss = compiled(tokens, labels)
            loss.backward()
    torch._dynamo.reset()
    elapsed = time.perf_counter() - start
    logger.info("captured %s in %.1f s", config.name, elapsed)
    if "forward" not in captured or "backward" not in captured:
        raise RuntimeError("torch.compile did not call the forward and backward compilers")
    return CapturedGraphs(
        forward=captured["forward"], backward=captured["backward"], config=config,
        options=fsdp_options, world_size=world_size, param_fqns=param_fqns,
        example_inputs={"forward": captured["forward_inputs"], "backward": captured["backward_inputs"]},
        trace_time_s=elapsed,
    )


def _refuse_to_run(*args: Any) -> Any:
    raise _StepTraced


def _local_shape(x: Any) -> torch.Size | None:
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return x._local_tensor.shape
    return x.shape if isinstance(x, torch.Tensor) else None
