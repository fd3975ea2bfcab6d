"""Measured backend choices: which backend is fastest, per GPU arch, phase, layer kind, heads,
KV format and token count, as measured by ``dsv4-attn bench``.

The table of an arch ships in ``dsv4_attn/data/choices/<arch>.json`` (what was measured on this
project's machines) and can be regenerated for any GPU with one command::

    dsv4-attn bench --mode all --backend triton flashmla --write-choices choices-sm90.json
    export DSV4_ATTN_CHOICES=$PWD/choices-sm90.json      # or copy it into dsv4_attn/data/choices/

Selection (``common.backend.select``) tries the measured order first for a step whose tokens fall
in a measured range, then the platform's priority list; every backend still has to accept the
layer (a measured choice never bypasses a refusal), and ``SparseMLA.explain()`` prints the
measurement that chose it. Heads are bucketed as the kernels pad them (<= 64, <= 128).

File format: ``{"arch": "sm90", "device": ..., "source": ..., "entries": [{"phase": "decode",
"kind": "C4A", "heads": 64, "format": "fp8_ds_mla", "tokens": [lo, hi], "order": ["triton",
"flashmla"], "evidence": "..."}]}`` -- ``tokens`` is a half-open range of the phase's tokens in one
launch (decode: requests x query tokens).
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .. import envs


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

    def matches(self, phase: str, kind: str, heads: int, fmt: str, num_tokens: int) -> bool:
        return (self.phase == phase and self.kind == kind and self.heads == heads_bucket(heads) and self.fmt == fmt
                and self.tokens[0] <= num_tokens < self.tokens[1])


def heads_bucket(heads: int) -> int:
    """Heads as the kernels schedule them: 64 up to 64 heads, else 128."""
    return 64 if heads <= 64 else 128


def _parse(doc: dict, where: str) -> tuple[str, tuple[Choice, ...]]:
    try:
        arch = str(doc["arch"])
        entries = tuple(Choice(str(e["phase"]), str(e["kind"]).upper(), int(e["heads"]), str(e["format"]),
                               (int(e["tokens"][0]), int(e["tokens"][1])), tuple(map(str, e["order"])),
                               str(e.get("evidence", ""))) for e in doc["entries"])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"{where}: got a file that is not a choices table ({type(exc).__name__}: {exc}); allowed: "
                         "the JSON that `dsv4-attn bench --write-choices` writes") from None
    return arch, entries


@functools.lru_cache(maxsize=16)
def _load(path: str) -> tuple[str, tuple[Choice, ...]]:
    with open(path) as f:
        return _parse(json.load(f), path)


def table_for(arch: str) -> tuple[tuple[Choice, ...], str]:
    """(entries, file) for ``arch``: the DSV4_ATTN_CHOICES file when it is for this arch, else the
    packaged table, else no entries."""
    user = envs.CHOICES.get()
    if user:
        if not os.path.isfile(user):
            raise ValueError(f"{envs.CHOICES.name}: got {user!r}; allowed: an existing choices JSON file")
        got_arch, entries = _load(user)
        if got_arch == arch:
            return entries, user
    packaged = Path(str(importlib.resources.files("dsv4_attn") / "data" / "choices" / f"{arch}.json"))
    if packaged.is_file():
        return _load(str(packaged))[1], f"dsv4_attn/data/choices/{arch}.json"
    return (), ""


def measured(arch: str, phase: str, kind: str, heads: int, fmt: str, num_tokens: int) -> tuple[Choice, str] | None:
    """The measured entry covering this launch and its file, or None."""
    entries, where = table_for(arch)
    for entry in entries:
        if entry.matches(phase, kind, heads, fmt, num_tokens):
            return entry, where
    return None


def _point(tokens: int, rows: list[dict]) -> tuple[int, list[str], str] | None:
    """(tokens, backends fastest first, evidence) from the bench rows measured at one token count
    (several when batch x s_q coincide: ordered by their summed time), None with < 2 backends."""
    named = [{n: b["us"] for n, b in r["backends"].items() if "us" in b and n != "auto"} for r in rows]
    common = set.intersection(*(set(t) for t in named))
    if len(common) < 2:
        return None
    total = sorted((sum(t[n] for t in named), n) for n in common)
    evidence = "; ".join(f"{r['case']}: " + ", ".join(f"{n} {t[n]:.1f} us" for _, n in total)
                         for r, t in zip(rows, named))
    return tokens, [n for _, n in total], evidence


def from_bench(report: dict, arch: str) -> dict:
    """A choices table from a ``dsv4-attn bench --json`` report: per (phase, kind, heads, format)
    the backends ordered by measured time at each token count, ranges split halfway between
    neighbouring measured counts (the first starts at 1, the last ends at 2**31). A row timed as
    ``auto`` is the dispatcher itself, not a backend to order: left out."""
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
        for (_, order, evidence), lo, hi in zip(points, cuts, cuts[1:]):
            entries.append({"phase": phase, "kind": kind, "heads": heads, "format": fmt, "tokens": [lo, hi],
                            "order": order, "evidence": evidence})
    return {"arch": arch, "device": report["meta"].get("device"), "source": "dsv4-attn bench --write-choices",
            "entries": entries}
