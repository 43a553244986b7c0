"""The training sections of a config file: ``model`` (the base of a task's), ``optimizer``,
``schedule``, ``batch``, ``training``, ``eval``, ``early_stopping``, ``distributed`` and
``faults``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, StrictBool, StrictInt, model_validator

from ..config_base import ConfigError, Float, Section, invalid
from ..parallel.config import DDPConfig, FSDPConfig

if TYPE_CHECKING:
    import torch


class ModelConfig(Section):
    """Base of a task's ``model:`` section (a task without one gets the mapping as a dict)."""


class OptimizerConfig(Section):
    """The optimizer, built over the task's parameter groups."""

    name: Literal["adamw", "sgd"] = "adamw"
    """The optimizer: torch's AdamW or SGD (a task's own ``optimizer_fn`` replaces it)."""
    lr: Float = Field(1e-3, gt=0)
    """Peak learning rate (after warm-up); with `batch.global_batch_size` set, the rate of that
    fixed global batch at any world size."""
    weight_decay: Float = 0.0
    """Weight decay: decoupled (AdamW) or an L2 penalty (SGD), on the task's parameter groups
    (default: every parameter)."""
    betas: tuple[Float, Float] = (0.9, 0.999)
    """AdamW's coefficients of the running averages of the gradient and its square."""
    momentum: Float = 0.9
    """SGD's momentum (ignored by AdamW)."""
    fused: Literal["auto"] | StrictBool = "auto"
    """torch's fused kernel (one launch for all parameters; it can skip an update on the device,
    which the lagged step vote needs); `auto`: on CUDA, not on CPU."""

    def fused_on(self, device: torch.device) -> bool:
        """Whether to build the optimizer with ``fused=True`` on ``device``."""
        return device.type == "cuda" if self.fused == "auto" else self.fused


class ScheduleConfig(Section):
    """Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr_ratio * lr``.

    The cosine runs over the optimizer steps left after warm-up until ``training.max_steps`` (or
    ``max_epochs`` worth of steps), as in SGDR (Loshchilov & Hutter, 2017) without restarts.
    """

    name: Literal["cosine", "constant"] = "cosine"
    """`cosine`: linear warm-up, then cosine decay; `constant`: linear warm-up, then the peak rate."""
    warmup_steps: StrictInt = Field(0, ge=0)
    """Optimizer steps of linear warm-up to `optimizer.lr` (step k of w, from 0, uses (k+1)/w of
    it)."""
    min_lr_ratio: Float = Field(0.1, ge=0, le=1)
    """The cosine decays to this fraction of `optimizer.lr` at the last step."""


