"""One model's backend decisions, cached (``SparseMLA.backend_for``).

``registry.select`` runs once per (requested backend, kind, phase, range of launch sizes): the
ranges are the measured choices table's (``registry.launch_bucket``) and those the launch limits
of the model's own backend instances cut (``Backend.launch_limit``: a launch above one goes to
the next backend). A limit learnt during a selection, or moved by ``reserve``, drops the cached
decisions, so that a decision never outlives the ranges it was made for.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from . import choices, registry
from .backend import Backend, BackendUnavailableError, Dialects
from .layout import KVFormat
from .plan import Phase
from .platform import Platform
from .spec import LayerKind, ModelSpec


class Selection:
    """The decisions of one model; ``instance(name)`` is the model's own instance of a backend
    (the one whose launch limit applies)."""

    def __init__(self, instance: Callable[[str], Backend]) -> None:
        self._instance = instance
        self._decided: dict[tuple, str] = {}
        self._bounds: dict[Phase, list[int]] = {}  # the launch limits met so far, sorted

    def pick(self, platform: Platform, spec: ModelSpec, fmt: KVFormat, dialects: Dialects, kind: LayerKind,
             phase: Phase, requested: str, source: str, num_tokens: int | None) -> str:
        """The backend for one launch of ``num_tokens`` tokens (None: any size), cached."""
        bucket = None  # auto: one decision per launch-size range of the measured table
        if requested == "auto" and num_tokens:
            bucket = registry.launch_bucket(platform, spec, fmt, kind, phase, num_tokens)
        key = (requested, kind, phase, bucket)
        name = self._decided.get(key + (self._limit_bucket(phase, num_tokens),))
        if name is None:
            name = registry.select(platform, spec, fmt, kind, phase, requested, source, dialects, num_tokens,
                                   self._limited)
            # keyed after the selection: it may have met a launch limit, which splits the sizes
            self._decided[key + (self._limit_bucket(phase, num_tokens),)] = name
        return name

    def limit_note(self, name: str, phase: Phase, beyond: Callable[[int], str]) -> str:
        """Where ``name``'s ``phase`` launches above its launch limit run (``beyond(num_tokens)``:
        the pick for that size), for ``explain()``; "" without a limit."""
        limit = self._instance(name).launch_limit(phase)
        if limit is None:
            return ""
        try:
            where = beyond(limit.max_tokens + 1)
        except BackendUnavailableError:
            where = "nothing: they raise"
        return f"{phase.value} launches above {limit.max_tokens} tokens ({limit.why}) run on {where}"

    def forget(self) -> None:
        """Drop every decision and limit (``reserve`` may have moved a limit)."""
        self._bounds.clear()
        self._decided.clear()

    def _limit_bucket(self, phase: Phase, num_tokens: int | None) -> int:
        """How many of the limits met so far a launch of ``num_tokens`` is above (-1 without a
        launch size: such a decision never asked a limit)."""
        if not num_tokens:
            return -1
        bounds = self._bounds.get(phase)
        return bisect.bisect_left(bounds, num_tokens) if bounds else 0

    def _limited(self, name: str) -> Backend:
        """The model's instance of ``name``, its launch limits noted (new ones drop the decisions
        keyed by the old ranges)."""
        backend = self._instance(name)
        for phase in backend.phases:
            limit = backend.launch_limit(phase)
            bounds = self._bounds.setdefault(phase, [])
            if limit is not None and limit.max_tokens not in bounds:
                bisect.insort(bounds, limit.max_tokens)
                self._decided.clear()
        return backend


def measured_lines(plat: Platform, spec: ModelSpec, fmt: KVFormat, requested: str) -> list[str]:
    """``SparseMLA.explain``'s lines on the measured choices (common/choices.py) that reorder auto
    selection for ``spec`` in ``fmt``, by token range (none unless ``requested`` is "auto"); its
    "chosen" rows are the choice for a launch no measurement covers."""
    entries, where, note = choices.table_for(plat.arch, plat.device_name)
    kinds = {k.name for k in spec.kinds}
    mine = [e for e in entries if e.kind in kinds and e.fmt == fmt.value
            and e.heads == choices.heads_bucket(spec.num_heads)]
    if not mine or requested != "auto":
        return []
    if note:
        where = f"{where}: {note}"
    out = [f"measured choices ({where}; auto tries this order first for launches in range; where the "
           "table has per-step costs, ordered for this model's layers of the kind):"]
    for e in mine:
        layers = registry.layers_per_step(spec, LayerKind.parse(e.kind))
        costs = e.costs(layers)
        out.append(f"  {e.kind:<6} {e.phase:<8} tokens {e.tokens[0]}-{e.tokens[1] - 1}: "
                   f"{' > '.join(e.ranked(layers))}  [{f'{costs}; ' if costs else ''}{e.evidence}]")
    return out
