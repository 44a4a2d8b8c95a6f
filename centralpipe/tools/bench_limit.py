"""The transport limit of this machine, measured: a minimal slot-pool loader.

``run_slot_pool(fn, n, workers, nbytes)`` is the smallest loader that moves
large tensors through shared memory, against which centralpipe's transport
is judged in the same run: the workers are forked once; a pool of
``SLOTS_PER_WORKER`` fixed-size slots per worker is created before they
start (anonymous shared memory); worker ``w`` makes items ``w, w + k, ...``,
copies each into one of its free slots and sends only ``(seq, slot)`` on
its pipe; the main process takes the items in order, copies each slot out
once into a fresh tensor and hands the slot back on a free pipe. It has no
central stages, no chunks, no checkpoint, no fault handling: what it
reaches is what the machine allows, not a contender.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["SLOTS_PER_WORKER", "run_slot_pool"]

SLOTS_PER_WORKER = 16
_MSG = struct.Struct("<qq")


def _worker(
    w: int,
    k: int,
    n: int,
    fn: Callable[[int], torch.Tensor],
    pool: Any,
    base: int,
    slot_bytes: int,
    out: Any,
    free_r: int,
    close: list[int],
) -> None:
    for fd in close:  # write ends of the free pipes: EOF must reach us when the main exits
        os.close(fd)
    torch.set_num_threads(1)
    free = list(range(SLOTS_PER_WORKER))
    for seq in range(w, n, k):
        data = fn(seq).numpy().view(np.uint8)
        while not free:
            got = os.read(free_r, 8 * SLOTS_PER_WORKER)
            if not got:
                return  # the main process gave up
            free.extend(struct.unpack(f"<{len(got) // 8}q", got))
        slot = free.pop()
        off = base + slot * slot_bytes
        np.frombuffer(pool, dtype=np.uint8, count=data.size, offset=off)[:] = data
        try:
            out.send_bytes(_MSG.pack(seq, slot))
        except OSError:
            return


def run_slot_pool(fn: Callable[[int], torch.Tensor], n: int, workers: int, nbytes: int) -> float:
    """Seconds for ``n`` items of ``nbytes`` each through the minimal loader,
    from starting its workers to the last item (each item checked)."""
    ctx = mp.get_context("fork")
    slot_bytes = -(-nbytes // 4096) * 4096
    pool = mmap.mmap(-1, workers * SLOTS_PER_WORKER * slot_bytes)
    t0 = time.perf_counter()
    procs: list[Any] = []
    conns: list[Any] = []
    frees: list[int] = []
    for w in range(workers):
        r, s = ctx.Pipe(duplex=False)
        free_r, free_w = os.pipe()
        base = w * SLOTS_PER_WORKER * slot_bytes
        p = ctx.Process(
            target=_worker,
            args=(w, workers, n, fn, pool, base, slot_bytes, s, free_r, [*frees, free_w]),
            daemon=True,
        )
        p.start()
        s.close()
        os.close(free_r)
        procs.append(p)
        conns.append(r)
        frees.append(free_w)
    try:
        for seq in range(n):
            w = seq % workers
            got, slot = _MSG.unpack(conns[w].recv_bytes())
            assert got == seq
            off = w * SLOTS_PER_WORKER * slot_bytes + slot * slot_bytes
            dst = np.empty(nbytes, dtype=np.uint8)
            np.copyto(dst, np.frombuffer(pool, dtype=np.uint8, count=nbytes, offset=off))
            try:
                os.write(frees[w], struct.pack("<q", slot))
            except BrokenPipeError:
                pass  # that worker has made all its items and exited
            t = torch.frombuffer(dst, dtype=torch.float32)
            if float(t[0]) != float(seq):
                raise RuntimeError(f"item {seq} arrived as {float(t[0])}")
        return time.perf_counter() - t0
    finally:
        for c in conns:
            c.close()
        for f in frees:
            os.close(f)
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        pool.close()
