"""``python -m centralpipe bench --only seed``: the token-bucket workload end to end.

Text lines (the bundled corpus ``examples/data/*.txt``, repeated, or with
``--seed-corpus stdlib`` the ``.py`` files of the running Python's standard
library) go through a tokenizer, ``bucket_by_max_tokens``, ``count``,
``shard`` (world size 1), ``dispatch()`` and are padded into a ``LongTensor``
per batch. Two tokenizers: a pure-Python greedy longest-match tokenizer (its
cost per line is measured and printed), and a BPE tokenizer from the
``tokenizers`` package trained here on the corpus (skipped, with the reason,
when that package is missing; it comes with the ``bench`` extra). Each comes
in three forms: token lists, int32 numpy arrays (which cross the dispatch
boundary as one buffer per chunk, :mod:`centralpipe.dispatch.wire.tokens`),
and a batched form (``map(..., batched=True)``: ``encode_batch`` for BPE,
which releases the GIL). Every contender does the same work once; lines/s
cover the whole epoch and the time to the first batch is shown beside it.

For the centralpipe rows the main process's CPU time per line is split by
thread (the consumer, i.e. the caller's thread, which runs the central chain
with ``num_workers=0``; the feeder, which runs it otherwise; the supervisor;
worker threads with ``executor="thread"``), read from
``/proc/self/task/*/stat`` before the Loader closes. A last table times
``state_dict()`` mid-epoch (main-thread CPU, median of calls) and the size of
the ``torch.save``'d checkpoint, with a ``STATE_BUFFER``-line bucket buffer.
"""

from __future__ import annotations

import glob
import heapq
import io
import os
import statistics
import sysconfig
import tempfile
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchdata.nodes as tn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import centralpipe as cp

__all__ = ["CORPORA", "WORKERS", "measure", "report_lines", "targets"]

CORPUS_GLOB = str(Path(__file__).resolve().parents[2] / "examples" / "data" / "*.txt")
WORKERS = 2
MAX_TOKENS = 4096
BUFFER = 1000
PAD_ID = 0
#: Serial epoch length aimed at (seconds; ``--quick`` divides it by 10): long
#: enough that start-up (forking workers, the first 1000-line bucket buffer)
#: stays under 10 % of the parallel rows' epochs.
EPOCH_S = 8.0
#: Start-up share of an epoch aimed at.
STARTUP_SHARE = 0.10
PY_TARGET_S = 20e-6
PEER_START_METHOD = "fork"
#: The bucket buffer of the state_dict() table (the motivating pipeline's).
STATE_BUFFER = 50_000
#: state_dict() calls timed mid-epoch per pipeline.
STATE_CALLS = 20
CORPORA = ("bundled", "stdlib")
#: Batches between two readings of the threads' CPU time.
SAMPLE_EVERY = 10


# -- tokenizers (module level: picklable) -----------------------------------------------


def basic_words(line: str) -> list[str]:
    """BERT-style normalisation in pure Python: lower case, accents stripped
    (NFD, combining marks dropped), punctuation split off as its own word."""
    words: list[str] = []
    cur: list[str] = []
    for ch in unicodedata.normalize("NFD", line.lower()):
        cat = unicodedata.category(ch)
        if cat == "Mn":
            continue
        if ch.isspace() or cat.startswith("P"):
            if cur:
                words.append("".join(cur))
                cur = []
            if not ch.isspace():
                words.append(ch)
        else:
            cur.append(ch)
    if cur:
        words.append("".join(cur))
    return words


class PyTokenizer:
    """Pure-Python tokenizer as BERT's reference one: :func:`basic_words`, then
    greedy longest-match subwords (WordPiece-like), left to right."""

    def __init__(self, vocab: dict[str, int], longest: int) -> None:
        self.vocab = vocab
        self.longest = longest

    def __call__(self, line: str) -> list[int]:
        vocab, longest, out = self.vocab, self.longest, []
        for word in basic_words(line):
            i, n = 0, len(word)
            while i < n:
                for j in range(min(n, i + longest), i, -1):
                    tid = vocab.get(word[i:j])
                    if tid is not None:
                        out.append(tid)
                        i = j
                        break
                else:
                    out.append(1)  # unknown character
                    i += 1
        return out


