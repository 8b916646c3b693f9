"""A pool of real multi-process Gloo worlds for the tests.

Starting N processes that import torch costs seconds on 2 cores, so each world size is started
once per test session and runs many test bodies, and its processes are forked from a server that
imported torch and torch_mp once (multiprocessing's "forkserver", which has started no threads
and initialised nothing a child could inherit half-done). ``World.run(fn, *args)`` runs the
importable function ``fn(*args)`` on every rank, with ``torch.distributed`` initialised (Gloo, short
timeout), and returns the per-rank results; an exception on any rank is raised here with that
rank's traceback. A body that hangs past ``RUN_TIMEOUT_S``, or raises on any rank, kills the world
and fails the test; the next ``conftest.get_world`` starts a fresh one.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

# Every collective in the workers: a hang becomes an error this fast. Generous, because CI machines
# can be slow enough that a healthy 4-rank all-reduce waits 20 s behind its peers' compute; the
# tests that want a fault to surface fast make their own groups with short timeouts.
GROUP_TIMEOUT_S = 60
RUN_TIMEOUT_S = 300  # one test body on all ranks


def free_port() -> int:
    """A TCP port nobody listens on now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, tasks: mp.Queue, results: mp.Queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(size),
        OMP_NUM_THREADS="1",
    )
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    while True:
        # What survived the bodies so far (torch's modules, the tests' and their caches: a heap
        # that grows through the session) is frozen out of the cyclic collector, so that the
        # collections during a body scan only what the body made (each full one took 0.2 to
        # 0.5 s late in a session). The collection here scans only the last body's objects.
        gc.collect()
        gc.freeze()
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException as e:  # noqa: BLE001  (reported to the parent, which raises)
            results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    # torch._dynamo too: torch.optim imports it when the first optimizer is made (1.7 s here).
    ctx.set_forkserver_preload(
        ["torch", "torch._dynamo", "torch.distributed", "torch_mp", __name__]
    )
    return ctx


class World:
    """``size`` worker processes joined in one Gloo world."""

    def __init__(self, size: int) -> None:
        ctx = _context()
        self.size = size
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(size)]
        port = free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, size, port, self._tasks[r], self._results))
            for r in range(size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Runs ``fn(*args)`` on every rank; returns the results in rank order."""
        for q in self._tasks:
            q.put((fn, args))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        for _ in range(self.size):
            try:
                rank, ok, value = self._results.get(timeout=RUN_TIMEOUT_S)
            except queue.Empty as timeout:
                self.close(kill=True)
                raise TimeoutError(
                    f"{fn.__name__} did not finish on all ranks in {RUN_TIMEOUT_S}s"
                ) from timeout
            (results if ok else errors)[rank] = value
        if errors:
            # A body that failed may leave its groups out of step (one rank past a collective the
            # others never reached), and every later body on this world would fail with it: the
            # next get_world starts a fresh one.
            self.close(kill=True)
            first = min(errors)
            raise RankError(first, errors[first], sorted(errors))
        return [results[r] for r in range(self.size)]

    def close(self, kill: bool = False) -> None:
        for p, q in zip(self._procs, self._tasks, strict=True):
            if kill:
                p.kill()
            elif p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)


class RankError(RuntimeError):
    """A test body raised on at least one rank; carries the lowest such rank's traceback."""

    def __init__(self, rank: int, text: str, ranks: list[int]) -> None:
        super().__init__(f"raised on ranks {ranks}; rank {rank}:\n{text}")
        self.rank = rank
        self.text = text
        self.ranks = ranks
