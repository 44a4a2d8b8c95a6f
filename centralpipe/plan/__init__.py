"""The builder: what a pipeline is, before it runs. ``pipeline`` holds
:class:`~centralpipe.Pipeline` (the chain of stage specs, checked as it is
built); ``specs`` the frozen :class:`~centralpipe.plan.specs.StageSpec`, the
worker stage kinds and the argument checks the builder shares. The specs are
also what a worker receives (pickled): ``specs`` imports neither the builder
nor torch, and importing this package imports neither module."""
