"""The ``distributed.ddp`` and ``distributed.fsdp`` sections of a config file: the options of
each parallelism strategy."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, StrictInt

from ..config_base import Float, Section


class DDPConfig(Section):
    """Options of torch's DistributedDataParallel."""

    bucket_cap_mb: Float | None = Field(25.0, gt=0)
    """DDP's gradient bucket size, in MiB (torch's `bucket_cap_mb`); null: torch's default (25 MiB
    buckets after a first bucket of 1 MiB, which starts the first all-reduce sooner)."""
    static_graph: StrictBool = False
    """DDP's `static_graph`: the same parameters are used in every iteration."""
    find_unused_parameters: StrictBool = False
    """DDP's `find_unused_parameters` (also keeps the bucket layout fixed after a new DDP, which
    bitwise replay with more than two ranks needs)."""


class FSDPConfig(Section):
    """Options of FSDP2 (torch's `fully_shard`), used when `distributed.strategy` is `fsdp`."""

    units: Literal["auto", "blocks", "root"] = "auto"
    """What is sharded as one unit (one all-gather in forward, one reduce-scatter in backward):
    `blocks`: each block of the model's block list (GPT-2's `transformer.h`, DistilBERT's
    `transformer.layer`, any `nn.ModuleList` of repeated layers, or what the task's
    `shard_units(model)` returns), then the root for the rest; `root`: the whole model as one
    unit; `auto`: `blocks` when there are any, else `root`."""
    reshard_after_forward: StrictBool = True
    """Free each block's gathered parameters after its forward and gather them again for its
    backward (ZeRO-3); false keeps them until backward (more memory, less traffic). The root's
    own parameters (what no block holds) are kept until backward either way, as torch's default
    for the root is."""
    replicas: StrictInt = Field(1, ge=1)
    """HSDP: this many replicas, each sharding the model over world_size / replicas ranks (a 2-D
    mesh `(replicas, shards)`; replicas across nodes, shards within one). 1: plain FSDP. The
    world size must be a multiple of it."""
    reduce_dtype: Literal["fp32", "param"] = "fp32"
    """Gradient reduce-scatter dtype with `training.precision: bf16` (FSDP's
    `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=...)`): `fp32` reduces in float32,
    `param` in bf16 (half the traffic, less exact)."""
