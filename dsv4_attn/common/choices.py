"""Measured backend choices: which backend is fastest, per GPU arch, phase, layer kind, heads,
KV format and token count, as measured by ``dsv4-attn bench``.

The tables ship per device, in ``dsv4_attn/data/choices/<arch>-<device>.json`` (what was measured
on this project's machines: ``packaged_name``); another part of a measured arch takes the nearest
device's table, and ``SparseMLA.explain()`` says so. A table can be regenerated for any GPU with
one command::

    dsv4-attn bench --mode all --backend triton flashmla --write-choices choices.json
    export DSV4_ATTN_CHOICES=$PWD/choices.json   # or copy it to the file name the bench prints

and re-timed in part (the shapes a run times replace theirs, the rest stay)::

    dsv4-attn bench --configs h64-swa h8-swa --backend triton flashmla --update-choices choices.json

Selection (``common.registry.select``) tries the measured order first for a step whose tokens fall
in a measured range, then the platform's priority list; every backend still has to accept the
layer (a measured choice never bypasses a refusal), and ``SparseMLA.explain()`` prints the
measurement that chose it. Heads are bucketed at 8, 16, 32, 64 and 128 (``heads_bucket``).

A backend also has work of its own once per step and layer shape (FlashMLA: its index rows and
tile scheduler; ``Backend.prepare``), paid once however many layers of that kind the step runs.
Where the table has both figures, the order is by ``n x us + per_step_us`` with ``n`` the model's
layers of the kind (``ModelSpec.layers``): at two decode tokens a kernel 1 us faster per layer can
lose a 43-layer step to its own ~20 us of per-step work, which a per-layer order alone cannot see
(a backend with more per-step work must win by ``MIX_MARGIN``).

File format: ``{"arch": "sm90", "device": "NVIDIA H100 80GB HBM3", "source": ..., "entries": [{"phase": "decode",
"kind": "C4A", "heads": 64, "format": "fp8_ds_mla", "tokens": [lo, hi], "order": ["triton",
"flashmla"], "us": {"triton": 17.7, "flashmla": 19.0}, "per_step_us": {"triton": 0.0, "flashmla":
21.3}, "evidence": "..."}]}`` -- ``tokens`` is a half-open range of the phase's tokens in one
launch (decode: requests x query tokens); ``us`` (one layer, the step's work done) and
``per_step_us`` (the backend's own per-step work beyond the shared index front end) are optional:
without them ``order`` (fastest layer first) is used as it stands.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import os
import re
from dataclasses import dataclass

from .. import envs

# A backend with per-step work of its own must beat one without by this much over a step's layers
# of the kind: one-layer timings carry ~3 % of in-step error both ways (H100, 2026-11-23: on a
# V4-Flash step at b=2 the sums said flashmla and triton tie on the C128A layers; the step ran 18 us
# (2.8 %) slower with flashmla mixed in; on V4-Pro at b=128 they said +2 % for flashmla, the step
# showed +2.6 %). Within the margin the backend with less per-step work keeps the layers.
MIX_MARGIN = 0.03


@dataclass(frozen=True)
class Choice:
    """One measured entry: for ``tokens[0] <= tokens < tokens[1]`` try ``order`` first."""

    phase: str
    kind: str
    heads: int
    fmt: str
    tokens: tuple[int, int]
    order: tuple[str, ...]
    evidence: str
    us: tuple[tuple[str, float], ...] = ()
    per_step_us: tuple[tuple[str, float], ...] = ()

    def ranked(self, layers_per_step: int) -> tuple[str, ...]:
        """The backends fastest first for a step running ``layers_per_step`` layers of this kind:
        by ``layers_per_step x us + per_step_us`` when the entry has both for every backend it
        orders (a backend with more per-step work than the lightest must win by MIX_MARGIN), else
        ``order``."""
        us, per_step = dict(self.us), dict(self.per_step_us)
        if not all(name in us and name in per_step for name in self.order):
            return self.order
        lightest = min(per_step[name] for name in self.order)

        def cost(name: str) -> float:
            total = layers_per_step * us[name] + per_step[name]
            return total * (1 + MIX_MARGIN) if per_step[name] > lightest + 1.0 else total

        return tuple(sorted(self.order, key=cost))

    def costs(self, layers_per_step: int) -> str:
        """``name n x us + per_step = total us`` per backend, for explain() and the dispatcher's why."""
        us, per_step = dict(self.us), dict(self.per_step_us)
        return ", ".join(f"{name} {layers_per_step} x {us[name]:.1f} + {per_step[name]:.1f} = "
                         f"{layers_per_step * us[name] + per_step[name]:.1f} us"
                         for name in self.ranked(layers_per_step) if name in us and name in per_step)

    def matches(self, phase: str, kind: str, heads: int, fmt: str, num_tokens: int) -> bool:
        return (self.phase == phase and self.kind == kind and self.heads == heads_bucket(heads) and self.fmt == fmt
                and self.tokens[0] <= num_tokens < self.tokens[1])


HEADS_BUCKETS = (8, 16, 32, 64, 128)


