"""Optimizers: what elastic-runner relies on in torch's ``torch/optim/`` (torch 2.13).

16. **A fused optimizer skips an update on the device** (``optim/adam.py``, ``optim/sgd.py``:
   ``_step_supports_amp_scaling``, set by a ``fused=True`` Adam, AdamW or SGD, whose ``step``
   then takes GradScaler's ``found_inf``; optional, worker).
   :func:`~elastic_runner.train.consensus.skips_on_device` reads it for the lagged step vote
   (``training.lagged_vote: auto``), gated on :data:`FIX_LAGGED_VOTE`. Without it the vote reads
   the device every step.
"""

from __future__ import annotations

from .fix import Fix, no_check

FIX_LAGGED_VOTE = Fix(
    "the lagged step vote (a fused optimizer skips an update on the device)", ("worker",),
    False, no_check,
    "the step vote reads the device every step (training.lagged_vote: auto turns it off)",
    ("torch.optim.adam:Adam._step_supports_amp_scaling",
     "torch.optim.sgd:SGD._step_supports_amp_scaling"))

FIXES: tuple[Fix, ...] = (FIX_LAGGED_VOTE,)
