"""The per-attempt process-group namespace handshake, against a real TCPStore.

Simulates what a restarted worker group sees on torchrun's shared agent store: keys left behind by
earlier attempts (including a stale hello of the same rank), and ranks arriving in any order.
"""

import threading
from datetime import timedelta

import torch.distributed as dist

from elastic_runner.dist import attempt_namespace

from .procs import free_port


def run_attempt(port: int, world_size: int, delays: dict[int, float]) -> dict[int, str]:
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            threading.Event().wait(delays.get(rank, 0.0))  # arrival order under test
            store = dist.TCPStore("127.0.0.1", port, is_master=False,
                                  timeout=timedelta(seconds=30))
            results[rank] = attempt_namespace(store, rank, world_size, timeout_s=30)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


def test_each_attempt_gets_one_fresh_namespace_despite_stale_keys():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    seen = set()
    # attempt 1: rank 1 first; attempt 2: rank 0 first; attempt 3: world size shrinks
    for world_size, delays in [(3, {0: 0.3}), (3, {1: 0.3, 2: 0.5}), (2, {})]:
        got = run_attempt(port, world_size, delays)
        assert len(got) == world_size and len(set(got.values())) == 1
        (ns,) = set(got.values())
        assert ns not in seen
        seen.add(ns)
    # a hello left by a dead rank 1 must not be acknowledged in the next attempt's place
    server.set("elastic_runner/attempt/hello/1", "1")
    got = run_attempt(port, 2, {1: 0.2})
    assert len(set(got.values())) == 1 and got[0] not in seen


def _init_in_child(queue) -> None:  # noqa: ANN001 - a multiprocessing.Queue
    from elastic_runner.config_base import ConfigError
    from elastic_runner.own_loop.joining import init_distributed

    try:
        init_distributed()
        queue.put("no error")
    except ConfigError as e:
        queue.put(str(e))


def test_a_scripts_worker_started_by_multiprocessing_is_told_to_use_a_launcher(monkeypatch):
    """``torch.multiprocessing.spawn``'s workers (the DDP tutorial's way) without torchrun's
    environment would each train alone at world size 1: one line names the launchers."""
    import multiprocessing

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_init_in_child, args=(queue,))
    child.start()
    message = queue.get(timeout=60)
    child.join(timeout=60)
    assert "started by multiprocessing" in message and "elastic-runner run" in message, message