def heads_bucket(heads: int) -> int:
    """The head count a launch of ``heads`` heads is measured at: the smallest of HEADS_BUCKETS at or
    above it (128 above that). Tensor-parallel shards (8 / 16 / 32 heads per rank under -tp 8 / 4)
    have entries of their own rather than the 64-head ones: FlashMLA pads them to 64 heads while
    triton runs them on other kernels (the heads-on-N kernel up to 16 heads), so the fastest backend
    can differ. A table without a shard's bucket leaves its launches to the priority list, whose cuda
    decode order puts flashmla (padding to 64 heads) first: every packaged table measures the shard
    buckets of the decode layers it measures (tests/test_choices.py)."""
    return next((bucket for bucket in HEADS_BUCKETS if heads <= bucket), HEADS_BUCKETS[-1])


def _parse(doc: dict, where: str) -> tuple[str, tuple[Choice, ...]]:
    try:
        arch = str(doc["arch"])
        entries = tuple(Choice(str(e["phase"]), str(e["kind"]).upper(), int(e["heads"]), str(e["format"]),
                               (int(e["tokens"][0]), int(e["tokens"][1])), tuple(map(str, e["order"])),
                               str(e.get("evidence", "")), _costs(e.get("us", {})), _costs(e.get("per_step_us", {})))
                        for e in doc["entries"])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"{where}: got a file that is not a choices table ({type(exc).__name__}: {exc}); allowed: "
                         "the JSON that `dsv4-attn bench --write-choices` writes") from None
    return arch, entries


def _costs(by_name: dict) -> tuple[tuple[str, float], ...]:
    if not isinstance(by_name, dict):
        raise TypeError(f"a cost table must map backend names to microseconds, got {by_name!r}")
    return tuple((str(name), float(us)) for name, us in by_name.items())


@functools.lru_cache(maxsize=16)
def _load(path: str) -> tuple[str, tuple[Choice, ...]]:
    with open(path) as f:
        return _parse(json.load(f), path)


def device_slug(device: str) -> str:
    """The part of a GPU's name that tells its tables apart, as a file name: 'NVIDIA H100 80GB HBM3' ->
    'h100-80gb-hbm3', 'NVIDIA H200' -> 'h200'."""
    words = [w for w in re.split(r"[^a-z0-9]+", device.lower()) if w and w not in ("nvidia", "amd", "instinct")]
    return "-".join(words) or "unknown"


def packaged_name(arch: str, device: str) -> str:
    """Where a table measured on ``device`` ships: ``dsv4_attn/data/choices/<arch>-<device_slug>.json``."""
    return f"{arch}-{device_slug(device)}.json"


def _folder():
    """Where the packaged tables are."""
    return importlib.resources.files("dsv4_attn") / "data" / "choices"


@functools.lru_cache(maxsize=16)
def _packaged(arch: str) -> tuple[tuple[str, str], ...]:
    """(device, file) of every packaged table of ``arch``, in file-name order."""
    found = []
    for item in sorted(_folder().iterdir(), key=lambda f: f.name):
        if item.name.startswith(f"{arch}-") and item.name.endswith(".json"):
            with item.open() as f:
                found.append((str(json.load(f).get("device") or ""), str(item)))
    return tuple(found)


def _nearest(device: str, tables: tuple[tuple[str, str], ...]) -> tuple[str, str]:
    """The table of ``device`` itself, else the one whose device name shares the most words with
    it (an 'H100 PCIe' takes the 'H100 80GB HBM3' table), else the first."""
    mine = set(device_slug(device).split("-"))
    return max(tables, key=lambda t: (device_slug(t[0]) == device_slug(device),
                                      len(mine & set(device_slug(t[0]).split("-")))))


def table_for(arch: str, device: str = "") -> tuple[tuple[Choice, ...], str, str]:
    """(entries, file, note) for ``arch`` on ``device`` (``Platform.device_name``): the
    DSV4_ATTN_CHOICES file when it is for this arch, else the packaged table measured on this
    device, else the packaged table of the nearest device of the arch (``note`` says so), else no
    entries. The same arch on another part (an H200 beside an H100: 1.4x the memory bandwidth)
    can order backends differently, so each measured device ships its own table."""
    user = envs.CHOICES.get()
    if user:
        if not os.path.isfile(user):
            raise ValueError(f"{envs.CHOICES.name}: got {user!r}; allowed: an existing choices JSON file")
        try:
            got_arch, entries = _load(user)
        except (ValueError, OSError) as exc:  # not JSON (JSONDecodeError is a ValueError), not a table, unreadable
            raise ValueError(f"{envs.CHOICES.name}: got {user!r}, which is not a choices table ({exc}); allowed: "
                             "the JSON that `dsv4-attn bench --write-choices` writes") from None
        if got_arch == arch:
            return entries, user, ""
    tables = _packaged(arch)
    if not tables:
        return (), "", ""
    measured_on, path = _nearest(device, tables)
    where = f"dsv4_attn/data/choices/{os.path.basename(path)}"
    note = "" if device_slug(measured_on) == device_slug(device) else (
        f"no table measured on {device or 'this device'}; the nearest {arch} table is {measured_on}'s")
    return _load(path)[1], where, note


