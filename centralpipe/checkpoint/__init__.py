"""The checkpoint: its one typed model, and what reads and merges it.

- ``model``   the one typed checkpoint and the only module that knows its
  layout: attrs classes (:class:`Checkpoint`, one :class:`Boundary` per
  in-flight entry) built and checked from the wire dict (:func:`structure`,
  errors name the key path), the fast writers ``state_dict()`` uses
  (:class:`~centralpipe.checkpoint.model.Captured`), and the outline
  ``inspect`` prints.
- ``values``  the value checks the model's fields use (counts, stamps, ranges).
- ``resume``  the Loader's plumbing: what a pass resumes from a loaded
  checkpoint, and what a checkpoint must match (:func:`~.resume.expected`).
- ``inspect`` ``python -m centralpipe inspect``: a checkpoint file's summary.
- ``fit``     the checks of a checkpoint against the pipeline it resumes
  (:class:`Expected`, :func:`check_pipeline`, :func:`rank_mismatch`).
- ``elastic`` merging every rank's state into one that resumes on any world
  size (:func:`~centralpipe.merge_states`).
- ``gather``  the collective side of it (:func:`~centralpipe.gather_states`).
- ``compact`` lists of 1-D arrays (token data: in-flight items, stage
  buffers) saved as one flat tensor plus lengths (:func:`encode_items` /
  :func:`decode_items`).
- ``table``   a bucket's heap of such arrays kept as sealed segments, so a
  state encodes what changed since the last one (:class:`HeapArena`).

This package's names are the model's and the checks' (``model``'s import
path before them was ``centralpipe.checkpoint``, which keeps them).
"""

from centralpipe.checkpoint.fit import Expected, check_pipeline, rank_mismatch
from centralpipe.checkpoint.model import (
    FORMAT_VERSION,
    Boundary,
    Checkpoint,
    Distributed,
    Position,
    structure,
    structure_state,
    unstructure,
)

__all__ = [
    "FORMAT_VERSION",
    "Boundary",
    "Checkpoint",
    "Distributed",
    "Expected",
    "Position",
    "check_pipeline",
    "rank_mismatch",
    "structure",
    "structure_state",
    "unstructure",
]
