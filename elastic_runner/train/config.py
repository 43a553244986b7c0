"""The training sections of a config file: ``model`` (the base of a task's), ``optimizer``,
``schedule``, ``batch``, ``training``, ``eval``, ``early_stopping``, ``distributed`` and
``faults``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, StrictBool, StrictInt, model_validator

from ..config_base import ConfigError, Float, Section, invalid

if TYPE_CHECKING:
    import torch


class ModelConfig(Section):
    """Base of a task's ``model:`` section (a task without one gets the mapping as a dict)."""


class OptimizerConfig(Section):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: Float = Field(1e-3, gt=0)
    """Peak learning rate (after warm-up)."""
    weight_decay: Float = 0.0
    betas: tuple[Float, Float] = (0.9, 0.999)
    momentum: Float = 0.9
    """Sgd only."""
    fused: Literal["auto"] | StrictBool = "auto"
    """Torch's fused kernel (one launch for all parameters; it can skip an update on the device,
    which the lagged step vote needs); auto: on CUDA, not on CPU."""

    def fused_on(self, device: torch.device) -> bool:
        """Whether to build the optimizer with ``fused=True`` on ``device``."""
        return device.type == "cuda" if self.fused == "auto" else self.fused


class ScheduleConfig(Section):
    """Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr_ratio * lr``.

    The cosine runs over the optimizer steps left after warm-up until ``training.max_steps`` (or
    ``max_epochs`` worth of steps), as in SGDR (Loshchilov & Hutter, 2017) without restarts.
    """

    name: Literal["cosine", "constant"] = "cosine"
    warmup_steps: StrictInt = Field(0, ge=0)
    min_lr_ratio: Float = Field(0.1, ge=0, le=1)


class BatchConfig(Section):
    """Batch sizes in samples. Global batch = world_size * micro_batch_size * grad_accum_steps.

    With ``global_batch_size`` set, ``grad_accum_steps`` is derived from it and the current world
    size (``global / (world_size * micro_batch_size)``), so the optimisation trajectory does not
    change when nodes come and go; ``optimizer.lr`` is then the LR of that fixed global batch.
    Without it, the per-rank batch is fixed and the global batch (and so the effective LR per
    sample) changes with the world size; the LR is not rescaled automatically.
    """

    micro_batch_size: StrictInt = Field(32, ge=1)
    """Per rank, per forward/backward."""
    grad_accum_steps: StrictInt = Field(1, ge=1)
    """Per optimizer step (ignored with global)."""
    global_batch_size: StrictInt | None = None
    """Samples per optimizer step, constant on resizes."""

    @model_validator(mode="after")
    def _global_is_multiple(self) -> BatchConfig:
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise invalid("must be a multiple of batch.micro_batch_size", "global_batch_size")
        return self

    def accumulation_for(self, world_size: int) -> int:
        """Micro-batches per optimizer step at ``world_size``.

        Raises:
            ConfigError: ``global_batch_size`` is not a multiple of world_size x micro_batch_size;
                the message lists the world sizes (up to 64) that divide it.
        """
        if self.global_batch_size is None:
            return self.grad_accum_steps
        per_step = world_size * self.micro_batch_size
        if self.global_batch_size % per_step:
            valid = [w for w in range(1, 65)
                     if self.global_batch_size % (w * self.micro_batch_size) == 0]
            raise ConfigError(
                f"batch.global_batch_size: {self.global_batch_size} is not divisible by "
                f"world_size {world_size} x micro_batch_size {self.micro_batch_size}; "
                f"valid world sizes: {valid or 'none'}")
        return self.global_batch_size // per_step


class TrainingConfig(Section):
    max_epochs: StrictInt = Field(10, ge=1)
    max_steps: StrictInt | None = Field(None, ge=1)
    """Optimizer steps; whichever limit is first."""
    grad_clip_norm: Float | None = 1.0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Fp16 uses a GradScaler (CUDA only)."""
    log_every_steps: StrictInt = Field(10, ge=1)
    max_bad_steps: StrictInt = Field(3, ge=1)
    """Non-finite steps in a row before a rollback."""
    lagged_vote: Literal["auto"] | StrictBool = "auto"
    """The step vote decided on the device and read one step later (no host synchronisation per
    step, see consensus.LaggedConsensus); auto: on CUDA with a fused optimizer and no sample
    trace (the trace reads every step's loss)."""
    deterministic: StrictBool = False
    """Torch.use_deterministic_algorithms(True), cuDNN autotuning off and, on CUDA,
    CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set (docs/gpu.md says what is bitwise then)."""


class EvalConfig(Section):
    every_steps: StrictInt = 0
    """0: evaluate at the end of each epoch only."""
    max_batches: StrictInt | None = None
    """Per rank; None = the whole validation split."""


class EarlyStoppingConfig(Section):
    enabled: StrictBool = False
    metric: str = "val_loss"
    mode: Literal["min", "max"] = "min"
    patience: StrictInt = Field(3, ge=1)
    """Evaluations without improvement before stopping."""
    min_delta: Float = 0.0


class DDPConfig(Section):
    bucket_cap_mb: Float = 25.0
    static_graph: StrictBool = False
    find_unused_parameters: StrictBool = False


class DistributedConfig(Section):
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Auto: nccl on CUDA, gloo on CPU."""
    timeout_seconds: Float = Field(600.0, gt=0)
    """Collective and store timeout."""
    ddp: DDPConfig = Field(default_factory=DDPConfig)


class FaultSpec(Section):
    """One injected fault: rank ``rank`` does ``kind`` when it completes global optimizer step
    ``step`` (or its ``after_steps``-th step of the current restart attempt), in restart attempts
    ``0 .. attempts-1``. ``nan`` poisons the loss of ``count`` consecutive steps starting at that
    step; with ``repeat`` it fires again when those steps are replayed after a rollback. ``slow``
    makes ``count`` consecutive steps take ``seconds`` longer on the rank (a straggler)."""

    kind: Literal["sigkill", "sigterm", "raise", "hang", "nan", "slow"] = "sigkill"
    rank: StrictInt = 0
    step: StrictInt | None = None
    after_steps: StrictInt | None = None
    attempts: StrictInt = 1
    count: StrictInt = 1
    repeat: StrictBool = False
    seconds: Float = 0.0
    """``slow``: extra time each of ``count`` steps takes on this rank."""
    during: Literal["step", "checkpoint", "evaluation", "joining"] = "step"
    """Sigkill/sigterm/."""


class FaultConfig(Section):
    """Off-by-default fault injection for tests and drills (see ``train/faults.py``). The environment
    variable ``ELASTIC_RUNNER_FAULTS`` (a YAML list of fault specs) is appended to ``inject``."""

    inject: list[FaultSpec] = Field(default_factory=list)
    once_dir: str | None = None
    """Marker files here make each fault fire once per job."""
    planted_metric: list[Float] | None = None
    """Replaces the early-stopping metric, one per eval."""
    perturb_rank: StrictInt | None = None
    """This rank's weights diverge after loading a checkpoint."""
    trigger_file: str | None = None
    """Watched each step (one stat): a line "nan rank=R" written."""
