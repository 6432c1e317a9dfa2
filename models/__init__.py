"""Reference FSDP models and the capture of their partitioned forward / backward graphs.

Step 1 of the fsdp-sched pipeline (see DESIGN.md): a LLaMA-3-style decoder family
(:mod:`models.llama`), SimpleFSDP-style sharding with optional tensor parallelism
(:mod:`models.fsdp`), and graph capture on a fake process group: partitioned forward / backward
graphs through torch.compile (:mod:`models.capture`), or one joint forward + loss + backward graph
through make_fx, as torchtitan's graph trainer traces (:mod:`models.joint`).
"""

from models.build import build_model, build_reference_model
from models.capture import CapturedGraphs, capture_fsdp_graphs
from models.fsdp import FSDPOptions
from models.joint import JointGraph, capture_joint_graph
from models.llama import PRESETS, LlamaConfig, list_presets

__all__ = [
    "CapturedGraphs",
    "FSDPOptions",
    "JointGraph",
    "LlamaConfig",
    "PRESETS",
    "build_model",
    "build_reference_model",
    "capture_fsdp_graphs",
    "capture_joint_graph",
    "list_presets",
]
