"""Training progress and RNG streams that must survive a restart (torch's Stateful protocol)."""

from __future__ import annotations

import os
import random
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch


@dataclass
class TrainState:
    """Counters of committed work. ``step`` counts optimizer steps since the start of training;
    the epoch and the position inside it live in the sampler's state, why training stopped in
    :class:`~elastic_runner.train.stop.StopPolicy`'s."""

    step: int = 0
    samples: int = 0  # samples trained on (sum of global batch sizes)
    evals: int = 0  # validation runs so far
    bad_steps: int = 0  # steps skipped for a non-finite loss or gradient
    bad_in_row: int = 0
    rollbacks: int = 0  # rollbacks to the last checkpoint after max_bad_steps bad steps in a row

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(self):  # keys of other releases are ignored, missing ones keep defaults
            if f.name in state:
                setattr(self, f.name, state[f.name])


class RNGState:
    """Python, numpy, torch (CPU) and CUDA generator states of the saving rank.

    The training loop additionally reseeds the torch generator from ``(seed, epoch, step, rank)``
    before every step (see :func:`~elastic_runner.data.sampler.step_seed`), so model
    randomness (dropout) does not depend on these states; they restore whatever else user code
    draws from the global generators.
    """

    def state_dict(self) -> dict[str, Any]:
        np_state = np.random.get_state(legacy=False)
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": {**np_state, "state": {"key": torch.from_numpy(np_state["state"]["key"]),
                                            "pos": np_state["state"]["pos"]}},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(_tuples(state["python"]))
        np_state = dict(state["numpy"])
        # .cpu(): a state loaded with map_location=<cuda device> (resume, a live peer's state)
        # has these host generators' tensors on the device
        np_state["state"] = {"key": state["numpy"]["state"]["key"].cpu().numpy(),
                             "pos": state["numpy"]["state"]["pos"]}
        np.random.set_state(np_state)
        torch.set_rng_state(state["torch"].cpu())
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _tuples(x: Any) -> Any:
    # torch.save keeps tuples, but be lenient with lists from other writers
    return tuple(_tuples(v) for v in x) if isinstance(x, list | tuple) else x


def seed_step(seed: int, device: torch.device) -> None:
    """Seed the generators one step draws from (dropout): the CPU default generator and, on
    CUDA, the current device's. Same streams as ``torch.manual_seed(seed)``, which would also
    queue a lazy seeding of every other backend (CUDA, XPU, MTIA) and record a Python stack
    trace for each while they are uninitialised: about 1.5 ms per step on a CPU-only machine,
    found by profiling ``bench.overhead``."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


CUBLAS_WORKSPACE = ":4096:8"  # what cuBLAS needs for deterministic results (CUDA >= 10.2)


def use_deterministic_algorithms(on: bool) -> None:
    """``training.deterministic``: ``torch.use_deterministic_algorithms(on)``, cuDNN's
    autotuning off and its deterministic kernels on; on CUDA also ``CUBLAS_WORKSPACE_CONFIG``
    (``:4096:8`` unless set), which cuBLAS reads when its first handle is made, so call this
    before the first matrix product. An operation without a deterministic implementation then
    raises ``RuntimeError`` instead of running (torch's "Reproducibility" notes)."""
    if not on:
        return
    if torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
