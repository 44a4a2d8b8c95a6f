"""The builder: what a pipeline is, before it runs.

- ``pipeline``  :class:`~centralpipe.Pipeline`, the chain of stage specs,
  checked as it is built;
- ``checks``    the builder's argument checks (one per stage kind's arguments);
- ``sources``   the specs of ``Pipeline.from_*``;
- ``mix``       the spec of ``Pipeline.mix`` (sub-pipelines, weights, names);
- ``specs``     the frozen :class:`~centralpipe.plan.specs.StageSpec`;
- ``kinds``     the per-item kinds (map, filter, flat_map, collate, batched
  map): typed options, length rule, how each applies in the worker chain.

``specs`` and ``kinds`` are also what a worker receives (pickled): they
import neither the builder nor torch, and importing this package imports no
module of it. Central stage modules import only those two.
"""
