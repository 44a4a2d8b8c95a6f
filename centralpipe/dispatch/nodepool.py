"""``central="node"``: the shared stages' parallel streams and the node-wide pool.

A ``parallel=True`` stage before ``shard()`` (the seed pipeline's tokenizer)
is one of the node's shared stages (:mod:`centralpipe.dispatch.node`): it
runs once per node, so its stream is the node's, not a rank's.
:class:`SharedSegments` owns it: a pool of ``num_workers`` workers for the
whole node (the issue's "``num_workers`` per node") and, for each epoch (or
the rest of one after a load), one :class:`~centralpipe.dispatch.run.Run`
over the shared stages whose parallel streams feed those stages in order.
That run has no dispatch stream of its own to drive (its tip is never
pulled): the ranks' feeders pull the shared stages under the node's one
chain lock (``NodeStream.advance``), and each parallel stage's ``next()``
sends its inputs to the node's workers and waits for its head result there,
as in ``central="process"``.

Each rank's dispatch stream keeps its own workers (``num_workers // W``, as
before): a pool is read by one run's supervisor, and the ranks' runs start
and stop on their own (a rank's new epoch, a rank's load), so the worker
stages after ``dispatch()`` cannot share the shared stages' pool without one
supervisor for every rank's runs. On the seed pipeline those stages (``pad``)
are a few percent of the work, and an idle worker costs no CPU.

Checkpoints: :meth:`SharedSegments.capture` is the shared stages' states
and each parallel stage's in-flight entry at their head (the caller holds
the chain lock): ``Run.capture``, as in ``central="process"``; every
rank's ``state_dict()`` carries it with the shared stages' states, and a load
resumes the stream from the merged state's entries (:meth:`SharedSegments.start`
with its entries).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from centralpipe.checkpoint.model import Checkpoint
from centralpipe.config import LoaderConfig
from centralpipe.dispatch.executors.pool import Executor
from centralpipe.dispatch.executors.preload import server_preload
from centralpipe.dispatch.executors.procpool import ProcessPool
from centralpipe.dispatch.executors.threadpool import ThreadPool
from centralpipe.dispatch.reorder import StreamStats
from centralpipe.dispatch.run import Policy, Run
from centralpipe.dispatch.stamps import Stamper
from centralpipe.dispatch.worker.chain import WorkerChain
from centralpipe.dispatch.worker.loop import WorkerSpec
from centralpipe.stages import CentralNode, Parallel
from centralpipe.startup import check_picklable

__all__ = ["SharedSegments"]

#: The name of the shared run's own (never pulled) dispatch stream.
_TIP = "node-shared"


class SharedSegments:
    """The parallel stages among the node's shared ``nodes``; see the module docstring."""

    def __init__(
        self, nodes: list[CentralNode[Any]], config: LoaderConfig, lock: threading.RLock
    ) -> None:
        self.nodes = nodes
        self.segments = [n for n in nodes if isinstance(n, Parallel)]
        self._config = config
        self._lock = lock
        w = config.workers
        flat = w.flat_arrays
        self._chains = [WorkerChain([n.spec], config.seed, flat) for n in self.segments]
        self._tip_chain = WorkerChain([], config.seed, flat)
        self.stats = {n.name: StreamStats(w.num_workers) for n in self.segments}
        self._tip_stats = StreamStats(w.num_workers)
        for node in self.segments:
            # The ranks' stampers read it before the first run exists.
            assert isinstance(node.source, CentralNode)
            node.stamper = Stamper(node.source.chain())
        #: Totals of the shared stages' ``count`` stages as of their last output
        #: (through a parallel stage: as of the input of its last output).
        self.stamper = Stamper(nodes)
        self.run: Run | None = None
        self.pool: Executor | None = None
        self._run_ids = 0
        if self.segments and w.num_workers and w.executor == "process":
            check_picklable([n.spec for n in self.segments], w.resolved_start_method())

    def start(self, epoch: int, resume: Checkpoint | None) -> None:
        """A new run of the parallel streams for ``epoch``, resuming the
        parallel stages' entries of ``resume`` (``None``: the epoch's start).
        The caller holds the chain lock and has just reset the shared stages
        to where the run starts."""
        if not self.segments:
            return
        self.stop()
        w = self._config.workers
        executor = self._ensure_pool() if w.num_workers else None
        self._run_ids += 1
        run = Run(
            nodes=self.nodes,
            chain=self._tip_chain,
            segment_chains=self._chains,
            epoch=epoch,
            resume=resume,
            buffer_size=w.buffer_size,
            chunk_size=w.chunk_size,
            policy=Policy.of(w),
            stats=self._tip_stats,
            segment_stats=self.stats,
            dispatch_name=_TIP,
            executor=executor,
            run_id=self._run_ids,
            chain_lock=self._lock,
            read_in_workers=w.read_in_workers,
        )
        self.run = run  # registered first: stop() ends a start cut short
        run.start()

    def capture(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The shared stages' states and each parallel stage's in-flight
        entry at their head (``Run.capture``; the caller holds the chain
        lock), or ``None`` before the first run."""
        run = self.run
        if run is None:
            return None
        body = run.capture("state_dict()")
        return body.central, body.segments

    def stop(self) -> None:
        """End the current run (bounded); the pool stays for the next."""
        run, self.run = self.run, None
        if run is not None:
            run.stop()

    def close(self) -> None:
        """End the run and the node-wide pool; idempotent."""
        self.stop()
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()

    def worker_pids(self) -> list[int]:
        """Process ids of the node-wide pool's workers (empty before it starts)."""
        pool = self.pool
        if pool is None or pool.kind != "process":
            return []
        return [slot.process.pid for slot in pool.slots if slot.process is not None]

    def _ensure_pool(self) -> Executor:
        if self.pool is None:
            w = self._config.workers
            spec = WorkerSpec([*self._chains, self._tip_chain], os.getpid())
            pool: Executor
            if w.executor == "thread":
                pool = ThreadPool(w.num_workers, spec)
            else:
                method = w.resolved_start_method()
                preload = server_preload([n.spec for n in self.segments])
                if method == "forkserver":
                    pool = ProcessPool(w.num_workers, spec, method, w.shared_memory_bytes, preload)
                else:
                    pool = ProcessPool(w.num_workers, spec, method, w.shared_memory_bytes)
            self.pool = pool  # registered before it starts: close() ends a start cut short
            pool.start()
        return self.pool
