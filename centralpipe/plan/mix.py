"""The spec of ``Pipeline.mix``: its sub-pipelines, weights and stop mode, checked.

A ``mix`` spec is a source whose options hold each sub-pipeline as a
:class:`~centralpipe.plan.specs.Plan` with its stages' names qualified by
the mix and the source (stage ``tok`` of source ``en`` in mix ``mix`` is
``mix/en/tok``), the weights as floats and ``stop``. The node that draws from
them is :class:`centralpipe.stages.mix.Mix`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

import attrs

from centralpipe.errors import PipelineError
from centralpipe.plan.options import MixOptions
from centralpipe.plan.specs import STOP_MODES, Plan, StageSpec

__all__ = ["REFUSED_KINDS", "check_weights", "inner_specs", "mix_spec"]

#: Kinds a sub-pipeline may not hold: it would split the stream before mixing.
REFUSED_KINDS = ("shard",)


def _qualify(spec: StageSpec, prefix: str) -> StageSpec:
    options = spec.options
    if isinstance(options, MixOptions):
        pipelines = {
            key: Plan(tuple(_qualify(s, prefix) for s in plan.stages))
            for key, plan in options.pipelines.items()
        }
        options = attrs.evolve(options, pipelines=pipelines)
    return attrs.evolve(spec, name=prefix + spec.name, options=options)


def check_weights(weights: Any, keys: Sequence[str], name: str) -> dict[str, float]:
    """Weights as floats in ``keys`` order; ``PipelineError`` naming what is wrong."""
    if not isinstance(weights, Mapping):
        msg = (
            f"mix '{name}': `weights` must be a dict of source name -> weight, "
            f"got {type(weights).__name__}."
        )
        raise PipelineError(msg)
    missing = [k for k in keys if k not in weights]
    extra = [k for k in weights if k not in keys]
    if missing or extra:
        msg = (
            f"mix '{name}': `weights` must have one entry per source {list(keys)}; "
            f"missing {missing}, unknown {extra}."
        )
        raise PipelineError(msg)
    out: dict[str, float] = {}
    for key in keys:
        out[key] = _check_weight(weights[key], key, name)
    if not any(out.values()):
        msg = f"mix '{name}': at least one weight must be > 0, got {out}."
        raise PipelineError(msg)
    if not math.isfinite(sum(out.values())):  # the draw adds them up as floats
        msg = (
            f"mix '{name}': the weights must have a finite sum as floats, got {out}; "
            "scale them down (only their ratios matter)."
        )
        raise PipelineError(msg)
    return out


def _check_weight(w: Any, key: str, name: str) -> float:
    """One source's weight as a finite float >= 0; ``PipelineError`` naming the source."""
    expected = f"mix '{name}': the weight of source '{key}' must be a finite number >= 0"
    if not isinstance(w, Real) or isinstance(w, bool):
        raise PipelineError(f"{expected}, got {type(w).__name__} {w!r:.80}.")
    try:
        f = float(w)  # an int or Fraction beyond the float range overflows here
    except OverflowError:
        msg = (
            f"{expected}, got {type(w).__name__} beyond the float range (> {sys.float_info.max:.3g}"
            " in magnitude); scale the weights down (only their ratios matter)."
        )
        raise PipelineError(msg) from None
    if not math.isfinite(f) or f < 0:
        raise PipelineError(f"{expected}, got {w!r:.80}.")
    return f


def mix_spec(plans: Any, weights: Any, stop: Any, name: Any) -> StageSpec:
    """The validated ``mix`` source spec; see :meth:`Pipeline.mix`. ``plans``
    maps each source name to the :class:`Plan` of its pipeline (the builder
    makes one of each ``Pipeline``; any other value is refused)."""
    if not isinstance(name, str) or not name:
        raise PipelineError(f"a stage name must be a non-empty str, got {name!r}.")
    if not isinstance(plans, Mapping) or not plans:
        msg = (
            f"mix '{name}': `pipelines` must be a non-empty dict of source name -> Pipeline, "
            f"got {plans!r:.80}."
        )
        raise PipelineError(msg)
    if stop not in STOP_MODES:
        raise PipelineError(f"mix '{name}': `stop` must be one of {STOP_MODES}, got {stop!r}.")
    keys = list(plans)
    subs: dict[str, Plan] = {}
    for key in keys:
        plan = plans[key]
        if not isinstance(key, str) or not key or "/" in key:
            msg = f"mix '{name}': source names must be non-empty str without '/', got {key!r}."
            raise PipelineError(msg)
        if not isinstance(plan, Plan):
            msg = f"mix '{name}': source '{key}' must be a Pipeline, got {type(plan).__name__}."
            raise PipelineError(msg)
        for spec in plan.stages:
            if spec.placement in ("dispatch", "worker") or spec.parallel:
                msg = (
                    f"mix '{name}': source '{key}' has stage '{spec.name}' ({spec.kind}, "
                    f"{'parallel' if spec.parallel else spec.placement}); "
                    "sub-pipelines hold central stages only: call .dispatch() and parallel "
                    "stages after Pipeline.mix(...)."
                )
                raise PipelineError(msg)
            if spec.kind in REFUSED_KINDS:
                msg = (
                    f"mix '{name}': source '{key}' has a {spec.kind}() ('{spec.name}'); shard "
                    "the mixed stream instead: Pipeline.mix(...).shard()."
                )
                raise PipelineError(msg)
        prefix = f"{name}/{key}/"
        subs[key] = Plan(tuple(_qualify(s, prefix) for s in plan.stages))
    return StageSpec(
        "mix",
        name,
        "source",
        options=MixOptions(pipelines=subs, weights=check_weights(weights, keys, name), stop=stop),
    )


def inner_specs(spec: StageSpec) -> list[StageSpec]:
    """Every stage inside a ``mix`` spec (nested mixes included), in order."""
    out: list[StageSpec] = []
    if isinstance(spec.options, MixOptions):
        for plan in spec.options.pipelines.values():
            for s in plan.stages:
                out.append(s)
                out.extend(inner_specs(s))
    return out
