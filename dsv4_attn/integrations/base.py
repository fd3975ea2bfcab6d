"""What every dsv4_attn engine plugin does the same way (vLLM, SGLang, a third engine).

* :class:`EngineGate` -- the opt-in (one ``DSV4_ATTN_<ENGINE>`` switch, read by ``envs``, or the
  engine's ``--attention-backend`` name), the tested-version gate with its refusal, and the
  ``status()`` dict ``dsv4-attn probe`` prints;
* :func:`reason` / :func:`refuse` -- refusals in one form: the flag, the value it got, what is
  allowed and what to pass instead; all of a layer's reasons raised together at engine start;
* :func:`describe_backends` -- the per-worker log line saying what runs where;
* :class:`StepPlannerBase` -- the planner lifecycle: ``SparseMLA`` built at engine start (backend
  refusals surface there), buffers reserved before the engine sizes its KV cache, one
  ``plan()`` per engine step, every layer of the step run on that plan.

docs/architecture.md, "Guide: adding an engine plugin", says how a plugin uses them.
"""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass

from .. import envs
from ..api import SparseMLA
from ..common.backend import Phase
from ..common.batch import StepBatch
from ..common.plan import StepPlan
from ..common.rows import StepRows


# ---- opt-in, version gate, status ----------------------------------------------------------------
@dataclass(frozen=True)
class EngineGate:
    """One engine's gates. ``tested``: the versions the plugin's hooks were written against --
    release series ("0.33": any 0.33.x) when ``series``, else exact versions; ``allowed``: how
    a refusal names them; ``why_pinned``: what moves between releases."""

    engine: str  # "vLLM"
    dist: str  # the distribution name ("vllm")
    entry_group: str  # the engine's plugin entry-point group
    switch: envs.EnvVar  # DSV4_ATTN_<ENGINE>
    backend_name: str  # the --attention-backend name the plugin adds
    tested: tuple[str, ...]
    series: bool
    allowed: str
    why_pinned: str

    @property
    def env_name(self) -> str:
        return self.switch.name

    def env_enabled(self) -> bool:
        """The switch (1/on or 0/off/unset); anything else raises ValueError naming it."""
        return bool(self.switch.get())

    def is_tested(self, version: str) -> bool:
        release = version.split("+")[0]
        if self.series:
            return any(release.split(".")[:2] == t.split(".") for t in self.tested)
        return release in self.tested

    @property
    def tested_label(self) -> str:
        return ", ".join(f"{t}.x" if self.series else t for t in self.tested)

    def turn_off(self) -> str:
        return f"unset {self.env_name}, drop --attention-backend {self.backend_name}"

    def check_version(self, version: str) -> None:
        if not self.is_tested(version):
            pin = f"{self.tested[-1]}.*" if self.series else self.tested[-1]
            raise RuntimeError(
                f"dsv4_attn {self.engine} plugin: got {self.engine} {version}; allowed: {self.allowed} (the "
                f"versions it is tested with: {self.why_pinned}). Install {self.dist}=={pin} or turn the plugin "
                f"off ({self.turn_off()})."
            )

    def status(self, on_note: str) -> dict[str, str]:
        """The plugin's state for ``dsv4-attn probe`` (package metadata only: imports no engine
        code). ``on_note``: what runs on dsv4_attn when the plugin is on."""
        try:
            version = md.version(self.dist)
        except md.PackageNotFoundError:
            version = None
        declared = any(ep.name == "dsv4_attn" for ep in md.entry_points(group=self.entry_group))
        raw = self.switch.raw
        try:
            on, bad = self.env_enabled(), ""
        except ValueError as exc:
            on, bad = None, str(exc)
        if version is None:
            verdict = f"off ({self.dist} not installed)"
        elif not self.is_tested(version):
            verdict = f"refused ({self.engine} {version}; tested: {self.tested_label})"
        elif not declared:
            verdict = (f"off (dsv4-attn's {self.entry_group} entry point is not installed: pip install -e <a clone "
                       "of dsv4-attn> in this environment)")
        elif on is None:
            verdict = f"refused at engine start ({bad})"
        elif on:
            verdict = f"on ({self.env_name}={raw}): {on_note}"
        else:
            verdict = f"available: on with {self.env_name}=1 or --attention-backend {self.backend_name}"
        return {self.dist: version or "not installed", "entry point": "installed" if declared else "missing",
                self.env_name: raw or "unset", f"{self.dist} plugin": verdict}


# ---- refusals ------------------------------------------------------------------------------------
def reason(flag: str, got: object, allowed: str, instead: str = "") -> str:
    """One refusal reason: ``flag: got <value>; allowed: <what> (<what to pass instead>)``."""
    return f"{flag}: got {got}; allowed: {allowed}" + (f" ({instead})" if instead else "")


def refuse(what: str, reasons: list[str]) -> None:
    """Raise every reason at once (engine start), or nothing when there is none."""
    if reasons:
        raise ValueError(f"dsv4_attn cannot serve {what}:\n" + "\n".join(f"  - {r}" for r in reasons))


# ---- the per-worker log line ---------------------------------------------------------------------
def describe_backends(mla: SparseMLA) -> str:
    """``(arch, format, N heads per rank, backend X)``: one name when every layer kind and phase
    runs on one backend, else the choice per kind and phase."""
    choice = {f"{k.name} {p.value}": mla.backend_for(k, p) for k in mla.spec.kinds for p in Phase}
    names = sorted(set(choice.values()))
    return (f"({mla.platform.arch}, {mla.fmt.value}, {mla.spec.num_heads} heads per rank, backend "
            f"{names[0] if len(names) == 1 else choice})")


def decode_launch_bound(max_requests: int, tokens_per_request: int, max_tokens: int) -> int:
    """The most decode tokens one launch can hold: every request slot decoding its 1 + draft
    tokens, within the step's token budget (prefill tokens are another phase's launch)."""
    return max(1, min(max_tokens, max_requests * tokens_per_request))


# ---- the planner lifecycle -----------------------------------------------------------------------
class StepPlannerBase:
    """Plan once per engine step, run every layer of the step on that plan, reserve at start.

    Subclasses map the engine's per-step metadata onto a :class:`StepBatch` / :class:`StepRows`
    and decide when a step starts; this base builds the ``SparseMLA`` (its construction asks
    every layer kind's backend, so refusals surface at engine start), counts the plans built,
    and reserves: plans an empty step (the plan buffers) and lets the decode backends allocate
    their scratch for ``decode_tokens`` decode tokens per launch (``SparseMLA.reserve``).
    """

    def __init__(self) -> None:
        self.plans_built = 0

    def plan_step(self, mla: SparseMLA, batch: StepBatch | StepRows) -> StepPlan:
        self.plans_built += 1
        return mla.plan(batch)

    @staticmethod
    def reserve_buffers(mla: SparseMLA, empty_step: StepBatch | StepRows, decode_tokens: int) -> None:
        """Allocate ``mla``'s plan buffers (by planning ``empty_step``) and its decode backends'
        scratch for launches of up to ``decode_tokens`` tokens."""
        mla.reserve(mla.plan(empty_step), decode_tokens)