def train_py_tokenizer(lines: list[str], longest: int = 6, min_count: int = 20) -> PyTokenizer:
    """Vocabulary: every substring of up to ``longest`` characters seen ``min_count`` times."""
    counts: dict[str, int] = {}
    for line in lines:
        for word in basic_words(line):
            for i in range(len(word)):
                for j in range(i + 1, min(len(word), i + longest) + 1):
                    counts[word[i:j]] = counts.get(word[i:j], 0) + 1
    pieces = sorted(p for p, c in counts.items() if c >= min_count or len(p) == 1)
    return PyTokenizer({p: i + 2 for i, p in enumerate(pieces)}, longest)


class BpeTokenizer:
    """``tokenizers.Tokenizer.encode(line).ids``: a picklable callable."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def __call__(self, line: str) -> list[int]:
        ids: list[int] = self.tok.encode(line).ids
        return ids


def train_bpe(lines: list[str]) -> BpeTokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=4000, special_tokens=["[PAD]", "[UNK]"])
    tok.train_from_iterator(lines, trainer=trainer)
    return BpeTokenizer(tok)


class AsArrays:
    """A tokenizer returning an int32 numpy array: the fast form (it crosses
    the dispatch boundary as one buffer per chunk)."""

    def __init__(self, tok: Callable[[str], list[int]]) -> None:
        self.tok = tok

    def __call__(self, line: str) -> np.ndarray:
        return np.array(self.tok(line), dtype=np.int32)


class Batched:
    """The batched form (``map(..., batched=True)``): a list of lines to a
    list of int32 arrays; for BPE one ``encode_batch`` call, which releases
    the GIL and runs on the tokenizer's own threads."""

    def __init__(self, tok: Callable[[str], list[int]]) -> None:
        self.tok = tok

    def __call__(self, lines: list[str]) -> list[np.ndarray]:
        if isinstance(self.tok, BpeTokenizer):
            return [np.array(e.ids, dtype=np.int32) for e in self.tok.tok.encode_batch(lines)]
        tok = self.tok
        return [np.array(tok(x), dtype=np.int32) for x in lines]


@dataclass
class Tok:
    """One tokenizer in its three forms."""

    lists: Callable[[str], list[int]]

    @property
    def arrays(self) -> AsArrays:
        return AsArrays(self.lists)

    @property
    def batched(self) -> Batched:
        return Batched(self.lists)


def pad(batch: list[Any]) -> torch.Tensor:
    """Token lists (or int32 arrays) padded with ``PAD_ID`` into ``LongTensor[batch, longest]``."""
    longest = max(len(s) for s in batch)
    out = torch.full((len(batch), longest), PAD_ID, dtype=torch.long)
    for row, seq in enumerate(batch):
        if isinstance(seq, np.ndarray):
            out[row, : len(seq)] = torch.from_numpy(seq)
        else:
            out[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def bucketize(seqs: Iterator[Any]) -> Iterator[list[Any]]:
    """Shortest-first max-token buckets from a ``BUFFER``-item buffer (as
    ``bucket_by_max_tokens(MAX_TOKENS, buffer_size=BUFFER, min_len=1)``)."""
    heap: list[tuple[int, int, Any]] = []
    batch: list[Any] = []
    total = 0

    def pop() -> Iterator[list[Any]]:
        nonlocal batch, total
        n, _, s = heapq.heappop(heap)
        if batch and total + n > MAX_TOKENS:
            yield batch
            batch, total = [], 0
        batch.append(s)
        total += n
        if total > MAX_TOKENS:  # a lone item longer than MAX_TOKENS goes out by itself
            yield batch
            batch, total = [], 0

    for k, s in enumerate(seqs):
        if len(s):
            heapq.heappush(heap, (len(s), k, s))
            if len(heap) >= BUFFER:
                yield from pop()
    while heap:
        yield from pop()
    if batch:
        yield batch


# -- contenders ------------------------------------------------------------------------


@dataclass
class Run:
    lines: int
    batches: int
    first_s: float
    total_s: float
    #: Main-process CPU seconds by thread role (centralpipe rows only).
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.lines / self.total_s


def _consume(
    it: Iterator[torch.Tensor], t0: float, lines: int, sample: Callable[[], None] | None = None
) -> Run:
    first, batches = None, 0
    for _ in it:
        batches += 1
        if first is None:
            first = time.perf_counter() - t0
        if sample is not None and batches % SAMPLE_EVERY == 0:
            sample()
    total = time.perf_counter() - t0
    return Run(lines, batches, first if first is not None else total, total)


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _task_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) of one thread of this process, from /proc."""
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _role(name: str) -> str:
    if name == "MainThread":
        return "consumer"
    if name.startswith("centralpipe-worker"):
        return "worker threads"
    if name.startswith("centralpipe-"):
        return name.removeprefix("centralpipe-")
    return "other"


class ThreadCpu:
    """CPU seconds of this process's threads by role, sampled while they
    live (the feeder and supervisor end with the pass): per thread the last
    reading, summed by role."""

    def __init__(self) -> None:
        self.start: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        for t in threading.enumerate():
            if t.native_id is not None:
                self.start[t.native_id] = _task_cpu_s(t.native_id)

    def sample(self) -> None:
        for t in threading.enumerate():
            if t.native_id is not None:
                self.last[t.native_id] = (_role(t.name), _task_cpu_s(t.native_id))

    def by_role(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for tid, (role, cpu) in self.last.items():
            if role != "other":
                out[role] = out.get(role, 0.0) + cpu - self.start.get(tid, 0.0)
        return out


def run_serial(lines: list[str], tok: Callable[[str], Any]) -> Run:
    t0 = time.perf_counter()
    return _consume((pad(b) for b in bucketize(tok(x) for x in lines)), t0, len(lines))


def _seed_pipeline(lines: cp.Pipeline, tok: Callable[..., Any], **map_kw: Any) -> cp.Pipeline:
    """The seed pipeline after its source: tokenize, bucket, count, shard, pad."""
    return (
        lines.map(tok, **map_kw)
        .bucket_by_max_tokens(MAX_TOKENS, buffer_size=BUFFER, min_len=1)
        .count("pre_shard", weight_fn=len)
        .shard()
        .dispatch()
        .map(pad)
    )


def _run_loader(pipe: cp.Pipeline, workers: cp.WorkerConfig, lines: int) -> Run:
    """One pass of ``pipe``, with the main process's CPU by thread role."""
    cpu = ThreadCpu()
    t0 = time.perf_counter()
    with cp.Loader[torch.Tensor](pipe, cp.LoaderConfig(workers=workers)) as loader:
        run = _consume(iter(loader), t0, lines, cpu.sample)
        cpu.sample()
    run.cpu_s = cpu.by_role()
    return run


