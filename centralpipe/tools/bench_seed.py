"""``python -m centralpipe bench --only seed``: the token-bucket workload end to end.

Text lines (the bundled corpus ``examples/data/*.txt``, repeated) go through a
tokenizer, ``bucket_by_max_tokens``, ``count``, ``shard`` (world size 1),
``dispatch()`` and are padded into a ``LongTensor`` per batch. Two tokenizers:
a pure-Python greedy longest-match tokenizer (its cost per line is measured and
printed), and a BPE tokenizer from the ``tokenizers`` package trained here on
the corpus (skipped, with the reason, when that package is missing; it comes
with the ``bench`` extra). Every contender does the same work once; lines/s
cover the whole epoch and the time to the first batch is shown beside it.
"""

from __future__ import annotations

import glob
import heapq
import os
import tempfile
import time
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torchdata.nodes as tn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import centralpipe as cp

__all__ = ["WORKERS", "measure", "report_lines", "targets"]

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


def pad(batch: list[list[int]]) -> torch.Tensor:
    """Token lists padded with ``PAD_ID`` into ``LongTensor[batch, longest]``."""
    longest = max(len(s) for s in batch)
    out = torch.full((len(batch), longest), PAD_ID, dtype=torch.long)
    for row, seq in enumerate(batch):
        out[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def bucketize(seqs: Iterator[list[int]]) -> Iterator[list[list[int]]]:
    """Shortest-first max-token buckets from a ``BUFFER``-item buffer (as
    ``bucket_by_max_tokens(MAX_TOKENS, buffer_size=BUFFER, min_len=1)``)."""
    heap: list[tuple[int, int, list[int]]] = []
    batch: list[list[int]] = []
    total = 0

    def pop() -> Iterator[list[list[int]]]:
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
        if s:
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
    #: CPU time of the main process (all its threads; worker threads too
    #: with the thread executor), start-up included.
    cpu_s: float = 0.0

    @property
    def rate(self) -> float:
        return self.lines / self.total_s


def _now() -> tuple[float, float]:
    """Wall clock and this process's CPU time, at a contender's start."""
    return time.perf_counter(), time.process_time()


def _consume(it: Iterator[torch.Tensor], start: tuple[float, float], lines: int) -> Run:
    t0, c0 = start
    first, batches = None, 0
    for _ in it:
        batches += 1
        if first is None:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    cpu = time.process_time() - c0
    return Run(lines, batches, first if first is not None else total, total, cpu)


def run_serial(lines: list[str], tok: Callable[[str], list[int]]) -> Run:
    t0 = _now()
    return _consume((pad(b) for b in bucketize(tok(x) for x in lines)), t0, len(lines))


def run_centralpipe(
    lines: list[str], tok: Callable[[str], list[int]], workers: int, parallel: bool, executor: str
) -> Run:
    pipe = (
        cp.Pipeline.from_iterable(lines)
        .map(tok, parallel=parallel)
        .bucket_by_max_tokens(MAX_TOKENS, buffer_size=BUFFER, min_len=1)
        .count("pre_shard", weight_fn=len)
        .shard()
        .dispatch()
        .map(pad)
    )
    workers_cfg = cp.WorkerConfig(num_workers=workers, executor=executor)
    t0 = _now()
    with cp.Loader[torch.Tensor](pipe, cp.LoaderConfig(workers=workers_cfg)) as loader:
        return _consume(iter(loader), t0, len(lines))


def run_centralpipe_file(
    lines: list[str], tok: Callable[[str], list[int]], read_in_workers: bool
) -> Run:
    """``parallel=True`` on 2 process workers, the lines read from a file by
    ``read_lines``: the workers read byte ranges (``read_in_workers``) or
    the main process sends them lines."""
    with tempfile.TemporaryDirectory(prefix="centralpipe-seed-") as root:
        path = os.path.join(root, "lines.txt")
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.writelines(line + "\n" for line in lines)
        pipe = (
            cp.Pipeline.from_files(path)
            .read_lines()
            .map(tok, parallel=True)
            .bucket_by_max_tokens(MAX_TOKENS, buffer_size=BUFFER, min_len=1)
            .count("pre_shard", weight_fn=len)
            .shard()
            .dispatch()
            .map(pad)
        )
        workers = cp.WorkerConfig(num_workers=WORKERS, read_in_workers=read_in_workers)
        t0 = _now()
        with cp.Loader[torch.Tensor](pipe, cp.LoaderConfig(workers=workers)) as loader:
            return _consume(iter(loader), t0, len(lines))


class TokenBuckets(IterableDataset[torch.Tensor]):
    """Each DataLoader worker tokenizes and buckets every k-th line."""

    def __init__(self, lines: list[str], tok: Callable[[str], list[int]]) -> None:
        self.lines, self.tok = lines, tok

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        tok = self.tok
        return (pad(b) for b in bucketize(tok(x) for x in self.lines[start::step]))


def run_dataloader(lines: list[str], tok: Callable[[str], list[int]]) -> Run:
    t0 = _now()
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


class BucketNode(tn.BaseNode[list[list[int]]]):
    """A torchdata.nodes node running :func:`bucketize` over its source (no checkpointing)."""

    def __init__(self, source: tn.BaseNode[list[int]]) -> None:
        super().__init__()
        self.source = source
        self._it: Iterator[list[list[int]]] | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset()
        self._it = bucketize(iter(self.source))

    def next(self) -> list[list[int]]:
        assert self._it is not None
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        return {}


def run_nodes(lines: list[str], tok: Callable[[str], list[int]]) -> Run:
    from centralpipe.tools.bench_contenders import shutdown_nodes as _shutdown_nodes

    mapped = tn.ParallelMapper(
        tn.IterableWrapper(lines),
        tok,
        num_workers=WORKERS,
        method="process",
        multiprocessing_context=PEER_START_METHOD,
    )
    node = tn.Mapper(BucketNode(mapped), pad)
    t0 = _now()
    try:
        return _consume(iter(tn.Loader(node)), t0, len(lines))
    finally:
        _shutdown_nodes(mapped)


CONTENDERS: tuple[tuple[str, Callable[[list[str], Any], Run]], ...] = (
    ("serial loop", run_serial),
    ("centralpipe inline, 0 workers", lambda ls, t: run_centralpipe(ls, t, 0, False, "process")),
    ("centralpipe inline, 2 workers", lambda ls, t: run_centralpipe(ls, t, 2, False, "process")),
    (
        "centralpipe parallel=True, process",
        lambda ls, t: run_centralpipe(ls, t, 2, True, "process"),
    ),
    ("centralpipe parallel=True, thread", lambda ls, t: run_centralpipe(ls, t, 2, True, "thread")),
    (
        "centralpipe parallel=True, process, file read in workers",
        lambda ls, t: run_centralpipe_file(ls, t, True),
    ),
    (
        "centralpipe parallel=True, process, file lines sent",
        lambda ls, t: run_centralpipe_file(ls, t, False),
    ),
    ("DataLoader (IterableDataset), 2 workers", run_dataloader),
    ("torchdata.nodes ParallelMapper, 2 workers", run_nodes),
)


# -- the section -------------------------------------------------------------------------


@dataclass
class TokenizerResult:
    name: str
    what: str = ""
    skipped: str | None = None
    per_line_s: float = 0.0
    lines: int = 0
    runs: dict[str, Run] = field(default_factory=dict)


def _per_line_s(tok: Callable[[str], list[int]], lines: list[str]) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for x in lines:
            tok(x)
        best = min(best, time.perf_counter() - t0)
    return best / len(lines)


def measure(scale: int, log: Callable[[str], None]) -> list[TokenizerResult]:
    corpus = [
        line
        for path in sorted(glob.glob(CORPUS_GLOB))
        for line in Path(path).read_text(encoding="utf-8").split("\n")
    ]
    if not corpus:
        raise RuntimeError(f"seed: no corpus at {CORPUS_GLOB} (it ships with the source tree).")
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
        res = TokenizerResult(name, what)
        results.append(res)
        try:
            t0 = time.perf_counter()
            tok = train(corpus)
            trained_s = time.perf_counter() - t0
        except ImportError as e:
            res.skipped = f"`tokenizers` is not importable ({e}); pip install 'centralpipe[bench]'"
            log(f"seed: {name} skipped: {res.skipped}")
            continue
        res.per_line_s = _per_line_s(tok, corpus)
        # Whole epoch incl. bucketing and padding, for the repeat count.
        serial_s = run_serial(corpus, tok).total_s
        reps = max(1, round(EPOCH_S / scale / serial_s))
        lines = corpus * reps
        res.lines = len(lines)
        res.what = f"{what} in {trained_s:.1f} s; {res.per_line_s * 1e6:.1f} µs a line"
        for cname, fn in CONTENDERS:
            log(f"seed: {name}: {cname}")
            r = fn(lines, tok)
            if r.batches == 0:
                raise RuntimeError(f"seed: {cname} delivered no batch.")
            res.runs[cname] = r
    return results


def report_lines(results: list[TokenizerResult]) -> list[str]:
    if not results:
        return []
    out = [
        "",
        "## seed: lines → tokenizer → bucket_by_max_tokens → count → shard → dispatch → pad",
        "",
        f"Corpus `examples/data/*.txt` repeated; buckets of <= {MAX_TOKENS} tokens from a "
        f"{BUFFER}-line buffer; one epoch per contender. lines/s: the whole epoch, start-up "
        "included; start-up: ms to the first batch; main CPU: the main process's CPU "
        "time per line (all its threads, worker threads too with the thread executor). "
        f"Peers start workers with `{PEER_START_METHOD}`.",
        "",
        "| tokenizer | contender | lines | lines/s | / serial | start-up ms | start-up share "
        "| main CPU µs/line |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for res in results:
        if res.skipped is not None:
            out.append(f"| {res.name} | skipped: {res.skipped} | | | | | | |")
            continue
        serial = res.runs["serial loop"]
        for cname, r in res.runs.items():
            out.append(
                f"| {res.name} | {cname} | {r.lines:,} | {r.rate:,.0f} | "
                f"{r.rate / serial.rate:.2f}x | {r.first_s * 1e3:.0f} | "
                f"{r.first_s / r.total_s:.0%} | {r.cpu_s / r.lines * 1e6:.1f} |"
            )
    out.append("")
    for res in results:
        if res.skipped is None:
            out.append(f"- {res.name}: {res.what}")
    return out


def targets(results: list[TokenizerResult]) -> list[tuple[str, str, bool]]:
    out = []
    for res in results:
        if res.skipped is not None:
            continue
        s = res.runs["serial loop"].rate
        if res.name == "pure Python":
            out.append(
                (
                    "seed, pure-Python tokenizer: >= 20 µs a line",
                    f"{res.per_line_s * 1e6:.1f} µs",
                    res.per_line_s >= PY_TARGET_S,
                )
            )
        peers = [n for n in res.runs if n.startswith(("DataLoader", "torchdata"))]
        for ex in ("process", "thread"):
            run = res.runs[f"centralpipe parallel=True, {ex}"]
            r = run.rate / s
            out.append(
                (
                    f"seed, {res.name}, parallel {ex}, 2 workers: >= 1.5x serial",
                    f"{r:.2f}x",
                    r >= 1.5,
                )
            )
            best = max(peers, key=lambda n: res.runs[n].rate)
            ahead = run.rate / res.runs[best].rate
            out.append(
                (
                    f"seed, {res.name}, parallel {ex}, 2 workers: ahead of every peer",
                    f"{ahead:.2f}x the best ({best.split(' (')[0].split(',')[0]})",
                    ahead > 1.0,
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
        r = res.runs["centralpipe inline, 0 workers"].rate / s
        out.append(
            (f"seed, {res.name}, inline, 0 workers: within 10 % of serial", f"{r:.2f}x", r >= 0.9)
        )
    return out
