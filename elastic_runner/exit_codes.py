"""The exit codes of ``elastic-runner`` (each command, and ``run``'s agent) and of its workers,
in one place. Each constant's docstring says who exits with it and what the agent does then;
the docs' exit-code reference and ``elastic-runner --help`` are made from them
(:func:`described`).

A worker's code reaches its agent (torchrun's ``ChildFailedError``); ``run`` ends with the
first of fenced out, bad input and preempted that any worker had, else 1 when the job failed.
"""

from __future__ import annotations

import ast
import inspect
import signal
import sys

EXIT_OK = 0
"""The job completed, or the command succeeded (``audit``: every epoch exact)."""

EXIT_FAILED = 1
"""The job failed: a worker failed with ``--max-restarts`` spent, a rendezvous timed out or was
closed, the rendezvous backend failed during the run; or a command failed (``audit``: a sample
was lost or duplicated)."""

EXIT_BAD_INPUT = 2
"""Bad input, said in one line: the config, a command-line argument, the task, a checkpoint of
another model, an unreachable or unsuitable etcd, a torch without an internal a fix needs. A
worker that exits with it is never restarted: the same input would fail again."""

EXIT_FENCED = 3
"""Fenced out: a newer group claimed the checkpoint directory (of this job, or another job
that took the directory over: this job then never claims it again), or declared this node lost
while it was cut off, so this group may commit nothing. Never restarted."""

EXIT_PEER_LOST = 4
"""A worker's collective failed because a peer died or hung; its agent restarts it without
spending ``--max-restarts`` (``restarts.peer_lost``)."""

EXIT_CRASH_LOOP = 5
"""``run``: the same failure repeated ``restarts.crash_loop`` times in a row without a newer
checkpoint, so the job was stopped before spending the rest of ``--max-restarts``."""

EXIT_HANG = 124
"""A worker's step (or long operation) exceeded its watchdog budget: it dumped every thread's
stack and exited (as coreutils' ``timeout`` does), and its agent restarts the group."""

EXIT_INTERRUPTED = 128 + signal.SIGINT
"""A command was interrupted (Ctrl-C) before it finished."""

EXIT_PREEMPTED = 128 + signal.SIGTERM
"""Preempted (SIGTERM, or SIGINT to a worker): the workers checkpointed the last step boundary
and stopped; a restart resumes from there without spending ``--max-restarts``. ``run`` exits
with it too when its node left a running multi-node job in place."""


def described() -> list[tuple[str, int, str]]:
    """``(name, code, meaning)`` of every exit code above, in order, from this module's source
    (the constants' docstrings)."""
    tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    out = []
    for node, doc in zip(tree.body, tree.body[1:], strict=False):
        if (isinstance(node, ast.Assign) and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            name = node.targets[0].id  # type: ignore[attr-defined]
            out.append((name, getattr(sys.modules[__name__], name),
                        " ".join(doc.value.value.split())))
    return out