def run_centralpipe(
    lines: list[str],
    tok: Callable[..., Any],
    workers: int,
    parallel: bool,
    executor: str,
    batched: bool = False,
) -> Run:
    pipe = _seed_pipeline(cp.Pipeline.from_iterable(lines), tok, parallel=parallel, batched=batched)
    return _run_loader(pipe, cp.WorkerConfig(num_workers=workers, executor=executor), len(lines))


def run_centralpipe_file(lines: list[str], tok: Callable[..., Any], read_in_workers: bool) -> Run:
    """``parallel=True`` on 2 process workers, the lines read from a file by
    ``read_lines``: the workers read byte ranges (``read_in_workers``) or
    the main process sends them lines."""
    with tempfile.TemporaryDirectory(prefix="centralpipe-seed-") as root:
        path = os.path.join(root, "lines.txt")
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.writelines(line + "\n" for line in lines)
        pipe = _seed_pipeline(cp.Pipeline.from_files(path).read_lines(), tok, parallel=True)
        workers = cp.WorkerConfig(num_workers=WORKERS, read_in_workers=read_in_workers)
        return _run_loader(pipe, workers, len(lines))


class TokenBuckets(IterableDataset[torch.Tensor]):
    """Each DataLoader worker tokenizes and buckets every k-th line."""

    def __init__(self, lines: list[str], tok: Callable[[str], Any]) -> None:
        self.lines, self.tok = lines, tok

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        tok = self.tok
        return (pad(b) for b in bucketize(tok(x) for x in self.lines[start::step]))


