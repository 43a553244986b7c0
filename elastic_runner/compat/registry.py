"""The registry of every fix: the supported torch range, the list of fixes assembled from the
area modules, and the start-up check.

Supported torch: :data:`SUPPORTED_TORCH` (mirrored by the torch requirement in pyproject.toml).
CI runs the whole suite on torch 2.13.0 (the CPU wheel pinned in constraints/cpu.txt) and the
fast tier plus three multi-process runs on :data:`NEWEST_TORCH` (``.ci/newest_torch``); 2.14.1
passed the same by hand, and 2.11 ran on GPUs (docs/gpu.md). The lower bound is the one the
project has always declared (the shared agent store that fixes 1 and 3 deal with appeared in
torch 2.4/2.5); releases between it and 2.11 have not been run here.

Each fix in :data:`FIXES` lists the private torch names it (and the code it serves) relies on,
in ``internals``; :func:`check_torch` verifies every one at start-up on whatever torch is
installed, before the fix's own check, and turns the fix off with its warning when one is gone.
Private names are imported inside the function that needs them, never at module top, so a
renamed one disables its fix instead of breaking ``import elastic_runner``. Whatever a fix
serves asks :func:`~elastic_runner.compat.fix.applies` whether the fix is on, so a fix the check
reports off is off. tests/test_compat.py scans the package for private torch names (attributes
read or written, both forms of import, names read by ``getattr``, and what the package's
subclasses of torch classes override) and fails on one no fix lists; it also takes the listed
internals away in a fresh interpreter, all at once and each alone, and checks that the package
imports, that each fix is reported off and that what it serves does without it.

A fix is *required* (a missing internal stops ``run`` with exit code 2 and one line) or
*optional* (a warning, the run goes on). Fix 1 is the only required one (see
:mod:`~elastic_runner.compat.rendezvous`); ``ELASTIC_RUNNER_IGNORE_TORCH_CHECK=1`` turns its
error into a warning for users who must run an untested torch.

A public API that could replace a fix: ``torch.distributed.shrink_group`` (torch 2.10; NCCL
only, through ``ncclCommShrink``; gloo raises ``TypeError``) shrinks a group without new
processes. It fits ``recovery.continue_shrunk`` on NCCL, where the survivors now form a new
group through the recovery store; it cannot add the rank a replacement brings (the common
in-place case), and the CPU CI could not test it, so it is not used yet.
"""

from __future__ import annotations

import logging

import torch
from torch.torch_version import TorchVersion

from ..config_base import ConfigError
from ..protocol import env
from ..protocol.env import IGNORE_CHECK_ENV
from ..protocol.torchrun_env import TorchrunEnv
from . import agent, dcp, ddp, fsdp, optimizers, rendezvous
from .fix import Fix, problem

log = logging.getLogger(__name__)

MIN_TORCH = "2.4"
BELOW_TORCH = "2.16"
SUPPORTED_TORCH = f">={MIN_TORCH},<{BELOW_TORCH}"
NEWEST_TORCH = "2.15.0"  # the newest release CI tests (.ci/newest_torch), beside the pinned 2.13

FIXES: tuple[Fix, ...] = (*rendezvous.FIXES, *agent.FIXES, *ddp.FIXES, *optimizers.FIXES,
                          *dcp.FIXES, *fsdp.FIXES)
"""Every fix, in the order the start-up check reports them."""


class TorchCompatError(ConfigError):
    """The installed torch lacks an internal that a required fix relies on (exit code 2)."""


def private_torch_names() -> set[str]:
    """Every private name (a path component starting with one ``_``) of the internals the
    fixes list: what the package may use of torch's private API."""
    return {part for fix in FIXES for ref in fix.internals
            for part in ref.replace(":", ".").split(".")
            if part.startswith("_") and not part.startswith("__")}


def in_supported_range(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed torch) is in :data:`SUPPORTED_TORCH`."""
    v = TorchVersion(version or torch.__version__)
    return v >= MIN_TORCH and v < BELOW_TORCH


def check_torch(role: str) -> list[str]:
    """Verify, at start-up, the torch internals that ``role``'s fixes rely on (``"agent"``:
    ``elastic-runner run``; ``"worker"``: each rank). Each message names the torch version, the
    fix and what to do. Optional fixes are logged as warnings (in a worker by rank 0 only) and
    returned, with a warning when torch is outside :data:`SUPPORTED_TORCH`.

    Raises:
        TorchCompatError: a required fix cannot apply (unless ``ELASTIC_RUNNER_IGNORE_TORCH_CHECK``
            is 1, which turns it into a warning).
    """
    version = torch.__version__
    warnings: list[str] = []
    for fix in FIXES:
        if role not in fix.roles:
            continue
        why = problem(fix)
        if why is None:
            continue
        if fix.required and not env.ignore_torch_check():
            raise TorchCompatError(
                f"torch {version}: {fix.name} cannot apply ({why}); install torch"
                f"{SUPPORTED_TORCH}, the range elastic-runner supports, or set "
                f"{IGNORE_CHECK_ENV}=1 to run anyway ({fix.without})")
        warnings.append(f"torch {version}: {fix.name} is off ({why}): {fix.without}; "
                        f"elastic-runner supports torch{SUPPORTED_TORCH}")
    if not in_supported_range(version):
        warnings.append(f"torch {version} is outside the range elastic-runner supports "
                        f"(torch{SUPPORTED_TORCH}); the internals it relies on look unchanged")
    if role != "worker" or TorchrunEnv.read().rank == 0:
        for w in warnings:
            log.warning("%s", w)
    return warnings
