"""Build models for real execution: FSDP-sharded on a real process group, or an unsharded reference."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from models.fsdp import FSDPOptions, parallelize
from models.llama import LlamaConfig, Transformer, get_config


def split_options(options: dict[str, Any], config_type: type = LlamaConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split keyword options into (FSDPOptions fields, overrides of ``config_type``'s fields);
    TypeError if unknown."""
    fsdp_fields = {f.name for f in dataclasses.fields(FSDPOptions)}
    cfg_fields = {f.name for f in dataclasses.fields(config_type)} - {"name"}
    unknown = set(options) - fsdp_fields - cfg_fields
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)}; FSDP options: {sorted(fsdp_fields)}, "
                        f"config fields: {sorted(cfg_fields)}")
    return ({k: v for k, v in options.items() if k in fsdp_fields},
            {k: v for k, v in options.items() if k in cfg_fields})


def build_reference_model(name: str, *, device: str | torch.device = "cpu", seed: int = 0,
                          n_layers: int | None = None, **config_overrides: Any) -> Transformer:
    """Unsharded model of preset ``name`` with weights initialised from ``seed`` (fp32).

    Same weights as :func:`build_model` with the same name, overrides and seed, on any rank.
    """
    config = get_config(name, n_layers=n_layers, **config_overrides)
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


def build_model(name: str, *, mesh: DeviceMesh, device: str | torch.device = "cpu", seed: int = 0,
                n_layers: int | None = None, **options: Any) -> Transformer:
    """FSDP model of preset ``name`` sharded over ``mesh`` (real or fake process group).

    Every rank initialises the full weights from ``seed`` on CPU (identical across ranks) and
    keeps its shard. ``options`` are FSDPOptions fields and LlamaConfig overrides, as for
    :func:`models.capture_fsdp_graphs`. For numerics against :func:`build_reference_model`,
    pass ``param_dtype=None`` (fp32 compute; the default is bf16). Gradients are summed
    over data-parallel ranks (see :mod:`models.fsdp`).
    """
    fsdp_kwargs, cfg_kwargs = split_options(options)
    model = build_reference_model(name, device=device, seed=seed, n_layers=n_layers, **cfg_kwargs)
    return parallelize(model, mesh, FSDPOptions(**fsdp_kwargs))
