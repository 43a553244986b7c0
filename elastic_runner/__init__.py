"""elastic-runner: fault-tolerant elastic DDP training on torchrun."""

__version__ = "0.1.0"