def measured(arch: str, phase: str, kind: str, heads: int, fmt: str, num_tokens: int,
             device: str = "") -> tuple[Choice, str] | None:
    """The measured entry covering this launch and its file (with the nearest-device note), or None."""
    entries, where, note = table_for(arch, device)
    for entry in entries:
        if entry.matches(phase, kind, heads, fmt, num_tokens):
            return entry, f"{where} ({note})" if note else where
    return None


def _point(tokens: int, rows: list[dict]) -> tuple[int, list[str], str, dict, dict] | None:
    """(tokens, backends fastest first, evidence, mean us per backend, mean per-step us per backend
    or {} when a row lacks it) from the bench rows measured at one token count (several when
    batch x s_q coincide: ordered by their summed time), None with < 2 backends."""
    named = [{n: b for n, b in r["backends"].items() if "us" in b and n != "auto"} for r in rows]
    common = set.intersection(*(set(t) for t in named))
    if len(common) < 2:
        return None
    total = sorted((sum(t[n]["us"] for t in named), n) for n in common)
    evidence = "; ".join(f"{r['case']}: " + ", ".join(f"{n} {t[n]['us']:.1f} us" for _, n in total)
                         for r, t in zip(rows, named))
    us = {n: round(s / len(rows), 2) for s, n in total}
    per_step = {}
    if all("per_step_us" in t[n] for t in named for n in common):
        per_step = {n: round(sum(t[n]["per_step_us"] for t in named) / len(rows), 2) for _, n in total}
    return tokens, [n for _, n in total], evidence, us, per_step


def from_bench(report: dict, arch: str) -> dict:
    """A choices table from a ``dsv4-attn bench --json`` report: per (phase, kind, heads, format)
    the backends ordered by measured time at each token count, ranges split halfway between
    neighbouring measured counts (the first starts at 1, the last ends at 2**31). A row timed as
    ``auto`` is the dispatcher itself, not a backend to order: left out. Rows with each backend's
    ``per_step_us`` (decode cases) give entries ``us`` and ``per_step_us`` (Choice.ranked)."""
    groups: dict[tuple, dict[int, list[dict]]] = {}
    for r in report["results"]:
        if "error" in r or not r.get("backends"):
            continue
        key = (r["phase"], str(r["kind"]).upper(), heads_bucket(int(r["heads"])), r["format"])
        groups.setdefault(key, {}).setdefault(int(r["tokens"]), []).append(r)
    entries = []
    for (phase, kind, heads, fmt), by_tokens in sorted(groups.items()):
        points = [p for p in (_point(tokens, rows) for tokens, rows in sorted(by_tokens.items())) if p]
        cuts = [1] + [(a[0] + b[0]) // 2 + 1 for a, b in zip(points, points[1:])] + [2**31]
        for (_, order, evidence, us, per_step), lo, hi in zip(points, cuts, cuts[1:]):
            entry = {"phase": phase, "kind": kind, "heads": heads, "format": fmt, "tokens": [lo, hi], "order": order}
            if per_step:
                entry.update(us=us, per_step_us=per_step)
            entries.append({**entry, "evidence": evidence})
    return {"arch": arch, "device": report["meta"].get("device"), "source": "dsv4-attn bench --write-choices",
            "entries": entries}


def read_table(path: str, what: str) -> dict:
    """The choices table at ``path`` as written (``what``: the option naming it, for messages).
    Raises ValueError where it cannot be read or is not a table."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what}: got {path!r}, which cannot be read as JSON ({exc}); allowed: the JSON that "
                         "`dsv4-attn bench --write-choices` writes") from None
    _parse(doc, what)
    return doc


def _entry_key(entry: dict) -> tuple:
    return entry["phase"], entry["kind"], entry["heads"], entry["format"]


def check_measured_on(table: dict, arch: str, device: str | None) -> None:
    """ValueError unless ``table`` was measured on ``arch`` and the GPU named ``device`` (a table's
    device is the name the bench measured on): what ``bench --update-choices`` merges into."""
    for field, value in (("arch", arch), ("device", device)):
        if table.get(field) != value:
            raise ValueError(f"--update-choices: got a table of {field} {table.get(field)!r} for a run on "
                             f"{value!r}; allowed: a table measured on the same {field}")


def merged(table: dict, new: dict) -> dict:
    """``table`` with ``new``'s measurements in place of its own: every entry of a (phase, kind,
    heads bucket, format) that ``new`` measures is replaced by ``new``'s entries for it, the rest
    kept (both ``from_bench`` tables of one arch and device). What ``bench --update-choices``
    writes: a run that re-times some shapes leaves the table's other measurements as they were."""
    check_measured_on(table, new["arch"], new.get("device"))
    covered = {_entry_key(e) for e in new["entries"]}
    entries = [e for e in table["entries"] if _entry_key(e) not in covered] + new["entries"]
    return {**table, "entries": sorted(entries, key=lambda e: (*_entry_key(e), e["tokens"][0]))}

