"""Reference FSDP models and the capture of their partitioned forward / backward graphs.

Step 1 of the fsdp-sched pipeline (see DESIGN.md): a LLaMA-3-style decoder family
(:mod:`models.llama`), SimpleFSDP-style sharding with optional tensor parallelism
(:mod:`models.fsdp`), a DeepSeek-V3-style MoE decoder with expert parallelism
(:mod:`models.moe`, presets ``MOE_PRESETS``), and graph capture on a fake process group:
partitioned forward / backward graphs through torch.compile (:mod:`models.capture`, every
preset), or one joint forward + loss + backward graph through make_fx, as torchtitan's graph
trainer traces (:mod:`models.joint`, the LLaMA presets).
"""

from models.build import build_model, build_reference_model
from models.capture import CapturedGraphs, capture_fsdp_graphs
from models.fsdp import FSDPOptions
from models.joint import JointGraph, capture_joint_graph
from models.llama import PRESETS, LlamaConfig, list_presets
from models.moe import PRESETS as MOE_PRESETS
from models.moe import MoEConfig

__all__ = [
    "CapturedGraphs",
    "FSDPOptions",
    "JointGraph",
    "LlamaConfig",
    "MOE_PRESETS",
    "MoEConfig",
    "PRESETS",
    "build_model",
    "build_reference_model",
    "capture_fsdp_graphs",
    "capture_joint_graph",
    "list_presets",
]
