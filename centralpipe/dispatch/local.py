"""The Loader's central part in the caller's process (``central="process"``).

A :class:`LocalCentral` holds everything of a Loader that is not its
iteration bookkeeping: the central stages, the worker chains, the worker pool
(or its start in the background), the current run and the pending
checkpoint, behind the surface of :class:`~centralpipe.dispatch.central.Central`.
The helper process of ``central="service"`` runs one too
(:mod:`centralpipe.dispatch.service`).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from centralpipe import checkpoint, metrics
from centralpipe.checkpoint import resume
from centralpipe.checkpoint.model import Captured
from centralpipe.checkpoint.resume import Pending
from centralpipe.config import LoaderConfig
from centralpipe.dispatch.chainlock import hold
from centralpipe.dispatch.executors.pool import Executor
from centralpipe.dispatch.executors.preload import server_preload
from centralpipe.dispatch.executors.procpool import ProcessPool, warm_up
from centralpipe.dispatch.executors.starter import BACKGROUND_METHODS, BackgroundStart
from centralpipe.dispatch.executors.threadpool import ThreadPool
from centralpipe.dispatch.pinning import make_pinner
from centralpipe.dispatch.reorder import StreamStats
from centralpipe.dispatch.run import Policy, Run, WarmStart, idle_worker_states
from centralpipe.dispatch.segments import plan_segments
from centralpipe.dispatch.worker.chain import WorkerChain
from centralpipe.dispatch.worker.loop import WorkerSpec
from centralpipe.lifetime import Resources
from centralpipe.plan.pipeline import Pipeline
from centralpipe.stages import (
    Count,
    Parallel,
    RunContext,
    all_nodes,
    build_central,
)
from centralpipe.stages.totals import Total, chain_totals, exact_length, weight_total
from centralpipe.startup import check_picklable

__all__ = ["LocalCentral"]

T = TypeVar("T")


class LocalCentral:
    """One Loader's central part, run in this process; see the module docstring.

    Not thread-safe beyond what the Loader's contract allows: every method is
    called from the thread that iterates, except :meth:`metrics` (never
    waits) and :meth:`finalize` (takes no lock)."""

    def __init__(self, pipeline: Pipeline, config: LoaderConfig) -> None:
        self._pipe = pipeline
        self._config = config
        dist = config.distributed
        self._ctx = RunContext(
            seed=config.seed, epoch=0, rank=dist.rank, world_size=dist.world_size
        )
        self._nodes = self._build_nodes(pipeline)
        # Stages inside a mix are queried by their qualified names (mix/source/stage).
        self._by_name = {node.name: node for node in all_nodes(self._nodes)}
        for node in self._nodes:
            node.prepare()
        # Dispatched items carry these stages' totals (delivered queries, checkpoints).
        self._stamped = [node for node in self._nodes if node.stamped]
        flat = config.workers.flat_arrays
        self._chain = WorkerChain(pipeline.worker_stages, config.seed, flat)
        self._segments = [n for n in self._driven_nodes() if isinstance(n, Parallel)]
        self._segment_chains = [WorkerChain([n.spec], config.seed, flat) for n in self._segments]
        # Worker chains: one per parallel stage, the dispatch boundary's,
        # then one per fused segment (``dispatch.segments``).
        self._fused = (
            plan_segments(self._segments, config.seed, flat, len(self._segments) + 1)
            if config.workers.fuse_parallel
            else []
        )
        self._check_picklable()
        self.epoch = 0
        self._stats = StreamStats(config.workers.num_workers)
        self._segment_stats = {
            n.name: StreamStats(config.workers.num_workers) for n in self._segments
        }
        self._resume: Pending | None = None
        #: The pending checkpoint's central states are not loaded yet.
        self._reload = False
        self._run_ids = 0
        self._res = Resources()
        self._res.nodes = self._nodes
        self._res.pinner = make_pinner(config.pin_memory)
        # Keyed to this object, which only its Loader holds: it runs when the
        # Loader is collected (see centralpipe.lifetime).
        self._finalizer = weakref.finalize(self, self._res.finalize)
        self._start_early()

    def _build_nodes(self, pipeline: Pipeline) -> list[Any]:
        """The central nodes, source first (``central="node"`` shares the
        ones before ``shard()`` between local ranks)."""
        return build_central(pipeline.central_stages, self._ctx)

    def _driven_nodes(self) -> list[Any]:
        """The central nodes whose streams this part's runs drive: all (in
        ``central="node"`` the node drives the shared stages' parallel streams)."""
        return self._nodes

    @property
    def _boundary(self) -> str:
        """The name keying the dispatch boundary's in-flight inputs."""
        return self._pipe.dispatch_name or "dispatch"

    # -- passes ------------------------------------------------------------------

    def start(self) -> Iterator[Any]:
        """Start the pending resume or the next epoch; its outputs, in order.

        The run itself is the iterator (no call between its start and its
        return to the caller, where a Ctrl-C could lose a started pass)."""
        return self._start_run()

    def stop(self) -> None:
        """End the current pass (bounded); its iterator yields nothing more."""
        self._res.end_run()

    def _start_run(self) -> Run:
        """Start the pending resume or the next epoch.

        The run is built (no thread yet) under the chain lock, registered, and
        only then started: an error or Ctrl-C at any point of the start leaves
        no thread that ``close()`` cannot stop, and stops the run before the
        central stages go back to where they were. The epoch counter and the
        pending checkpoint are restored then, so ``state_dict()`` still
        resumes the pass that was being started."""
        res = self._res
        res.end_run()
        pending, epoch_before = self._resume, self.epoch
        with hold(res.chain_lock, "starting a pass", self._nodes):
            if pending is not None and self._reload:
                self._nodes[-1].load_flat(dict(pending.ckpt.central))
                self._reload = False
            if pending is not None and not pending.ckpt.finished:
                epoch = self.epoch
                run = self._make_run(epoch=epoch, ckpt=pending.ckpt)
            else:
                epoch = self.epoch + 1
                self._ctx.epoch = epoch
                try:
                    self._nodes[-1].load_flat(None)
                    run = self._make_run(epoch=epoch, ckpt=None)
                except BaseException:
                    self._ctx.epoch = epoch_before
                    raise
        try:
            res.run = run
            self.epoch, self._resume = epoch, None
            run.start()
        except BaseException:
            res.end_run()
            self.epoch, self._resume, self._ctx.epoch = epoch_before, pending, epoch_before
            if pending is not None:
                # The central stages go back to the checkpoint's position.
                with hold(res.chain_lock, "restoring after a failed start", self._nodes):
                    self._nodes[-1].load_flat(dict(pending.ckpt.central))
            raise
        if pending is None or pending.ckpt.finished:
            self._stats.epoch_restarts = 0
        return run

    # -- delivery ahead of the consumer (a service's client) ---------------------

    def ready_ahead(self) -> bool:
        """Whether the pass can deliver its next output now in a way that
        :meth:`step_back` can undo (``Stream.ready_ahead``)."""
        run = self._res.run
        return run is not None and run.stream.ready_ahead()

    def step_back(self) -> int:
        """Move the position back before the last output, which the consumer
        has not got (a service's client holds it, delivered ahead), so that
        ``state()``, ``query()`` and the rest answer at the consumer's
        position; returns what :meth:`step_to` takes to deliver it again."""
        run = self._res.run
        if run is None:
            raise RuntimeError("no pass to step back")
        return run.stream.step_back()

    def step_to(self, position: int) -> None:
        """Undo :meth:`step_back`: the output is delivered again (nothing runs twice)."""
        run = self._res.run
        if run is not None:
            run.stream.step_to(position)

    def set_next_epoch(self, epoch: int) -> None:
        """Make the next pass start epoch ``epoch`` from its start, dropping a
        pending checkpoint and the unread rest of the current epoch (as a new
        pass drops it). For adapters of frameworks that count epochs themselves
        (``centralpipe.lightning``)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
            msg = f"`epoch` must be an int >= 1, got {epoch!r}."
            raise ValueError(msg)
        self._res.end_run()
        self._resume = None
        self.epoch = epoch - 1

    def _make_run(self, *, epoch: int, ckpt: checkpoint.Checkpoint | None) -> Run:
        w = self._config.workers
        policy = Policy.of(w)
        pooled = self._pooled()
        warm = self._warm_start() if pooled else None
        executor = self._ensure_pool() if pooled and warm is None else None
        if pooled:
            self._run_ids += 1
        return Run(
            nodes=self._driven_nodes(),
            chain=self._chain,
            segment_chains=self._segment_chains,
            epoch=epoch,
            resume=ckpt,
            buffer_size=w.buffer_size,
            chunk_size=w.chunk_size,
            policy=policy,
            stats=self._stats,
            segment_stats=self._segment_stats,
            dispatch_name=self._boundary,
            executor=executor,
            run_id=self._run_ids,
            pinner=self._res.pinner,
            chain_lock=self._res.chain_lock,
            warm=warm,
            read_in_workers=w.read_in_workers,
            fused=self._fused,
        )

    def _warm_start(self) -> WarmStart | None:
        """With ``start_inline`` (opt-in), run the first chunks inline
        while the workers start in the background (``dispatch.warm``), or
        ``None``: use the pool at once (waiting for it; the default, so that
        user code runs only in the workers). Not with ``timeout_s`` (an item hung inline could
        not be stopped) nor stateful worker stages (their state would be
        split between this process and the workers)."""
        w, starter = self._config.workers, self._res.starter
        if starter is None or not w.start_inline or w.timeout_s is not None:
            return None
        if any(c.stateful for c in [self._chain, *self._segment_chains]):
            return None
        if starter.workers_ready():
            return None
        # Weak: the run must not keep the Loader alive (its finalizer ends
        # the run, the pool and the start when the Loader is collected).
        ready, acquire = (
            weakref.WeakMethod(self._workers_ready),
            weakref.WeakMethod(self._ensure_pool),
        )
        return WarmStart(lambda: _live(ready)(), lambda: _live(acquire)(), w.num_workers)

    def _workers_ready(self) -> bool:
        """The background start no longer needs waiting for (or was taken)."""
        starter = self._res.starter
        return starter is None or starter.workers_ready()

    def _pooled(self) -> bool:
        """Whether passes run worker stages on a pool of workers."""
        w = self._config.workers
        return w.num_workers > 0 and (bool(self._chain.specs) or bool(self._segments))

    def _start_early(self) -> None:
        """Start the forkserver (it imports what the workers need) and the
        worker processes now, in the background (``dispatch.starter``), so
        they are ready by the time the program iterates."""
        w = self._config.workers
        if w.executor != "process" or not self._pooled():
            return
        method = w.resolved_start_method()
        if method == "forkserver":
            warm_up(method, self._preload())
        if method not in BACKGROUND_METHODS:
            return
        pool = None
        try:
            pool = self._new_pool()
            self._res.starter = BackgroundStart(pool)
        except Exception:
            # E.g. no file descriptor left for a pipe: the first pass starts
            # the workers itself and reports it there.
            if pool is not None:
                pool.close()

    def _preload(self) -> list[str]:
        return server_preload([*(n.spec for n in self._segments), *self._pipe.worker_stages])

    def _new_pool(self) -> Executor:
        w = self._config.workers
        chains = [*self._segment_chains, self._chain, *(f.chain for f in self._fused)]
        spec = WorkerSpec(chains, os.getpid())
        if w.executor == "thread":
            return ThreadPool(w.num_workers, spec)
        method = w.resolved_start_method()
        if method != "forkserver":  # only a forkserver preloads anything
            return ProcessPool(w.num_workers, spec, method, w.shared_memory_bytes)
        return ProcessPool(w.num_workers, spec, method, w.shared_memory_bytes, self._preload())

    def _ensure_pool(self) -> Executor:
        res = self._res
        if res.pool is not None and res.pool.closed:
            # A failed start whose close was cut short (Ctrl-C): finish it.
            res.pool.close()
            res.pool = None
        if res.pool is None:
            starter = res.starter
            if starter is not None:
                try:
                    pool = starter.result()
                except BaseException:
                    if starter.done():  # it failed, and closed what it started
                        res.starter = None
                    raise
                res.pool, res.starter = pool, None
            else:
                pool = self._new_pool()
                # Registered before it starts: close() (or the finalizer) ends a
                # start cut short at any point, and its close if that is cut too.
                res.pool = pool
                try:
                    pool.start()
                except BaseException:
                    pool.close()  # no half-started pool: the next iteration starts afresh
                    res.pool = None
                    raise
        return res.pool

    def total(self, stage: str | None = None, weight: bool = False) -> Total | None:
        """``Loader.total``: the items (or with ``weight=True`` the weight of a
        ``count`` stage) one whole epoch yields, or ``None`` when unknown."""
        totals = self._totals()
        if stage is None:
            if weight:
                msg = (
                    "weight=True needs the name of a count stage, e.g. "
                    "loader.total('pre_shard', weight=True)."
                )
                raise ValueError(msg)
            return totals[self._pipe.stages[-1].name]
        if stage not in totals:
            known = ", ".join(repr(n) for n in totals)
            raise KeyError(f"no stage named {stage!r}; stages: {known}.")
        if weight:
            kind = dict((name, kind) for name, kind in self._pipe.fingerprint())[stage]
            if kind != "count":
                msg = f"weight=True is for count stages; {stage!r} is a {kind} stage."
                raise ValueError(msg)
            return weight_total(self._pipe.stages, totals, stage)
        return totals[stage]

    def _totals(self) -> dict[str, Total | None]:
        return chain_totals(self._nodes, self._pipe.stages, self._ctx)

    def length(self) -> int:
        """``len(loader)``: the exact length, else ``TypeError``."""
        return exact_length(self._totals(), [s.name for s in self._pipe.stages])

    # -- checkpoints -------------------------------------------------------------

    def state(self, what: str = "state_dict()") -> dict[str, Any]:
        """The position after the last item delivered (``Loader.state_dict``)."""
        return self._state(what)

    def _state(self, what: str) -> dict[str, Any]:
        if self._resume is not None:
            return self._resume.state()
        run = self._res.run
        if run is not None:
            body = run.capture(what)
            epoch = run.stream.epoch
        else:
            with hold(self._res.chain_lock, what, self._nodes):
                body = resume.idle([n.name for n in self._segments], self._nodes)
            epoch = self.epoch
        return self._assemble(body, epoch)

    def _assemble(self, body: Captured, epoch: int) -> dict[str, Any]:
        """The checkpoint of ``body``, captured at ``epoch``, for this Loader."""
        dist = self._config.distributed
        return resume.assemble(
            body,
            fingerprint=self._pipe.fingerprint(),
            seed=self._config.seed,
            epoch=epoch,
            rank=dist.rank,
            world_size=dist.world_size,
            boundary=self._boundary,
            stamped=self._stamped,
        )

    def load(self, state_dict: dict[str, Any]) -> None:
        """``Loader.load_state_dict``: checked whole first (the typed model,
        then this pipeline); on any error nothing has changed."""
        ckpt = checkpoint.structure(state_dict)
        checkpoint.check_pipeline(ckpt, self._expected())
        loaded = resume.pending(state_dict, ckpt)
        # Valid: from here on the loader changes. A stage whose restore still
        # fails (a re-iterable that got shorter, a user's node) rolls back to
        # ``before``, made whole first: the failure path only restores.
        before = self._resume
        if before is None:
            before = resume.pending(self._state("load_state_dict()"))
        self._res.end_run()
        # A `with`: no point between taking the chain lock and guarding its
        # release where an interrupt (Ctrl-C) could land.
        entered = False
        try:
            with hold(self._res.chain_lock, "load_state_dict()", self._nodes):
                entered = True
                try:
                    self._restore(loaded)
                except BaseException:
                    self._resume = None
                    self._restore(before)
                    raise
        except TimeoutError:
            if entered:
                raise
            # The stopped run's feeder is still inside a central next(): keep
            # the position as it was; the stages are restored at the next start.
            self._resume, self._reload = before, True
            raise

    def _restore(self, pending: Pending) -> None:
        ckpt = pending.ckpt
        self._ctx.epoch = ckpt.epoch
        self._nodes[-1].load_flat(dict(ckpt.central))
        self.epoch = ckpt.epoch
        self._stats.epoch_restarts = 0
        self._resume = pending

    def _expected(self) -> checkpoint.Expected:
        dist = self._config.distributed
        return resume.expected(
            self._pipe,
            self._nodes,
            self._ctx,
            seed=self._config.seed,
            rank=dist.rank,
            world_size=dist.world_size,
            boundary=self._boundary,
        )

    # -- queries -----------------------------------------------------------------

    def query(self, name: str, *, delivered: bool = False) -> dict[str, Any]:
        """A copy of central stage ``name``'s live state; with ``delivered=True``
        (``count`` stages) its totals as of the last item the consumer received.

        A live query of a ``count`` is its last published ``(items, weight)``
        (:meth:`~centralpipe.stages.base.CentralNode.live_view`), read without
        the chain lock; other stages' wait for the ``next()`` in progress."""
        node = self._by_name.get(name)
        if node is None:
            known = ", ".join(repr(n) for n in self._by_name)
            workers = [s.name for s in self._pipe.worker_stages]
            hint = (
                f" ({name!r} is a worker stage; worker stages keep no state)"
                if name in workers
                else ""
            )
            raise KeyError(f"no central stage named {name!r}{hint}; central stages: {known}.")
        run = self._res.run
        if delivered:
            if not isinstance(node, Count):
                raise ValueError(
                    f"delivered=True is for count stages; '{name}' is a {node.kind} stage."
                )
            if node not in self._nodes:
                raise ValueError(
                    f"delivered=True is for count stages of the main chain; '{name}' is inside "
                    "a mix, whose stages run ahead of delivery (query it live)."
                )
            if run is not None:
                stamp = run.delivered_stamp()
                stamped = run.stamped_nodes()
            elif self._resume is not None and self._resume.ckpt.delivered_stamp is not None:
                stamp = self._resume.ckpt.delivered_stamp
                stamped = self._stamped
            else:
                return node.query_state()
            if stamp is None:
                return node.query_state()
            items, weight = stamp[stamped.index(node)]
            return {"items": items, "weight": weight}
        view = node.live_view()
        if view is not None:  # the stage's last published snapshot: no lock
            return view
        what = f"query({name!r})"
        if run is not None:
            with run.reading(what):
                return node.query_state()
        with hold(self._res.chain_lock, what, self._nodes):
            return node.query_state()

    def metrics(self) -> dict[str, Any]:
        """Per central stage items in/out and own time; ``"dispatch"``: buffer,
        skipped items, worker restarts, items per worker and waiting times.
        Never waits (see :mod:`centralpipe.metrics`)."""
        return metrics.collect(
            self._nodes,
            self._stats,
            self._segment_stats,
            self._config.workers,
            self._res.run,
            self._res.pool,
        )

    def worker_states(self) -> list[dict[str, Any]]:
        """``state_dict()`` of each worker's stateful worker-stage callables, one
        dict per worker (inline: one). Never needed for exact resume."""
        if self._config.workers.num_workers == 0:
            return [self._chain.states()]
        run = self._res.run
        if run is not None and not run.stopping and run.session is not None:
            return run.session.worker_states()
        return idle_worker_states(self._ensure_pool(), self._stats)

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (empty before the first iteration
        and with ``num_workers=0``), e.g. for monitoring."""
        return self._res.worker_pids()

    # -- lifetime ------------------------------------------------------------------

    def close(self) -> None:
        """Release the run, the pool, the pin thread and the files; idempotent.
        A ``close()`` cut short by Ctrl-C is finished by the next one (or, at
        the latest, by the finalizer)."""
        if self._finalizer.alive:
            self._res.close()
            self._finalizer.detach()

    def _check_picklable(self) -> None:
        w = self._config.workers
        if w.num_workers == 0 or w.executor == "thread":
            return
        specs = [*(n.spec for n in self._segments), *self._pipe.worker_stages]
        check_picklable(specs, w.resolved_start_method())


def _live(method: weakref.WeakMethod[Callable[[], T]]) -> Callable[[], T]:
    """The bound method, while its Loader lives."""
    bound = method()
    if bound is None:
        raise RuntimeError("the Loader was garbage collected")
    return bound
