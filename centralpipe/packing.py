"""Worker-side helpers for packed sequences (the groups ``pack()`` emits).

A packed group is a list of token sequences that share one row of
``max_tokens``. Attention must not cross from one sequence into another, and
positions restart at 0 for each sequence. :func:`segments` turns a group into
the tensors that say so; :func:`attention_mask` builds the boolean mask from
``segment_ids`` for attention functions that take one (e.g.
``torch.nn.functional.scaled_dot_product_attention(attn_mask=...)``). Use them
after ``dispatch()``::

    pipe = (
        cp.Pipeline.from_files("data/*.txt").read_lines().map(tokenize)
        .pack(2048, strategy="best_fit", buffer_size=10_000)
        .dispatch()
        .map(functools.partial(cp.packing.segments, pad_to=2048))
    )
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["PAD_SEGMENT", "attention_mask", "segments"]

#: ``segment_ids`` value of padding positions.
PAD_SEGMENT = -1


def _as_tokens(seq: Any, index: int) -> torch.Tensor:
    if isinstance(seq, torch.Tensor):
        if seq.dim() != 1:
            msg = (
                f"segments: sequence {index} must be 1-D, got a tensor of shape {tuple(seq.shape)}."
            )
            raise ValueError(msg)
        if seq.dtype.is_floating_point or seq.dtype.is_complex or seq.dtype == torch.bool:
            msg = f"segments: sequence {index} must hold integer token ids, got {seq.dtype}."
            raise ValueError(msg)
        return seq.to(torch.long)
    if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
        msg = (
            f"segments: sequence {index} must be a list of token ids or a 1-D tensor, "
            f"got {type(seq).__name__}."
        )
        raise TypeError(msg)
    try:
        return torch.tensor(seq, dtype=torch.long).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as exc:
        msg = f"segments: sequence {index} must hold int token ids ({exc})."
        raise TypeError(msg) from None


def segments(
    group: Sequence[Any], *, pad_to: int | None = None, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """One packed row: ``tokens``, ``segment_ids``, ``positions`` and ``cu_seqlens``.

    Args:
        group: token sequences (lists of ints or 1-D integer tensors), e.g. one
            list emitted by ``pack()``. Empty sequences are kept (they take no
            position but count as a segment).
        pad_to: pad the row to this length (e.g. ``max_tokens``, so every row
            has one shape); ``None`` leaves it at the summed length.
        pad_id: token id of padding positions.

    Returns:
        ``tokens`` (long, ``[L]``), ``segment_ids`` (long, ``[L]``: ``i`` for
        the ``i``-th sequence, ``PAD_SEGMENT`` for padding), ``positions``
        (long, ``[L]``: ``0..len-1`` within each sequence, ``0`` for padding)
        and ``cu_seqlens`` (int32, ``[len(group) + 1]``: cumulative sequence
        lengths, padding excluded, as variable-length attention kernels take).

    Raises:
        TypeError: ``group`` or one of its sequences is not a sequence of ints.
        ValueError: ``group`` is empty, or longer than ``pad_to``.
    """
    if isinstance(group, (str, bytes, torch.Tensor)) or not isinstance(group, Sequence):
        msg = f"segments: `group` must be a list of token sequences, got {type(group).__name__}."
        raise TypeError(msg)
    if not group:
        raise ValueError("segments: `group` is empty; pack() never emits an empty group.")
    parts = [_as_tokens(seq, i) for i, seq in enumerate(group)]
    lengths = torch.tensor([p.numel() for p in parts], dtype=torch.long)
    total = int(lengths.sum())
    width = total if pad_to is None else pad_to
    if pad_to is not None and (not isinstance(pad_to, int) or isinstance(pad_to, bool)):
        raise TypeError(f"segments: `pad_to` must be an int or None, got {pad_to!r}.")
    if width < total:
        msg = f"segments: the group holds {total} tokens, more than pad_to={pad_to}."
        raise ValueError(msg)
    tokens = torch.full((width,), pad_id, dtype=torch.long)
    tokens[:total] = torch.cat(parts)
    segment_ids = torch.full((width,), PAD_SEGMENT, dtype=torch.long)
    segment_ids[:total] = torch.repeat_interleave(torch.arange(len(parts)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.zeros(width, dtype=torch.long)
    positions[:total] = torch.arange(total) - torch.repeat_interleave(starts, lengths)
    cu_seqlens = torch.zeros(len(parts) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return {
        "tokens": tokens,
        "segment_ids": segment_ids,
        "positions": positions,
        "cu_seqlens": cu_seqlens,
    }


def attention_mask(segment_ids: torch.Tensor, *, causal: bool = True) -> torch.Tensor:
    """Boolean mask ``[..., L, L]``: ``True`` where query ``i`` may attend key ``j``.

    Positions attend within their own segment (and only to earlier or equal
    positions with ``causal=True``). A padding position attends only to itself,
    so no row is all ``False`` (which would make softmax produce NaN); mask
    padding out of the loss instead.
    """
    if not isinstance(segment_ids, torch.Tensor) or segment_ids.dim() < 1:
        msg = "attention_mask: `segment_ids` must be a tensor of shape [..., L]."
        raise TypeError(msg)
    q = segment_ids.unsqueeze(-1)
    k = segment_ids.unsqueeze(-2)
    mask = (q == k) & (q != PAD_SEGMENT)
    length = segment_ids.shape[-1]
    if causal:
        mask &= torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    mask |= torch.eye(length, dtype=torch.bool, device=segment_ids.device)
    return mask