def run_dataloader(lines: list[str], tok: Callable[[str], Any]) -> Run:
    t0 = time.perf_counter()
    loader = DataLoader(
        TokenBuckets(lines, tok),
        batch_size=None,
        num_workers=WORKERS,
        multiprocessing_context=PEER_START_METHOD,
    )
    it = iter(loader)
    try:
        return _consume(it, t0, len(lines))
    finally:
        shutdown = getattr(it, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()


class BucketNode(tn.BaseNode[list[Any]]):
    """A torchdata.nodes node running :func:`bucketize` over its source (no checkpointing)."""

    def __init__(self, source: tn.BaseNode[Any]) -> None:
        super().__init__()
        self.source = source
        self._it: Iterator[list[Any]] | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset()
        self._it = bucketize(iter(self.source))

    def next(self) -> list[Any]:
        assert self._it is not None
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        return {}


def run_nodes(lines: list[str], tok: Callable[[str], Any]) -> Run:
    from centralpipe.tools.bench_contenders import shutdown_nodes as _shutdown_nodes

    mapped = tn.ParallelMapper(
        tn.IterableWrapper(lines),
        tok,
        num_workers=WORKERS,
        method="process",
        multiprocessing_context=PEER_START_METHOD,
    )
    node = tn.Mapper(BucketNode(mapped), pad)
    t0 = time.perf_counter()
    try:
        return _consume(iter(tn.Loader(node)), t0, len(lines))
    finally:
        _shutdown_nodes(mapped)


SERIAL = "serial loop"
CONTENDERS: tuple[tuple[str, Callable[[list[str], Tok], Run]], ...] = (
    (SERIAL, lambda ls, t: run_serial(ls, t.lists)),
    ("serial loop, int32 arrays", lambda ls, t: run_serial(ls, t.arrays)),
    (
        "centralpipe inline, 0 workers",
        lambda ls, t: run_centralpipe(ls, t.lists, 0, False, "process"),
    ),
    (
        "centralpipe inline, 0 workers, arrays",
        lambda ls, t: run_centralpipe(ls, t.arrays, 0, False, "process"),
    ),
    (
        "centralpipe inline, 2 workers",
        lambda ls, t: run_centralpipe(ls, t.lists, 2, False, "process"),
    ),
    (
        "centralpipe parallel=True, process",
        lambda ls, t: run_centralpipe(ls, t.lists, 2, True, "process"),
    ),
    (
        "centralpipe parallel=True, process, arrays",
        lambda ls, t: run_centralpipe(ls, t.arrays, 2, True, "process"),
    ),
    (
        "centralpipe parallel=True, process, batched",
        lambda ls, t: run_centralpipe(ls, t.batched, 2, True, "process", batched=True),
    ),
    (
        "centralpipe parallel=True, thread",
        lambda ls, t: run_centralpipe(ls, t.lists, 2, True, "thread"),
    ),
    (
        "centralpipe parallel=True, thread, batched",
        lambda ls, t: run_centralpipe(ls, t.batched, 2, True, "thread", batched=True),
    ),
    (
        "centralpipe parallel=True, process, arrays, file read in workers",
        lambda ls, t: run_centralpipe_file(ls, t.arrays, True),
    ),
    (
        "centralpipe parallel=True, process, arrays, file lines sent",
        lambda ls, t: run_centralpipe_file(ls, t.arrays, False),
    ),
    ("DataLoader (IterableDataset), 2 workers", lambda ls, t: run_dataloader(ls, t.lists)),
    ("DataLoader (IterableDataset), 2 workers, arrays", lambda ls, t: run_dataloader(ls, t.arrays)),
    ("torchdata.nodes ParallelMapper, 2 workers", lambda ls, t: run_nodes(ls, t.lists)),
)
#: The rows the targets read (the array forms are the fast way the docs show).
#: The process row is the motivating pipeline itself: text files streamed by
#: ``read_lines``, which the workers read by byte ranges (the default).
FAST_PROCESS = "centralpipe parallel=True, process, arrays, file read in workers"
FAST_THREAD = "centralpipe parallel=True, thread, batched"
INLINE = "centralpipe inline, 0 workers"


# -- state_dict() and checkpoint size ----------------------------------------------------


@dataclass
class StateRun:
    form: str
    state_s: float
    nbytes: int
    weights_only: bool


def measure_state(
    lines: list[str], tok: Callable[[str], Any], form: str, buffer: int = STATE_BUFFER
) -> StateRun:
    """Mid-epoch ``state_dict()`` of the pipeline with a ``STATE_BUFFER``-line
    bucket buffer, 2 workers: main-thread CPU per call (median) and the
    ``torch.save`` size; whether ``torch.load(weights_only=True)`` reads it."""
    pipe = (
        cp.Pipeline.from_iterable(lines)
        .map(tok, parallel=True)
        .bucket_by_max_tokens(MAX_TOKENS, buffer_size=buffer, min_len=1)
        .count("pre_shard", weight_fn=len)
        .shard()
        .dispatch()
        .map(pad)
    )
    cfg = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=WORKERS))
    with cp.Loader[torch.Tensor](pipe, cfg) as loader:
        it = iter(loader)
        next(it)  # the buffer is full once the first batch is out
        times = []
        for _ in range(STATE_CALLS):
            t0 = time.thread_time()
            sd = loader.state_dict()
            times.append(time.thread_time() - t0)
            next(it, None)
    buf = io.BytesIO()
    torch.save(sd, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        readable = True
    except Exception:
        readable = False
    return StateRun(form, statistics.median(times), len(buf.getvalue()), readable)


# -- the section -------------------------------------------------------------------------


@dataclass
class TokenizerResult:
    name: str
    what: str = ""
    skipped: str | None = None
    per_line_s: float = 0.0
    lines: int = 0
    corpus: str = "bundled"
    runs: dict[str, Run] = field(default_factory=dict)
    states: list[StateRun] = field(default_factory=list)
    state_buffer: int = STATE_BUFFER


def _per_line_s(tok: Callable[[str], Any], lines: list[str]) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for x in lines:
            tok(x)
        best = min(best, time.perf_counter() - t0)
    return best / len(lines)


def corpus_lines(corpus: str) -> list[str]:
    """The lines of ``corpus``: the bundled text files, or the ``.py`` files
    of this Python's standard library (``stdlib``)."""
    if corpus == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        paths = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
        out = []
        for path in paths:
            try:
                out.extend(path.read_text(encoding="utf-8").split("\n"))
            except (OSError, UnicodeDecodeError):
                continue
        return out
    return [
        line
        for path in sorted(glob.glob(CORPUS_GLOB))
        for line in Path(path).read_text(encoding="utf-8").split("\n")
    ]


def measure(
    scale: int, log: Callable[[str], None], corpus: str = "bundled"
) -> list[TokenizerResult]:
    lines_in = corpus_lines(corpus)
    if not lines_in:
        raise RuntimeError(f"seed: no {corpus} corpus (the bundled one is {CORPUS_GLOB}).")
    results = []
    toks: list[tuple[str, Callable[[list[str]], Callable[[str], list[int]]], str]] = [
        (
            "pure Python",
            train_py_tokenizer,
            "BERT-style normalisation + greedy longest-match subwords",
        ),
        ("BPE (tokenizers)", train_bpe, "BPE, 4000 pieces, trained here"),
    ]
    for name, train, what in toks:
        res = TokenizerResult(name, what, corpus=corpus)
        results.append(res)
        try:
            t0 = time.perf_counter()
            tok = train(lines_in)
            trained_s = time.perf_counter() - t0
        except ImportError as e:
            res.skipped = f"`tokenizers` is not importable ({e}); pip install 'centralpipe[bench]'"
            log(f"seed: {name} skipped: {res.skipped}")
            continue
        forms = Tok(tok)
        res.per_line_s = _per_line_s(tok, lines_in[:50_000])
        # Whole epoch incl. bucketing and padding, for the repeat count.
        serial_s = run_serial(lines_in[:50_000], tok).total_s * max(1, len(lines_in) / 50_000)
        reps = max(1, round(EPOCH_S / scale / serial_s))
        lines = lines_in * reps
        if corpus == "stdlib" and scale > 1:
            lines = lines[: max(1000, len(lines) // scale)]
        res.lines = len(lines)
        res.what = f"{what} in {trained_s:.1f} s; {res.per_line_s * 1e6:.1f} µs a line"
        for cname, fn in CONTENDERS:
            log(f"seed: {name}: {cname}")
            r = fn(lines, forms)
            if r.batches == 0:
                raise RuntimeError(f"seed: {cname} delivered no batch.")
            res.runs[cname] = r
        buffer = max(1000, STATE_BUFFER // scale)
        want = 2 * buffer + STATE_CALLS * 400  # a full buffer at every call
        state_lines = (lines_in * (1 + want // len(lines_in)))[:want]
        for form, form_tok in (("token lists", tok), ("int32 arrays", forms.arrays)):
            log(f"seed: {name}: state_dict(), {form}")
            res.states.append(measure_state(state_lines, form_tok, form, buffer))
        res.state_buffer = buffer
    return results


_ROLES = ("consumer", "feeder", "supervisor", "worker threads")


def _cpu_cells(r: Run) -> str:
    if not r.cpu_s:
        return "| | | | |"
    per = [r.cpu_s.get(role, 0.0) / r.lines * 1e6 for role in _ROLES]
    main = sum(per[:3])
    return f"| {main:.2f} | " + " | ".join(f"{x:.2f}" for x in per) + " |"


def report_lines(results: list[TokenizerResult]) -> list[str]:
    if not results:
        return []
    corpus = results[0].corpus
    where = (
        "the `.py` files of this Python's standard library"
        if corpus == "stdlib"
        else "`examples/data/*.txt` repeated"
    )
    out = [
        "",
        "## seed: lines → tokenizer → bucket_by_max_tokens → count → shard → dispatch → pad",
        "",
        f"Corpus: {where}; buckets of <= {MAX_TOKENS} tokens from a "
        f"{BUFFER}-line buffer; one epoch per contender. lines/s: the whole epoch, start-up "
        "included; start-up: ms to the first batch. Peers start workers with "
        f"`{PEER_START_METHOD}`.",
        "",
        "| tokenizer | contender | lines | lines/s | / serial | start-up ms | start-up share |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    for res in results:
        if res.skipped is not None:
            out.append(f"| {res.name} | skipped: {res.skipped} | | | | | |")
            continue
        serial = res.runs[SERIAL]
        for cname, r in res.runs.items():
            out.append(
                f"| {res.name} | {cname} | {r.lines:,} | {r.rate:,.0f} | "
                f"{r.rate / serial.rate:.2f}x | {r.first_s * 1e3:.0f} | "
                f"{r.first_s / r.total_s:.0%} |"
            )
    out.append("")
    for res in results:
        if res.skipped is None:
            out.append(f"- {res.name}: {res.what}")
    out += [
        "",
        "### seed: main-process CPU per line, by thread (µs)",
        "",
        "From `/proc/self/task/*/stat` (10 ms ticks) over the whole epoch, start-up included; "
        'main = consumer + feeder + supervisor (worker threads, with `executor="thread"`, '
        "apart).",
        "",
        "| tokenizer | contender | main | consumer | feeder | supervisor | worker threads |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    for res in results:
        for cname, r in res.runs.items():
            if r.cpu_s:
                out.append(f"| {res.name} | {cname} {_cpu_cells(r)}")
    out += [
        "",
        f"### seed: state_dict() mid-epoch, {results[0].state_buffer:,}-line bucket buffer, "
        "2 workers",
        "",
        "| tokenizer | items | state_dict() median (main-thread CPU) | checkpoint bytes "
        "| torch.load(weights_only=True) |",
        "|---|---|--:|--:|---|",
    ]
    for res in results:
        for st in res.states:
            readable = "reads it" if st.weights_only else "refuses it"
            out.append(
                f"| {res.name} | {st.form} | {st.state_s * 1e3:.2f} ms | {st.nbytes:,} | "
                f"{readable} |"
            )
    return out


def targets(results: list[TokenizerResult]) -> list[tuple[str, str, bool]]:
    out = []
    for res in results:
        if res.skipped is not None:
            continue
        s = res.runs[SERIAL].rate
        if res.name == "pure Python":
            out.append(
                (
                    "seed, pure-Python tokenizer: >= 20 µs a line",
                    f"{res.per_line_s * 1e6:.1f} µs",
                    res.per_line_s >= PY_TARGET_S,
                )
            )
        dl = res.runs["DataLoader (IterableDataset), 2 workers"].rate
        for ex, cname in (("process", FAST_PROCESS), ("thread", FAST_THREAD)):
            run = res.runs[cname]
            main = sum(run.cpu_s.get(role, 0.0) for role in _ROLES[:3]) / run.lines
            out.append(
                (
                    f"seed, {res.name}, {cname}: main-process CPU <= 3 µs a line",
                    f"{main * 1e6:.2f} µs",
                    main <= 3e-6,
                )
            )
            r = run.rate / s
            out.append(
                (
                    f"seed, {res.name}, parallel {ex}, 2 workers: >= 1.6x serial",
                    f"{r:.2f}x",
                    r >= 1.6,
                )
            )
            ahead = run.rate / dl
            out.append(
                (
                    f"seed, {res.name}, parallel {ex}, 2 workers: >= 1.2x DataLoader",
                    f"{ahead:.2f}x",
                    ahead >= 1.2,
                )
            )
            share = run.first_s / run.total_s
            out.append(
                (
                    f"seed, {res.name}, parallel {ex}: start-up < 10 % of the epoch",
                    f"{share:.0%} ({run.first_s * 1e3:.0f} ms)",
                    share < STARTUP_SHARE,
                )
            )
        r = res.runs[INLINE].rate / s
        out.append(
            (f"seed, {res.name}, inline, 0 workers: within 5 % of serial", f"{r:.2f}x", r >= 0.95)
        )
    return out