class BatchConfig(Section):
    """Batch sizes in samples. Global batch = world_size * micro_batch_size * grad_accum_steps.

    The global batch stays the same when the world size changes (nodes leave or join, a restart
    at another size), so the optimisation trajectory and ``optimizer.lr``'s meaning do not
    change: ``grad_accum_steps`` is derived from it at each world size
    (``ceil(global / (world_size * micro_batch_size))``; where that does not divide it, the
    micro-batches differ by at most one sample and each one's loss is weighted by its share:
    ``data/sampler.py``). The global batch is ``global_batch_size`` when set, else the job's
    first: ``world_size * micro_batch_size * grad_accum_steps`` at its first world size, carried
    in its checkpoints and by its live ranks (:meth:`kept`). With ``keep_global_batch: false``
    and no ``global_batch_size``, the per-rank batch is fixed instead and the global batch (and
    so the effective LR per sample) follows the world size; the LR is not rescaled.
    """

    micro_batch_size: StrictInt = Field(32, ge=1)
    """Samples per rank in one forward/backward pass."""
    grad_accum_steps: StrictInt = Field(1, ge=1)
    """Micro-batches per optimizer step on each rank (derived from `global_batch_size` when that is
    set)."""
    global_batch_size: StrictInt | None = None
    """Samples per optimizer step over all ranks, kept when the world size changes (split unevenly,
    each micro-batch's loss weighted by its share, where world size x `micro_batch_size` does not
    divide it); null: the job's first global batch (world size x
    `micro_batch_size` x `grad_accum_steps` at its first world size), kept the same way, unless
    `keep_global_batch` is false."""
    keep_global_batch: StrictBool = True
    """With `global_batch_size` null: keep the job's first global batch when the world size
    changes (true), or keep `grad_accum_steps` and let the global batch follow the world size
    (false)."""

    @model_validator(mode="after")
    def _global_is_multiple(self) -> BatchConfig:
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise invalid("must be a multiple of batch.micro_batch_size", "global_batch_size")
        return self

    @property
    def follows_world_size(self) -> bool:
        """Whether the global batch changes with the world size (``keep_global_batch: false``
        and no ``global_batch_size``)."""
        return self.global_batch_size is None and not self.keep_global_batch

    def kept(self, world_size: int, job_global_batch: int | None) -> BatchConfig:
        """This section with the global batch the job keeps made explicit: unchanged when
        ``global_batch_size`` is set or :attr:`follows_world_size`; else ``global_batch_size``
        becomes ``job_global_batch`` (the job's, from its checkpoint or live ranks), or, for a
        job's first start (None), ``world_size x micro_batch_size x grad_accum_steps``."""
        if self.global_batch_size is not None or self.follows_world_size:
            return self
        first = world_size * self.micro_batch_size * self.grad_accum_steps
        return self.model_copy(update={"global_batch_size": job_global_batch or first})

    def accumulation_for(self, world_size: int) -> int:
        """Micro-batches per optimizer step at ``world_size``: ``ceil(global_batch_size /
        (world_size x micro_batch_size))`` (an uneven split where that does not divide it).

        Raises:
            ConfigError: the split would leave a micro-batch empty (fewer samples than
                micro-batches); the message lists the world sizes (up to 64) it fits.
        """
        if self.global_batch_size is None:
            return self.grad_accum_steps
        g, b = self.global_batch_size, self.micro_batch_size

        def accum(w: int) -> int:
            return -(-g // (w * b))

        if g < world_size * accum(world_size):
            valid = [w for w in range(1, 65) if g >= w * accum(w)]
            raise ConfigError(
                f"batch.global_batch_size: {g} samples cannot give each of world_size "
                f"{world_size} ranks {accum(world_size)} non-empty micro-batch(es) of at most "
                f"micro_batch_size {b}; world sizes it fits: {valid}")
        return accum(world_size)


class TrainingConfig(Section):
    """How long to train and how each optimizer step runs."""

    max_epochs: StrictInt = Field(10, ge=1)
    """Stop after this many passes over the training split."""
    max_steps: StrictInt | None = Field(None, ge=1)
    """Stop after this many optimizer steps (null: no limit); whichever of the two limits comes
    first."""
    grad_clip_norm: Float | None = 1.0
    """Clip the total gradient norm (over all parameters) to this; null: no clipping (the norm is
    still measured)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast dtype of the forward pass: `fp32` (none), `bf16`, or `fp16` with a GradScaler (CUDA
    only)."""
    log_every_steps: StrictInt = Field(10, ge=1)
    """Log the loss, learning rate and throughput every this many optimizer steps (rank 0)."""
    max_bad_steps: StrictInt = Field(3, ge=1)
    """Non-finite steps in a row (each skipped on every rank) before rolling back to the last valid
    checkpoint."""
    lagged_vote: Literal["auto"] | StrictBool = "auto"
    """The step vote decided on the device and read one step later (no host synchronisation per
    step, see `train/consensus.py`); `auto`: on CUDA with a fused optimizer and no sample trace
    (the trace reads every step's loss)."""
    deterministic: StrictBool = False
    """`torch.use_deterministic_algorithms(True)`, cuDNN autotuning off and, on CUDA,
    `CUBLAS_WORKSPACE_CONFIG=:4096:8` unless set (the GPU page says what is bitwise then)."""


class EvalConfig(Section):
    """When the validation split is evaluated (every rank evaluates its shard; the results are
    reduced over ranks)."""

    every_steps: StrictInt = 0
    """Evaluate every this many optimizer steps; 0: at the end of each epoch only."""
    max_batches: StrictInt | None = None
    """Validation batches per rank in one evaluation; null: the whole validation split."""


class EarlyStoppingConfig(Section):
    """Early stopping on an evaluation metric: rank 0 applies the patience rule and broadcasts its
    decision, so every rank stops after the same step."""

    enabled: StrictBool = False
    """Stop when the metric has not improved for `patience` evaluations (rank 0 decides, every rank
    stops at the same step)."""
    metric: str = "val_loss"
    """The evaluation metric to watch (a key of the task's `evaluate` result, e.g. `val_loss`,
    `val_accuracy`)."""
    mode: Literal["min", "max"] = "min"
    """Whether a lower (`min`) or higher (`max`) value is better."""
    patience: StrictInt = Field(3, ge=1)
    """Evaluations without improvement before stopping."""
    min_delta: Float = 0.0
    """An improvement must beat the best value by more than this (in the direction of `mode`)."""


class DistributedConfig(Section):
    """The process group every generation of workers forms, and how the model is spread over
    it."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; `auto`: NCCL on CUDA, gloo on CPU."""
    timeout_seconds: Float = Field(600.0, gt=0)
    """Timeout of collectives and store operations, in seconds."""
    eager_init: StrictBool = True
    """On a GPU, pass the worker's device to `init_process_group` (its `device_id`): NCCL
    creates its communicator at start-up, where the start-up report counts it, and a failure to
    connect shows there; false: at the first collective (torch's default without `device_id`)."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """`ddp`: every rank holds the whole model, optimizer state and gradients
    (DistributedDataParallel); `fsdp`: each rank holds 1/world_size of them (FSDP2,
    `fully_shard`), gathered per unit for forward and backward; checkpoints are then sharded
    (DCP). See docs/guides/ddp-or-fsdp.md."""
    ddp: DDPConfig = Field(default_factory=DDPConfig)
    """DistributedDataParallel's options."""
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    """FSDP2's options."""


class FaultSpec(Section):
    """One injected fault: rank ``rank`` does ``kind`` when it completes global optimizer step
    ``step`` (or its ``after_steps``-th step of the current restart attempt), in restart attempts
    ``0 .. attempts-1``. ``nan`` poisons the loss of ``count`` consecutive steps starting at that
    step; with ``repeat`` it fires again when those steps are replayed after a rollback. ``slow``
    makes ``count`` consecutive steps take ``seconds`` longer on the rank (a straggler)."""

    kind: Literal["sigkill", "sigterm", "raise", "hang", "nan", "slow"] = "sigkill"
    """What the rank does: `sigkill`, `sigterm` (a signal to itself), `raise` (an exception), `hang`
    (blocks forever in the step), `nan` (its loss becomes NaN), `slow` (each step takes longer)."""
    rank: StrictInt = 0
    """The global rank that does it."""
    step: StrictInt | None = None
    """The global optimizer step it fires at (or after); null: use `after_steps`."""
    after_steps: StrictInt | None = None
    """Fire after this many steps of the current restart attempt instead (0: as the attempt begins)."""
    attempts: StrictInt = 1
    """Fire in restart attempts 0 .. attempts-1 (the restart count torchrun gives the workers)."""
    count: StrictInt = 1
    """`nan` and `slow`: the number of consecutive steps it covers."""
    repeat: StrictBool = False
    """`nan`: fire again when the covered steps are replayed after a rollback."""
    seconds: Float = 0.0
    """`slow`: the extra time, in seconds, each covered step takes on the rank."""
    during: Literal["step", "checkpoint", "evaluation", "joining"] = "step"
    """`sigkill`, `sigterm`, `raise`: after the step (`step`), while the step's checkpoint is
    written (`checkpoint`: after the snapshot), as the evaluation after the step begins
    (`evaluation`), or as a replacement joins a running group (`joining`: its process group
    formed, the state not yet agreed; its own steps: `after_steps: 0`)."""


class FaultConfig(Section):
    """Off-by-default fault injection for tests and drills (see ``train/faults.py``). The environment
    variable ``ELASTIC_RUNNER_FAULTS`` (a YAML list of fault specs) is appended to ``inject``."""

    inject: list[FaultSpec] = Field(default_factory=list)
    """The faults to inject (the environment variable `ELASTIC_RUNNER_FAULTS`, a YAML list of the
    same, is appended)."""
    once_dir: str | None = None
    """A directory for marker files that make each fault fire once per job (across restarts and
    nodes); null: each process keeps its own record."""
    planted_metric: list[Float] | None = None
    """Replaces the early-stopping metric of each evaluation in turn (the last repeats): a test of
    the stopping rule."""
    perturb_rank: StrictInt | None = None
    """This rank's weights diverge after loading a checkpoint: a test of the replica check."""
    trigger_file: str | None = None
    """A file watched before each step (one stat): a line `nan rank=R` written from outside makes
    rank R's next loss NaN once, then is removed; `slow rank=R seconds=S` slows rank R by S
    seconds a step while it stands (see `train/faults.py`)."""
