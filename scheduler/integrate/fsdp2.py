"""Whether a compiled graph belongs to a model sharded with FSDP2 (``fully_shard``), whose
collectives never reach the graphs ``torch.compile`` hands to a backend.

FSDP2 all-gathers parameters and reduce-scatters gradients in module hooks that torch wraps in
``torch._dynamo.disable`` (torch 2.13 and 2.14: the traceable-hooks path and its
``torch._dynamo.config.skip_fsdp_hooks`` switch are gone). Dynamo breaks the graph at each
hook, runs the hook eagerly and compiles the code between hooks: the graphs read the gathered
parameters as inputs and hold no collective, so there is nothing to schedule in them.
``docs/FSDP2.md`` records what was tried and how each way fails.

What a backend can see of this:

- its ``example_inputs``: while a module's forward is traced, FSDP2 has registered the
  gathered (unsharded) parameters on it, and those are the tensors dynamo passes as inputs;
  they are the current parameters of a live ``FSDPModule``;
- the live ``fully_shard``-ed modules of the process, from torch's registry of composable
  states (the only place that lists them; read defensively, as a private table).

An inductor post-grad pass sees neither the real inputs nor the module: only the second.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)

#: what a user of FSDP2 can do instead, in one sentence (warnings and report notes end with it)
REMEDY = (
    "to schedule FSDP collectives, shard SimpleFSDP-style so that they are traced into the graph "
    "(parameters as DTensors gathered by a parametrization: models.fsdp.parallelize, torchtitan's "
    "SimpleFSDP), or trace one joint training step and run scheduler.graph_trainer_pass on it "
    "(torchtitan's graph trainer); see docs/FSDP2.md")


def fully_sharded_modules() -> list[Any]:
    """The live modules of this process that ``fully_shard`` manages (FSDP2), in no set order.

    Empty when torch's registry of composable states cannot be read (it is private: a torch
    that moves it turns the detection off, never the pass).
    """
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp import FSDPModule
    except ImportError as e:  # torch without distributed, or the registry moved
        logger.debug("cannot list fully_shard modules: %s", e)
        return []
    return [m for m in list(_module_state_mapping.keys()) if isinstance(m, FSDPModule)]


def count_fully_sharded_inputs(example_inputs: Iterable[Any], modules: list[Any]) -> int:
    """How many of ``example_inputs`` are current parameters of ``modules`` (by identity: the
    gathered parameters FSDP2 registered for the forward being traced, or the sharded ones)."""
    managed = {id(p) for m in modules for p in m.parameters()}
    return sum(1 for x in example_inputs if id(x) in managed)


def fsdp2_evidence(*, has_collectives: bool, n_inputs_read: int = 0) -> str | None:
    """Why a compiled graph is one of an FSDP2 model whose collectives it does not hold, in
    words for a warning; None when nothing says so.

    A graph that reads parameters of ``fully_shard``-ed modules (``n_inputs_read``, counted by
    :func:`count_fully_sharded_inputs` on a backend's inputs) is one, with or without other
    collectives (tensor parallelism's); a graph without collectives is one when such modules
    live in the process.
    """
    if n_inputs_read:
        return f"the graph reads {n_inputs_read} parameter(s) of modules sharded with fully_shard (FSDP2)"
    if has_collectives:
        return None
    modules = fully_sharded_modules()
    if modules:
        return f"{len(modules)} module(s) sharded with fully_shard (FSDP2) live in this process"
    return None


def fsdp2_note(evidence: str) -> str:
    """The warning (and report note) for a graph with FSDP2 ``evidence``."""
    return (f"{evidence}: FSDP2 runs its all-gathers and reduce-scatters in module hooks that "
            f"torch.compile does not trace, so they are not in this graph and fsdp-sched cannot "
            f"schedule them; {REMEDY}")
