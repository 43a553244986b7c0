"""A SIGTERM to the in-place agent (a pod's eviction, a JobSet's restart) while its monitor tick
talks to the recovery store: torch's handler raises ``SignalException`` there, and the tick's
guard against store errors must let it through (it once swallowed it: the agent went on for
120 s and was SIGKILLed). A real signal, sent to this process, under torch's own handler."""

from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.multiprocessing import api as mp_api

from elastic_runner.agent.inplace_agent import InPlaceAgent


def _agent(watch) -> InPlaceAgent:
    agent = object.__new__(InPlaceAgent)  # only the tick's collaborators: no rendezvous
    agent._joins = SimpleNamespace(joining=False)
    agent._membership = SimpleNamespace(watch_nodes=watch)
    agent._replacer = SimpleNamespace(announce_grow=lambda: None)
    agent._spares = SimpleNamespace(keep=lambda pc: None)
    return agent


@pytest.fixture
def torch_handler():
    before = signal.signal(signal.SIGTERM, mp_api._terminate_process_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_sigterm_during_the_monitor_tick_reaches_torchs_run(torch_handler):
    def watch(store):  # the store read the signal lands in
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(10)  # the handler raises here, in the main thread

    with pytest.raises(mp_api.SignalException) as caught:
        _agent(watch)._keep_up(SimpleNamespace(store=None), None)
    assert caught.value.sigval == signal.SIGTERM


def test_a_store_error_during_the_monitor_tick_is_waited_out(torch_handler):
    def watch(store):
        raise RuntimeError("connection reset by peer")

    assert _agent(watch)._keep_up(SimpleNamespace(store=None), None) is None
