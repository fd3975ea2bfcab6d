"""The parity matrix: every backend against the float64 reference on named, seeded cases.

    dsv4-attn parity                                   # packaged default matrix, this machine
    dsv4-attn parity --backends all --cases 'core.c4a.*'
    dsv4-attn parity --full --out parity-h100          # + production-sized shapes (GPU machines)
    dsv4-attn parity --merge cpu/parity-cpu-cpu.json h100/parity-cuda-sm90.json

A matrix (YAML, ``dsv4_attn/data/parity.yaml``; format in docs/parity.md) expands into cases:
layer kind x heads x KV format x batch mix x length bucket (+ block sizes, fp8 dialects, page
strides, huge slot offsets). Each case's inputs are generated on the CPU from a seed derived
from the case name (random bf16 rows inserted into caches of the case's format through
``common.layout.insert``, permuted block tables, random q, sinks with +-inf on the edge cases,
C4A top-k rows with garbage past the valid prefix, garbage in every cache slot no row
references), so every machine sees the same bytes (the input digest proves it), then moved to
the device under test.

Per case and backend ("cell"): the output is poisoned with NaN, ``SparseMLA(backend=name)``
runs the layer, then (after the kernel, so that allocator reuse cannot fake a pass) the
float64 reference ``common.reference.sparse_mla`` runs on the same inputs. Reported: max abs
error, relative L2, cosine, all-finite, all-written, pass/fail against the matrix's
tolerances, the sha256 of the output bytes and the output itself (small cases) or a seeded
sample of it, which ``--merge`` uses to compare backends run on different machines. Cells
a backend cannot serve are skipped with its reasons. Decode-only backends (AITER) run the
decode tokens; the prefill tokens go to the backend the front end picks, recorded per phase.
"""

from __future__ import annotations

import argparse
import base64
import datetime as _dt
import fnmatch
import hashlib
import importlib.resources
import itertools
import json
import math
import os
import platform as _pyplatform
import sys
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml

from .common import backend as backend_mod
from .common import indices, layout, reference
from .common.backend import BackendUnavailableError, Phase
from .common.batch import StepBatch
from .common.layout import Fp8Dialect, KVFormat
from .common.platform import platform_for_device, probe
from .common.spec import HEAD_DIM, LayerKind, ModelSpec, cdiv

SCHEMA = "dsv4-attn-parity/1"
MERGE_SCHEMA = "dsv4-attn-parity-merge/1"
DEFAULT_OUT = "parity-out"
_FILLER_BLOCKS = 2  # physical blocks shared by every logical block no row references
_GARBAGE_PAGES = 3  # distinct garbage pages cycled through the pool blocks
_METRICS = ("max_abs", "rel_l2", "cosine")


def default_matrix_path() -> Path:
    """The packaged default matrix (works after ``pip install``; ci/parity.yaml is the same file)."""
    return Path(str(importlib.resources.files("dsv4_attn") / "data" / "parity.yaml"))


# =============================================================================================
# Matrix: YAML -> cases
# =============================================================================================
@dataclass(frozen=True)
class Tolerance:
    max_abs: float
    rel_l2: float
    cosine: float

    def verdict(self, metrics: dict) -> list[str]:
        """Every way ``metrics`` misses this tolerance ([] = within)."""
        misses = []
        if not metrics["max_abs"] <= self.max_abs:
            misses.append(f"max_abs {metrics['max_abs']:.3g} > {self.max_abs:g}")
        if not metrics["rel_l2"] <= self.rel_l2:
            misses.append(f"rel_l2 {metrics['rel_l2']:.3g} > {self.rel_l2:g}")
        if not metrics["cosine"] >= self.cosine:
            misses.append(f"cosine {metrics['cosine']:.6f} < {self.cosine:g}")
        return misses


@dataclass(frozen=True)
class Case:
    """One named, seeded case. Requests: ``query_lens`` / ``seq_lens`` (seq_lens include this
    step's tokens); the first ``decode_reqs`` requests are decode requests; ``padding`` extra
    tokens follow the real ones. ``heads`` is the model's head count, ``held_heads`` the q width
    (>= heads; extra heads are padding with sink -inf)."""

    name: str
    seed: int
    sweep: str
    kind: LayerKind
    heads: int
    held_heads: int
    fmt: KVFormat
    mix: str
    length: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    decode_reqs: int
    padding: int
    swa_block_size: int
    block_size: int
    c4a_topk: int
    max_model_len: int
    window: int
    sink: str
    kv_scale: float
    swa_dialect: Fp8Dialect
    comp_dialect: Fp8Dialect
    page_stride: int
    byte_offset: int

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(num_heads=self.heads, c4a_topk=self.c4a_topk, max_model_len=self.max_model_len,
                         window=self.window)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens) + self.padding

    @property
    def num_decode_tokens(self) -> int:
        return sum(self.query_lens[: self.decode_reqs])

    @property
    def phases(self) -> list[Phase]:
        """Phases with tokens in this case (padding tokens ride with the prefill range)."""
        out = [Phase.DECODE] if self.num_decode_tokens else []
        return out + ([Phase.PREFILL] if self.num_tokens > self.num_decode_tokens else [])

    def describe(self) -> dict:
        return {
            "name": self.name, "seed": self.seed, "sweep": self.sweep, "kind": self.kind.name.lower(),
            "heads": self.heads, "held_heads": self.held_heads, "format": self.fmt.value, "mix": self.mix,
            "length": self.length, "query_lens": list(self.query_lens), "seq_lens": list(self.seq_lens),
            "num_tokens": self.num_tokens, "num_decode_tokens": self.num_decode_tokens,
            "padding": self.padding, "swa_block_size": self.swa_block_size, "block_size": self.block_size,
            "c4a_topk": self.c4a_topk, "max_model_len": self.max_model_len, "window": self.window,
            "sink": self.sink, "kv_scale": self.kv_scale, "swa_dialect": self.swa_dialect.value,
            "comp_dialect": self.comp_dialect.value, "page_stride": self.page_stride,
            "byte_offset": self.byte_offset,
        }


@dataclass
class Matrix:
    """A loaded matrix: its cases (already filtered by --full), tolerances and defaults."""

    path: str
    sha256: str
    seed: int
    cases: list[Case]
    backends: dict[str, list[str] | str]
    tolerance_default: Tolerance
    tolerance_overrides: list[dict]
    output_full_max: int = 8192
    output_sample: int = 2048

    def tolerance(self, case: Case, backend: str) -> Tolerance:
        """Default tolerance with every matching override applied in order."""
        values = dict(self.tolerance_default.__dict__)
        facts = {"backend": backend, "format": case.fmt.value, "kind": case.kind.name.lower()}
        for entry in self.tolerance_overrides:
            if all(facts[k] == str(entry[k]).lower() for k in ("backend", "format", "kind") if k in entry):
                values.update({k: float(entry[k]) for k in _METRICS if k in entry})
        return Tolerance(**values)

    def select(self, patterns: str | None) -> list[Case]:
        """Cases whose name matches any comma-separated glob (a pattern without * ? [ matches as a
        substring). Raises ValueError when nothing matches."""
        if not patterns:
            return list(self.cases)
        pats = [p.strip() for p in patterns.split(",") if p.strip()]
        globs = [p if any(c in p for c in "*?[") else f"*{p}*" for p in pats]
        chosen = [c for c in self.cases if any(fnmatch.fnmatchcase(c.name, g) for g in globs)]
        if not chosen:
            raise ValueError(f"--cases: got {patterns!r}, which matches none of the {len(self.cases)} cases; "
                             "allowed: comma-separated globs over case names (see --list)")
        return chosen


_AXES = ("kind", "heads", "format", "mix", "length", "swa_block_size", "block_size", "swa_dialect",
         "comp_dialect", "page_stride", "byte_offset")
_EXTRA_TAGS = {"swa_block_size": "swabs{}", "block_size": "bs{}", "swa_dialect": "swa-{}",
               "comp_dialect": "comp-{}", "page_stride": "stride{}", "byte_offset": "off{}"}
_MODEL_KEYS = ("c4a_topk", "max_model_len", "window")


def _fail(where: str, got, allowed: str):
    raise ValueError(f"{where}: got {got!r}; allowed: {allowed}")


def _need(d, key: str, where: str, kind=None):
    if not isinstance(d, dict) or key not in d:
        _fail(where, d if not isinstance(d, dict) else sorted(d), f"a mapping with key {key!r}")
    value = d[key]
    if kind is not None and not isinstance(value, kind):
        _fail(f"{where}.{key}", value, f"a {kind.__name__ if isinstance(kind, type) else kind}")
    return value


def _int(value, where: str, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        _fail(where, value, f"an int >= {lo}")
    return value


def _model(base: dict, override, where: str) -> dict:
    """``base`` updated with a matrix's / sweep's ``model`` mapping (keys c4a_topk, max_model_len, window)."""
    if override is None:
        return dict(base)
    if not isinstance(override, dict) or set(override) - set(_MODEL_KEYS):
        _fail(where, override, f"a mapping with keys among {', '.join(_MODEL_KEYS)}")
    for key, value in override.items():
        _int(value, f"{where}.{key}", 1)
    return {**base, **override}


def _read_yaml(path: Path, hops: int = 0) -> tuple[Path, bytes, dict]:
    """Load a matrix file, following a one-line pointer file (a path to another YAML, relative to
    the pointer; what a git checkout without symlink support makes of ci/parity.yaml)."""
    raw = path.read_bytes()
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ValueError(f"--matrix: {path} is not valid YAML: {exc}") from None
    if isinstance(doc, str) and hops < 3 and doc.strip().endswith((".yaml", ".yml")):
        return _read_yaml((path.parent / doc.strip()).resolve(), hops + 1)
    if not isinstance(doc, dict):
        _fail(f"--matrix {path}", type(doc).__name__, "a YAML mapping (see docs/parity.md)")
    return path, raw, doc


def load_matrix(path: str | os.PathLike | None = None, full: bool = False) -> Matrix:
    """Parse and expand a matrix file (default: the packaged one). ``full`` keeps the sweeps marked
    ``full: true``. Raises ValueError naming the offending key."""
    src = Path(path) if path is not None else default_matrix_path()
    if not src.is_file():
        _fail("--matrix", str(src), "an existing YAML file")
    src, raw, doc = _read_yaml(src)
    if doc.get("version") != 1:
        _fail("version", doc.get("version"), "1")
    seed = _int(_need(doc, "seed", "matrix"), "seed")
    model = _model({"c4a_topk": 512, "max_model_len": 65536, "window": 128}, doc.get("model"), "model")
    defaults = {"swa_block_size": 64, "block_size": 256, "swa_dialect": "ocp", "comp_dialect": "ocp",
                "page_stride": 1, "byte_offset": 0, **(doc.get("defaults") or {})}
    tol = _need(doc, "tolerances", "matrix", dict)
    default_tol = Tolerance(**{k: float(_need(_need(tol, "default", "tolerances", dict), k, "tolerances.default"))
                               for k in _METRICS})
    overrides = tol.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, dict) for o in overrides):
        _fail("tolerances.overrides", overrides, "a list of mappings")
    lengths = _need(doc, "lengths", "matrix", dict)
    batches = _need(doc, "batches", "matrix", dict)
    sweeps = _need(doc, "sweeps", "matrix", list)
    cases: list[Case] = []
    for i, sweep in enumerate(sweeps):
        if not isinstance(sweep, dict):
            _fail(f"sweeps[{i}]", sweep, "a mapping")
        if sweep.get("full", False) and not full:
            continue
        cases.extend(_expand_sweep(sweep, i, seed, model, defaults, lengths, batches))
    names = [c.name for c in cases]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        _fail("sweeps", f"duplicate case names {dupes[:3]}", "unique names (give sweeps distinct names)")
    output = doc.get("output") or {}
    backends = doc.get("backends") or {"cpu": ["torch"], "gpu": "all"}
    return Matrix(str(src), hashlib.sha256(raw).hexdigest(), seed, cases, backends, default_tol, overrides,
                  _int(output.get("full_max", 8192), "output.full_max"),
                  _int(output.get("sample", 2048), "output.sample", 1))


def _expand_sweep(sweep: dict, index: int, seed: int, model: dict, defaults: dict, lengths: dict,
                  batches: dict) -> list[Case]:
    where = f"sweeps[{index}]"
    name = _need(sweep, "name", where, str)
    unknown = set(sweep) - set(_AXES) - {"name", "full", "model"}
    if unknown:
        _fail(f"{where} ({name})", sorted(unknown), f"keys among name, full, model, {', '.join(_AXES)}")
    for key in ("kind", "heads", "format", "mix", "length"):
        _need(sweep, key, f"{where} ({name})")
    sweep_model = _model(model, sweep.get("model"), f"{where} ({name}).model")
    axes = {k: sweep.get(k, defaults.get(k)) for k in _AXES}
    axes = {k: (v if isinstance(v, list) else [v]) for k, v in axes.items()}
    out = []
    for values in itertools.product(*(axes[k] for k in _AXES)):
        point = dict(zip(_AXES, values))
        tags = [_EXTRA_TAGS[k].format(point[k]) for k in _EXTRA_TAGS if k in sweep]
        kind = LayerKind.parse(point["kind"])
        fmt = KVFormat.parse(point["format"])
        case_name = ".".join([name, kind.name.lower(), f"h{point['heads']}", fmt.value, str(point["mix"]),
                              str(point["length"])] + tags)
        out.append(_make_case(case_name, seed, name, kind, fmt, point, sweep_model, lengths, batches))
    return out


def _make_case(name: str, seed: int, sweep: str, kind: LayerKind, fmt: KVFormat, point: dict, model: dict,
               lengths: dict, batches: dict) -> Case:
    mix, length = str(point["mix"]), str(point["length"])
    shape = batches.get(mix, {}).get(length) if isinstance(batches.get(mix), dict) else None
    if shape is None:
        _fail(f"case {name}", f"mix {mix!r} / length {length!r}", "a batches.<mix>.<length> entry")
    bucket = lengths.get(length)
    if not isinstance(bucket, dict):
        _fail(f"case {name}", f"length {length!r}", f"one of lengths: {sorted(lengths)} (a mapping)")
    q_lens, s_lens = _batch_lists(shape, f"batches.{mix}.{length}")
    heads = _int(point["heads"], f"case {name}: heads", 1)
    held = max(heads, _int(bucket.get("pad_heads", heads), f"lengths.{length}.pad_heads", 1))
    sink = bucket.get("sink", "random")
    if sink not in ("random", "inf", "none"):
        _fail(f"lengths.{length}.sink", sink, "random, inf or none")
    kv_scale = float(bucket.get("kv_scale", 1.0)) if fmt is KVFormat.FP8_TENSOR else 1.0
    decode = _int(shape.get("decode", 0), f"batches.{mix}.{length}.decode")
    if decode > len(q_lens) or any(q < 1 for q in q_lens[:decode]):
        _fail(f"batches.{mix}.{length}.decode", decode, "<= number of requests, each decode request with >= 1 token")
    case_seed = zlib.crc32(f"{seed}/{name}".encode()) & 0x7FFFFFFF
    return Case(
        name=name, seed=case_seed, sweep=sweep, kind=kind, heads=heads, held_heads=held, fmt=fmt, mix=mix,
        length=length, query_lens=tuple(q_lens), seq_lens=tuple(s_lens), decode_reqs=decode,
        padding=_int(shape.get("padding", 0), f"batches.{mix}.{length}.padding"),
        swa_block_size=_int(point["swa_block_size"], f"case {name}: swa_block_size", 1),
        block_size=_int(point["block_size"], f"case {name}: block_size", 1),
        c4a_topk=model["c4a_topk"], max_model_len=model["max_model_len"], window=model["window"], sink=sink,
        kv_scale=kv_scale, swa_dialect=Fp8Dialect.parse(point["swa_dialect"]),
        comp_dialect=Fp8Dialect.parse(point["comp_dialect"]),
        page_stride=_int(point["page_stride"], f"case {name}: page_stride", 1),
        byte_offset=_int(point["byte_offset"], f"case {name}: byte_offset"),
    )


def _batch_lists(shape: dict, where: str) -> tuple[list[int], list[int]]:
    """query_lens / seq_lens of a batches entry; scalars broadcast to ``reqs`` requests and
    ``seq_lens: {linspace: [lo, hi]}`` spreads them evenly."""
    if not isinstance(shape, dict):
        _fail(where, shape, "a mapping with query_lens and seq_lens")
    q, s = _need(shape, "query_lens", where), _need(shape, "seq_lens", where)
    n = shape.get("reqs", len(q) if isinstance(q, list) else len(s) if isinstance(s, list) else None)
    n = _int(n, f"{where}.reqs", 1)
    if isinstance(s, dict):
        lo, hi = _need(s, "linspace", f"{where}.seq_lens")
        s = [round(lo + (hi - lo) * i / max(n - 1, 1)) for i in range(n)]
    q = q if isinstance(q, list) else [q] * n
    s = s if isinstance(s, list) else [s] * n
    if len(q) != n or len(s) != n:
        _fail(where, f"{len(q)} query_lens, {len(s)} seq_lens", f"{n} of each (reqs)")
    for i, (ql, sl) in enumerate(zip(q, s)):
        _int(ql, f"{where}.query_lens[{i}]")
        if _int(sl, f"{where}.seq_lens[{i}]") < ql:
            _fail(f"{where}.seq_lens[{i}]", sl, f">= query_lens[{i}] = {ql} (seq_lens include this step)")
    return q, s


# =============================================================================================
# Inputs: generated on the CPU, identical on every machine
# =============================================================================================
@dataclass
class CaseInputs:
    """One case's tensors (all on one device).

    batch      StepBatch of the case
    q          bf16 [T, held_heads, 512] (padded heads 0)
    swa_cache  cache of the case's format (SWA dialect); comp_cache: the kind's compressed cache or None
    c4a_topk   int32 [T, c4a_topk] local top-k (C4A only): a valid prefix of distinct visible
               entries, garbage (-1, stale or huge values) after it
    sink       float32 [held_heads] (padded heads -inf) or None
    digest     sha256 of every input byte (computed on the CPU copy)
    """

    case: Case
    batch: StepBatch
    q: torch.Tensor
    swa_cache: torch.Tensor
    comp_cache: torch.Tensor | None
    c4a_topk: torch.Tensor | None
    sink: torch.Tensor | None
    digest: str = ""

    def to(self, device: torch.device) -> "CaseInputs":
        if torch.device(device) == self.q.device:
            return self
        b = self.batch
        batch = StepBatch(b.query_start_loc.to(device), b.seq_lens.to(device), b.num_decode_tokens,
                          b.swa_block_table.to(device), b.swa_block_size,
                          {r: t.to(device) for r, t in b.comp_block_tables.items()}, b.block_size,
                          b.max_model_len, b.num_tokens)

        def move(t):
            return None if t is None else t.to(device)

        return replace(self, batch=batch, q=self.q.to(device), swa_cache=_cache_to(self.swa_cache, device),
                       comp_cache=None if self.comp_cache is None else _cache_to(self.comp_cache, device),
                       c4a_topk=move(self.c4a_topk), sink=move(self.sink))


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """uint8 view of a tensor's whole storage (caches are as_strided views with page gaps)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _cache_to(cache: torch.Tensor, device) -> torch.Tensor:
    """Copy a cache to ``device`` keeping its strides (``.to`` would compact the page gaps)."""
    flat = torch.empty(cache.untyped_storage().nbytes(), dtype=torch.uint8, device=device)
    flat.copy_(_flat_bytes(cache))
    return flat.view(cache.dtype).as_strided(cache.shape, cache.stride(), cache.storage_offset())


def make_inputs(case: Case) -> CaseInputs:
    """Generate a case's inputs on the CPU from its seed (deterministic)."""
    gen = torch.Generator().manual_seed(case.seed)
    spec, T, R = case.spec, case.num_tokens, len(case.query_lens)
    req, pos = _token_positions(case)
    q = torch.randn(T, case.held_heads, HEAD_DIM, generator=gen).bfloat16()
    q[:, case.heads:] = 0  # padded heads are zero-filled, as vLLM does
    sink = _sinks(case, gen)
    topk = _local_topk(case, req, pos, gen) if case.kind is LayerKind.C4A else None
    swa_req, swa_pos = _window_refs(case, req, pos)
    swa_table, swa_cache = _scope_cache(case, gen, swa_req, swa_pos, _cols(case.seq_lens, 1, case.swa_block_size),
                                        case.swa_block_size, case.swa_dialect)
    comp_tables, comp_cache = {}, None
    if case.kind.has_comp_scope:
        if case.block_size % case.kind.ratio:
            _fail(f"case {case.name}: block_size", case.block_size, f"a multiple of {case.kind.ratio}")
        bs_c = case.block_size // case.kind.ratio
        c_req, c_pos = _comp_refs(case, spec, req, pos, topk)
        table, comp_cache = _scope_cache(case, gen, c_req, c_pos, _cols(case.seq_lens, case.kind.ratio, bs_c), bs_c,
                                         case.comp_dialect)
        comp_tables[case.kind.ratio] = table
    qsl = torch.zeros(R + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(case.query_lens, dtype=torch.int32).cumsum(0)
    batch = StepBatch(qsl, torch.tensor(case.seq_lens, dtype=torch.int32), case.num_decode_tokens, swa_table,
                      case.swa_block_size, comp_tables, case.block_size, case.max_model_len, T)
    batch.validate()
    inputs = CaseInputs(case, batch, q, swa_cache, comp_cache, topk, sink)
    inputs.digest = _input_digest(inputs)
    return inputs


def _token_positions(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, position) int64 [real tokens] of every real token."""
    req, pos = [], []
    for r, (ql, sl) in enumerate(zip(case.query_lens, case.seq_lens)):
        req += [r] * ql
        pos += range(sl - ql, sl)
    return torch.tensor(req, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64)


def _sinks(case: Case, gen: torch.Generator) -> torch.Tensor | None:
    if case.sink == "none":
        return None
    sink = torch.randn(case.held_heads, generator=gen)
    if case.sink == "inf":
        sink[0] = -math.inf
        if case.heads > 1:
            sink[1] = math.inf
    sink[case.heads:] = -math.inf  # padded heads
    return sink


def _local_topk(case: Case, req: torch.Tensor, pos: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """int32 [T, K]: per real token a prefix of min((pos+1)//4, K) distinct visible entries in
    random order; every other lane garbage: -1, small values that look valid (stale lanes) or
    values far past what is visible."""
    K, T = case.c4a_topk, case.num_tokens
    topk = torch.randint(0, 1 << 20, (T, K), generator=gen, dtype=torch.int64)
    pick = torch.rand(T, K, generator=gen)
    topk = torch.where(pick < 0.3, torch.full_like(topk, -1), topk)
    topk = torch.where(pick > 0.7, topk % 64, topk)
    for t, p in enumerate(pos.tolist()):
        n = (p + 1) // LayerKind.C4A.ratio
        if n:
            topk[t, : min(n, K)] = torch.randperm(n, generator=gen)[:K]
    return topk.to(torch.int32)


def _window_refs(case: Case, req: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, position) of every SWA key a real token reads."""
    W = case.window
    offs = torch.arange(W)
    keys = pos[:, None] - offs[None, :]
    keep = keys >= 0
    return req[:, None].expand_as(keys)[keep], keys[keep]


def _comp_refs(case: Case, spec: ModelSpec, req: torch.Tensor, pos: torch.Tensor,
               topk: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, compressed entry) of every compressed key a real token reads."""
    visible = (pos + 1) // case.kind.ratio
    if case.kind is LayerKind.C4A:
        local = topk[: pos.shape[0]].long()
        lens = visible.clamp(max=local.shape[1])
    else:
        width = spec.c128a_width
        local = torch.arange(width)[None, :].expand(pos.shape[0], width)
        lens = visible.clamp(max=width)
    keep = torch.arange(local.shape[1])[None, :] < lens[:, None]
    return req[:, None].expand_as(local)[keep], local[keep]


def _cols(seq_lens, ratio: int, block_size: int) -> list[int]:
    """Block-table columns each request needs: cdiv(seq_len // ratio, block_size)."""
    return [cdiv(s // ratio, block_size) for s in seq_lens]


def _scope_cache(case: Case, gen: torch.Generator, req: torch.Tensor, logical: torch.Tensor, cols: list[int],
                 block_size: int, dialect: Fp8Dialect) -> tuple[torch.Tensor, torch.Tensor]:
    """Block table int32 [R, max(cols)] and cache of one scope whose rows ``(req, logical)`` are read.

    Only what is read gets its own physical block: every (request, logical block) some row reads
    maps to a distinct block (a seeded permutation of the pool), every other column to one of a
    few shared filler blocks, so long sequences need few blocks. Pool blocks hold garbage pages
    (no correct backend reads them); each slot that is read holds a fresh random row. With
    ``byte_offset`` the pool starts at the first block past that byte offset (the blocks before
    it stay zero), so slot byte offsets pass 2**31.
    """
    one = layout.new_cache(case.fmt, 1, block_size, dialect=dialect)
    stride = one.stride(0) * case.page_stride  # elements
    offset = cdiv(case.byte_offset, stride * one.element_size())
    width = max(max(cols, default=0), 1)
    block = torch.div(logical, block_size, rounding_mode="floor")
    touched = torch.unique(req * width + block)
    n = touched.numel()
    pool = n + _FILLER_BLOCKS
    perm = torch.randperm(pool, generator=gen) + offset
    table = perm[n + torch.randint(_FILLER_BLOCKS, (len(cols), width), generator=gen)]
    table[touched // width, touched % width] = perm[:n]
    slots = torch.unique(table[req, block] * block_size + logical % block_size)
    cache = layout.new_cache(case.fmt, offset + pool, block_size, block_stride=stride, dialect=dialect)
    garbage = _garbage_pages(case, gen, block_size, stride, dialect)
    _flat_bytes(cache).view(offset + pool, -1)[offset:] = garbage[torch.arange(pool) % garbage.shape[0]]
    scale = case.kv_scale if case.fmt is KVFormat.FP8_TENSOR else None
    layout.insert(cache, case.fmt, slots, _random_rows(gen, slots.numel()), scale=scale, dialect=dialect)
    return table.to(torch.int32), cache


def _garbage_pages(case: Case, gen: torch.Generator, block_size: int, stride: int,
                   dialect: Fp8Dialect) -> torch.Tensor:
    """uint8 [_GARBAGE_PAGES, block bytes]: pages of valid random rows; the bytes past the page
    (other layers' pages when page_stride > 1) are random bytes."""
    n = _GARBAGE_PAGES
    pages = layout.new_cache(case.fmt, n, block_size, block_stride=stride, dialect=dialect)
    flat = _flat_bytes(pages).view(n, -1)
    flat.copy_(torch.randint(0, 256, flat.shape, generator=gen, dtype=torch.uint8))
    scale = case.kv_scale if case.fmt is KVFormat.FP8_TENSOR else None
    layout.insert(pages, case.fmt, torch.arange(n * block_size), _random_rows(gen, n * block_size),
                  scale=scale, dialect=dialect)
    return flat.clone()


def _random_rows(gen: torch.Generator, n: int) -> torch.Tensor:
    """bf16 [n, 512]: N(0, 1) rows times a per-row factor in [0.5, 2] (varied fp8 tile scales)."""
    factor = torch.exp2(torch.rand(n, 1, generator=gen) * 2 - 1)
    return (torch.randn(n, HEAD_DIM, generator=gen) * factor).bfloat16()


def _input_digest(inputs: CaseInputs) -> str:
    h = hashlib.sha256(f"{inputs.case.name}/{inputs.case.seed}".encode())
    b = inputs.batch
    tensors = [b.query_start_loc, b.seq_lens, b.swa_block_table, *[b.comp_block_tables[r] for r in
                                                                   sorted(b.comp_block_tables)],
               inputs.q, inputs.c4a_topk, inputs.sink]
    for t in tensors:
        if t is not None:
            h.update(_tensor_bytes(t))
    for cache in (inputs.swa_cache, inputs.comp_cache):
        if cache is not None:
            h.update(_flat_bytes(cache).numpy())
    return h.hexdigest()


def _tensor_bytes(t: torch.Tensor):
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


# =============================================================================================
# Running: one cell = one case on one backend
# =============================================================================================
class _Reference:
    """The float64 reference of one case, computed on first use: AFTER the first backend ran (the
    FlashMLA habit: a reference allocated after the kernel cannot be a freed buffer the kernel's
    output reuses), on the inputs' device, returned on the CPU."""

    def __init__(self, inputs: CaseInputs) -> None:
        self.inputs = inputs
        self._out: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self._out is None:
            self._out = _reference_out(self.inputs).cpu()
        return self._out


def _reference_out(inputs: CaseInputs) -> torch.Tensor:
    """float64 [T, held_heads, 512] from index rows built by common.indices on the inputs' batch."""
    case, batch = inputs.case, inputs.batch
    spec = case.spec
    swa_rows, swa_lens = indices.swa_rows(batch, spec.window)
    comp_rows = comp_lens = None
    if case.kind is LayerKind.C4A:
        comp_rows, comp_lens = indices.c4a_rows(batch, inputs.c4a_topk)
    elif case.kind is LayerKind.C128A:
        comp_rows, comp_lens = indices.c128a_rows(batch, spec.c128a_width)
    out, _ = reference.sparse_mla(inputs.q, inputs.swa_cache, swa_rows, swa_lens, inputs.comp_cache, comp_rows,
                                  comp_lens, inputs.sink, spec.scale, case.fmt, torch.float64,
                                  case.kv_scale if case.fmt is KVFormat.FP8_TENSOR else None,
                                  case.swa_dialect, case.comp_dialect)
    return out


def _skip(reasons: list[str], emulated: bool = False, ran: dict | None = None) -> dict:
    return {"status": "skip", "reasons": reasons, "emulated": emulated, "ran": ran or {}}


def _skip_reasons(name: str, case: Case, device: torch.device) -> list[str]:
    """Why backend ``name`` cannot serve this case ([] = it can serve at least one of its phases,
    and every phase it implements)."""
    backend = backend_mod.get_backend(name)
    plat = platform_for_device(device)
    if backend is None:
        return backend_mod.reasons_for(name, plat, case.spec, case.fmt, case.kind, Phase.DECODE)
    own = [p for p in case.phases if p in backend.phases]
    if not own:
        return [f"implements {'/'.join(p.value for p in backend.phases)} only; this case has "
                f"{'/'.join(p.value for p in case.phases)} tokens only"]
    reasons = []
    for phase in own:
        reasons += [f"{phase.value}: {r}" for r in
                    backend_mod.reasons_for(name, plat, case.spec, case.fmt, case.kind, phase)]
    return reasons


def run_cell(name: str, inputs: CaseInputs, ref: _Reference, tolerance: Tolerance, emulated: bool,
             output_full_max: int = 8192, output_sample: int = 2048) -> dict:
    """Run backend ``name`` on one case's (device) inputs; the cell's figures as a JSON-able dict."""
    case = inputs.case
    device = inputs.q.device
    reasons = _skip_reasons(name, case, device)
    if reasons:
        return _skip(reasons, emulated)
    ran: dict[str, str] = {}
    out = torch.full(inputs.q.shape, math.nan, dtype=torch.bfloat16, device=device)
    try:
        mla = _sparse_mla(name, case, device)
        ran = {p.value: mla.backend_for(case.kind, p) for p in case.phases}
        _forward(mla, inputs, out)
    except BackendUnavailableError as exc:
        return _skip([str(exc)], emulated)
    except Exception as exc:  # a crash is a finding about this cell, not the end of the run
        return {"status": "error", "reasons": [f"{type(exc).__name__}: {exc}"], "emulated": emulated, "ran": ran,
                "tolerance": tolerance.__dict__}
    out = out.cpu()
    never = _never_written(mla, inputs, out)
    cell = _judge(out, ref.get(), case, never)
    cell.update(emulated=emulated, ran=ran, tolerance=tolerance.__dict__,
                output=_output_record(out[:, : case.heads], case.seed, output_full_max, output_sample))
    cell["status"], cell["reasons"] = _status(cell, tolerance)
    return cell


def _sparse_mla(name: str, case: Case, device: torch.device):
    from .api import SparseMLA  # api imports the registry; keep `import dsv4_attn.parity` light

    return SparseMLA(case.spec, case.fmt, backend=name, device=device, max_tokens=max(case.num_tokens, 1),
                     max_reqs=max(len(case.query_lens), 1), swa_dialect=case.swa_dialect,
                     comp_dialect=case.comp_dialect)


def _forward(mla, inputs: CaseInputs, out: torch.Tensor) -> None:
    case = inputs.case
    plan = mla.plan(inputs.batch, validate=True)
    mla.forward(plan, case.kind, inputs.q, inputs.swa_cache, inputs.comp_cache, c4a_topk=inputs.c4a_topk,
                sink=inputs.sink, out=out, kv_scale=case.kv_scale, validate=True)
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)


def _never_written(mla, inputs: CaseInputs, out: torch.Tensor) -> torch.Tensor:
    """bool [T, H, 512] on the CPU: elements the layer never writes. NaN left by the NaN-poisoned
    run is either never written or NaN the kernel wrote; a second run over a finite poison tells
    them apart (an element never written keeps the poison)."""
    nan = torch.isnan(out)
    if not bool(nan.any()):
        return nan
    poison = -12345.0  # exact in bf16; no attention output reaches it (outputs are key averages)
    again = torch.full(inputs.q.shape, poison, dtype=torch.bfloat16, device=inputs.q.device)
    try:
        _forward(mla, inputs, again)
    except Exception:  # the second run failing leaves the first run's NaN as the answer
        return nan
    return (again == poison).cpu()


def _judge(out: torch.Tensor, ref: torch.Tensor, case: Case, never: torch.Tensor) -> dict:
    """Figures of one output (CPU). Errors: over the model's heads (padded heads only count for
    ``written``), over the elements that were written and are finite; ``nonfinite`` counts
    non-finite elements the layer wrote, ``unwritten`` the elements it never wrote."""
    heads = case.heads
    region, want = out[:, :heads].double(), ref[:, :heads].double()
    finite = torch.isfinite(region)
    nonfinite = int((~finite & ~never[:, :heads]).sum())
    ok = bool(finite.all())
    a, b = (region.reshape(-1), want.reshape(-1)) if ok else (region[finite], want[finite])
    diff = a - b
    ref_norm, out_norm = float(b.norm()), float(a.norm())
    rel = float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm())
    if ref_norm > 0 and out_norm > 0:
        cosine = float(a @ b) / (ref_norm * out_norm)
    else:
        cosine = 1.0 if ref_norm == out_norm == 0 else 0.0
    unwritten = int(never.sum())
    return {"max_abs": float(diff.abs().max()) if diff.numel() else 0.0, "rel_l2": rel, "cosine": cosine,
            "ref_norm": ref_norm, "finite": nonfinite == 0, "nonfinite": nonfinite,
            "written": unwritten == 0, "unwritten": unwritten,
            "out_sha256": hashlib.sha256(_tensor_bytes(out[:, :heads])).hexdigest()}


def _status(cell: dict, tolerance: Tolerance) -> tuple[str, list[str]]:
    misses = []
    if not cell["written"]:
        misses.append(f"{cell['unwritten']} output elements never written (poison left)")
    if not cell["finite"]:
        misses.append(f"{cell['nonfinite']} non-finite output elements")
    misses += tolerance.verdict(cell)
    return ("fail" if misses else "pass"), misses


def _sample_index(seed: int, numel: int, count: int) -> torch.Tensor:
    """Sorted distinct element positions of an output sample (same on every machine)."""
    gen = torch.Generator().manual_seed(seed ^ 0x5EED)
    return torch.unique(torch.randint(numel, (count,), generator=gen, dtype=torch.int64))


def _output_record(out: torch.Tensor, seed: int, full_max: int, sample: int) -> dict:
    """The output (bf16 bytes, base64) when small, else a seeded sample of its elements."""
    flat = out.contiguous().reshape(-1)
    full = flat.numel() <= full_max
    values = flat if full else flat[_sample_index(seed, flat.numel(), sample)]
    return {"shape": list(out.shape), "sampled": not full, "count": values.numel(),
            "bf16_b64": base64.b64encode(_tensor_bytes(values).tobytes()).decode()}


def _decode_values(record: dict) -> torch.Tensor:
    raw = bytearray(base64.b64decode(record["bf16_b64"]))
    return torch.frombuffer(raw, dtype=torch.bfloat16).double() if raw else torch.zeros(0, dtype=torch.float64)


# =============================================================================================
# Running the matrix
# =============================================================================================
class _Progress:
    """A progress bar on stderr: tqdm when installed, else a plain bar (redrawn in place on a
    terminal, one line per 10% in logs)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled and total > 0
        self.tty = sys.stderr.isatty()
        self._last_tenth = -1
        self._t0 = time.monotonic()
        self._bar = None
        if self.enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="case", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(label[-40:], refresh=False)
            self._bar.update(1)
            return
        tenth = self.done * 10 // self.total
        if not self.tty and tenth == self._last_tenth and self.done != self.total:
            return
        self._last_tenth = tenth
        width = 30
        fill = width * self.done // self.total
        line = (f"[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                f"{time.monotonic() - self._t0:5.0f}s {label[-50:]}")
        sys.stderr.write(f"\r{line:<110}" if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.tty:
            sys.stderr.write("\n")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_backends(matrix: Matrix, device: torch.device) -> list[str]:
    """The matrix's backend list for this device kind (``all`` = every registered backend)."""
    key = "cpu" if device.type == "cpu" else "gpu"
    names = matrix.backends.get(key, "all") if isinstance(matrix.backends, dict) else matrix.backends
    return resolve_backends(names)


def resolve_backends(names) -> list[str]:
    """Backend names from a list / comma-separated string; ``all`` = every registered backend.
    Raises ValueError for a name the registry does not know."""
    if isinstance(names, str):
        names = [names]
    flat = [n.strip() for item in names for n in str(item).split(",") if n.strip()]
    known = backend_mod.backend_names()
    out: list[str] = []
    for n in flat:
        for name in (known if n == "all" else [n]):
            if name not in known:
                raise ValueError(f"--backends: got {name!r}; allowed: 'all' or any of {known}")
            if name not in out:
                out.append(name)
    return out


def emulated_backends(backends: list[str]) -> set[str]:
    """Backends whose results come from an emulator (labelled in the table and the JSON): AITER
    when its emulator is on (``--emulate-aiter``, ``dsv4_attn.rocm.emulate.enable()`` or
    ``DSV4_ATTN_AITER_EMULATOR``), and any backend instance that declares ``emulated = True``."""
    names = {n for n in backends if getattr(backend_mod.get_backend(n), "emulated", False)}
    if "aiter" in backends:
        try:
            from .rocm.aiter import load_aiter  # vendor-free: never imports aiter off ROCm

            if load_aiter().emulated:
                names.add("aiter")
        except Exception:  # no aiter module in this build: its cells are skipped with the reason
            pass
    return names


def backend_labels(backends: list[str]) -> dict[str, str]:
    """A backend's own description for result files (``label()`` when it has one, e.g. AITER's
    "aiter [EMULATED gfx950, AITER ...]"), else its name."""
    out = {}
    for name in backends:
        label = getattr(backend_mod.get_backend(name), "label", None)
        try:
            out[name] = str(label()) if callable(label) else name
        except Exception as exc:
            out[name] = f"{name} (label() raised {type(exc).__name__})"
    return out


def run(matrix: Matrix, backends: list[str], device: torch.device | str | None = None,
        cases: list[Case] | None = None, progress: bool = True, emulated: set[str] | None = None) -> dict:
    """Run every case on every backend; the full report (see docs/parity.md for its schema)."""
    device = torch.device(device) if device is not None else default_device()
    cases = matrix.cases if cases is None else cases
    emulated = emulated_backends(backends) if emulated is None else emulated
    t0 = time.monotonic()
    bar = _Progress(len(cases), progress)
    records = []
    try:
        for case in cases:
            cpu = make_inputs(case)
            dev = cpu.to(device)
            ref = _Reference(dev)
            cells = {}
            for name in backends:
                cells[name] = run_cell(name, dev, ref, matrix.tolerance(case, name), name in emulated,
                                       matrix.output_full_max, matrix.output_sample)
            records.append({**case.describe(), "input_sha256": cpu.digest, "cells": cells})
            bar.step(case.name)
    finally:
        bar.close()
    return {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": round(time.monotonic() - t0, 1),
        "matrix": {"path": matrix.path, "sha256": matrix.sha256, "seed": matrix.seed,
                   "cases_in_matrix": len(matrix.cases), "cases_run": len(cases)},
        "device": str(device),
        "machine": _machine_label(device),
        "backends": backends,
        "emulated": sorted(emulated & set(backends)),
        "backend_labels": backend_labels(backends),
        "platform": platform_for_device(device).as_dict(),
        "environment": environment(),
        "summary": _summary(records, backends),
        "cases": records,
    }


def environment() -> dict:
    """Versions and host facts recorded in every report."""
    from . import __version__

    versions = {"dsv4_attn": __version__, "python": sys.version.split()[0], "torch": torch.__version__,
                "torch_cuda": torch.version.cuda, "torch_hip": getattr(torch.version, "hip", None),
                "numpy": _dist_version("numpy"), "pyyaml": _dist_version("pyyaml")}
    for key, info in probe().libraries.items():
        versions[key] = info.version if info.found else None
    return {"versions": versions, "os": _pyplatform.platform(), "cpu": _pyplatform.processor() or
            _pyplatform.machine(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def _dist_version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _machine_label(device: torch.device) -> str:
    """The device's arch (cpu, sm90, gfx950, ...): merged columns are named backend@label."""
    return platform_for_device(device).arch


def _summary(records: list[dict], backends: list[str]) -> dict:
    out = {}
    for name in backends:
        counts = {"pass": 0, "fail": 0, "error": 0, "skip": 0}
        for rec in records:
            counts[rec["cells"][name]["status"]] += 1
        out[name] = counts
    return out


def failed(report: dict) -> bool:
    return any(c["fail"] or c["error"] for c in report["summary"].values())


# =============================================================================================
# Markdown
# =============================================================================================
def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.1e}"


def _column(name: str, emulated: bool) -> str:
    return f"{name} (emulated)" if emulated else name


class _Notes:
    """Numbered footnotes, one per distinct text."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def ref(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"


def _cell_text(cell: dict, notes: _Notes, name: str) -> str:
    status = cell["status"]
    if status == "skip":
        return "skip " + notes.ref(f"`{name}` skipped: " + " / ".join(cell["reasons"]))
    if status == "error":
        return "**ERROR** " + notes.ref(f"`{name}` raised: {cell['reasons'][0]}")
    text = f"pass {_fmt(cell['rel_l2'])}" if status == "pass" else (
        f"**FAIL** {_fmt(cell['rel_l2'])} " + notes.ref("; ".join(cell["reasons"])))
    others = {p: b for p, b in cell.get("ran", {}).items() if b != name}
    if others:
        text += " (" + ", ".join(f"{p} on {b}" for p, b in others.items()) + ")"
    return text


def render_report(report: dict) -> str:
    """The run as Markdown: header, one row per case (cell = status and relative L2 error),
    per-backend summary, footnotes with skip reasons and failure details."""
    plat, env = report["platform"], report["environment"]["versions"]
    backends, emulated = report["backends"], set(report["emulated"])
    notes = _Notes()
    lines = [
        f"# dsv4-attn parity: {plat['vendor']}/{plat['arch']} ({plat['device_name']}), device {report['device']}",
        "",
        f"dsv4_attn {env['dsv4_attn']}, torch {env['torch']}, triton {env.get('triton')}, python {env['python']}; "
        f"matrix `{report['matrix']['path']}` (sha256 {report['matrix']['sha256'][:12]}), "
        f"{report['matrix']['cases_run']} of {report['matrix']['cases_in_matrix']} cases, {report['elapsed_s']} s.",
        "Cell: verdict and relative L2 error against the float64 reference; `phase on X` = that phase ran on "
        "backend X (the column's backend does not implement it).",
        "",
        "| case | " + " | ".join(_column(b, b in emulated) for b in backends) + " |",
        "|---|" + "---|" * len(backends),
    ]
    for rec in report["cases"]:
        lines.append(f"| {rec['name']} | " + " | ".join(_cell_text(rec["cells"][b], notes, b) for b in backends)
                     + " |")
    lines += ["", "| backend | pass | fail | error | skip |", "|---|---|---|---|---|"]
    for b in backends:
        s = report["summary"][b]
        lines.append(f"| {_column(b, b in emulated)} | {s['pass']} | {s['fail']} | {s['error']} | {s['skip']} |")
    if notes.texts:
        lines += [""] + [f"[{i + 1}] {t}" for i, t in enumerate(notes.texts)]
    return "\n".join(lines) + "\n"


# =============================================================================================
# Merge: the cross-vendor table from runs on different machines
# =============================================================================================
def load_report(path: str | os.PathLike) -> dict:
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--merge: cannot read {path}: {exc}") from None
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise ValueError(f"--merge: {path} has schema {report.get('schema') if isinstance(report, dict) else None!r}; "
                         f"allowed: {SCHEMA!r} (a JSON written by `dsv4-attn parity`)")
    return report


def merge_reports(reports: list[dict], names: list[str]) -> dict:
    """Combine runs: one column per (backend, machine). Per case: every column's figures, whether
    the inputs were identical everywhere, and the largest difference between any two columns'
    outputs (over the stored outputs or their common seeded sample). Pairwise summary: per pair
    of columns the largest difference over all cases and how many outputs were bit-identical."""
    columns, sources = _merge_columns(reports)
    order: list[str] = []
    by_case: dict[str, dict] = {}
    for report, cols in zip(reports, sources):
        for rec in report["cases"]:
            if rec["name"] not in by_case:
                order.append(rec["name"])
                by_case[rec["name"]] = {"name": rec["name"], "inputs": {}, "cells": {}}
            entry = by_case[rec["name"]]
            for backend, col in cols.items():
                entry["cells"][col] = rec["cells"][backend]
                entry["inputs"][col] = rec["input_sha256"]
    pairs: dict[tuple[str, str], dict] = {}
    cases = []
    for name in order:
        entry = by_case[name]
        consistent = len(set(entry["inputs"].values())) == 1
        diffs = _pairwise(entry, consistent)
        for key, d in diffs.items():
            agg = pairs.setdefault(key, {"max_diff": 0.0, "compared": 0, "identical": 0})
            agg["max_diff"] = max(agg["max_diff"], d["max_diff"])
            agg["compared"] += 1
            agg["identical"] += int(d["identical"])
        cases.append({
            "name": name, "inputs_identical": consistent,
            "max_pairwise_diff": max((d["max_diff"] for d in diffs.values()), default=None),
            "cells": {col: {k: cell.get(k) for k in ("status", "max_abs", "rel_l2", "cosine", "emulated", "ran",
                                                        "reasons", "out_sha256")}
                      for col, cell in entry["cells"].items()},
        })
    return {"schema": MERGE_SCHEMA, "sources": [_source(r, n) for r, n in zip(reports, names)],
            "columns": columns, "cases": cases,
            "pairwise": [{"a": a, "b": b, **v} for (a, b), v in pairs.items()]}


def _source(report: dict, name: str) -> dict:
    return {"file": name, "machine": report["machine"], "device": report["device"],
            "device_name": report["platform"]["device_name"], "created": report["created"],
            "matrix_sha256": report["matrix"]["sha256"], "versions": report["environment"]["versions"]}


def _merge_columns(reports: list[dict]) -> tuple[list[str], list[dict]]:
    """Column label per (report, backend): ``backend@machine`` (``+emu`` when emulated), suffixed
    with ``#i`` (the i-th file, from 1) when two runs come from the same kind of machine."""
    labels = []
    for report in reports:
        emu = set(report.get("emulated", []))
        labels.append({b: f"{b}@{report['machine']}" + ("+emu" if b in emu else "") for b in report["backends"]})
    flat = [lab for cols in labels for lab in cols.values()]
    for i, cols in enumerate(labels):
        for b, lab in cols.items():
            if flat.count(lab) > 1:
                cols[b] = f"{lab}#{i + 1}"
    return [lab for cols in labels for lab in cols.values()], labels


def _pairwise(entry: dict, consistent: bool) -> dict:
    """Max abs difference between every two columns that produced an output of this case."""
    outs = {col: cell for col, cell in entry["cells"].items() if cell.get("output")}
    result = {}
    cols = sorted(outs)
    for i, a in enumerate(cols):
        for b in cols[i + 1:]:
            if not consistent and entry["inputs"][a] != entry["inputs"][b]:
                continue
            ra, rb = outs[a]["output"], outs[b]["output"]
            if ra["shape"] != rb["shape"] or ra["count"] != rb["count"]:
                continue
            va, vb = _decode_values(ra), _decode_values(rb)
            both = torch.isfinite(va) & torch.isfinite(vb)
            diff = float((va - vb)[both].abs().max()) if bool(both.any()) else 0.0
            if not bool(both.all()):
                diff = math.inf
            result[(a, b)] = {"max_diff": diff, "identical": outs[a]["out_sha256"] == outs[b]["out_sha256"]}
    return result


def render_merge(merged: dict) -> str:
    columns = merged["columns"]
    notes = _Notes()
    lines = ["# dsv4-attn parity: cross-vendor table", ""]
    lines += [f"- #{i + 1} `{s['file']}`: {s['machine']} ({s['device_name']}), torch {s['versions']['torch']}, "
              f"dsv4_attn {s['versions']['dsv4_attn']}, matrix {s['matrix_sha256'][:12]}, {s['created']}"
              for i, s in enumerate(merged["sources"])]
    if len({s["matrix_sha256"] for s in merged["sources"]}) > 1:
        lines.append("- WARNING: the runs used different matrix files; only cases with identical inputs are compared.")
    lines += ["", "Cell: verdict and relative L2 error against the float64 reference. `max diff`: largest "
              "|difference| between any two columns' outputs (stored output or its common seeded sample).", "",
              "| case | " + " | ".join(columns) + " | max diff |", "|---|" + "---|" * (len(columns) + 1)]
    for case in merged["cases"]:
        cells = []
        for col in columns:
            cell = case["cells"].get(col)
            cells.append("-" if cell is None else _merge_cell(cell, notes, col))
        diff = _fmt(case["max_pairwise_diff"])
        if not case["inputs_identical"]:
            diff += " " + notes.ref("inputs differ between runs (different torch / matrix versions): "
                                    "only runs with identical inputs are compared")
        lines.append(f"| {case['name']} | " + " | ".join(cells) + f" | {diff} |")
    lines += ["", "| column A | column B | cases compared | bit-identical | max diff |", "|---|---|---|---|---|"]
    for p in merged["pairwise"]:
        lines.append(f"| {p['a']} | {p['b']} | {p['compared']} | {p['identical']} | {_fmt(p['max_diff'])} |")
    if notes.texts:
        lines += [""] + [f"[{i + 1}] {t}" for i, t in enumerate(notes.texts)]
    return "\n".join(lines) + "\n"


def _merge_cell(cell: dict, notes: _Notes, col: str) -> str:
    if cell["status"] == "skip":
        return "skip " + notes.ref(f"`{col}` skipped: " + " / ".join(cell["reasons"]))
    if cell["status"] == "error":
        return "**ERROR** " + notes.ref(f"`{col}` raised: {cell['reasons'][0]}")
    verdict = "pass" if cell["status"] == "pass" else "**FAIL**"
    return f"{verdict} {_fmt(cell['rel_l2'])}"


# =============================================================================================
# CLI: dsv4-attn parity
# =============================================================================================
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsv4-attn parity",
        description="Run the parity matrix (every backend vs the float64 reference) or merge runs from "
                    "several machines into the cross-vendor table. Exit status: 0 all cells that ran passed, "
                    "1 a cell failed or nothing ran, 2 bad arguments.")
    p.add_argument("--matrix", help="matrix YAML (default: the packaged dsv4_attn/data/parity.yaml)")
    p.add_argument("--backends", nargs="+", metavar="NAME",
                   help="backends to run (names or comma lists; 'all' = every registered backend). Default: "
                        "the matrix's list for this device (CPU: torch)")
    p.add_argument("--cases", metavar="PATTERN", help="comma-separated globs over case names "
                   "(no wildcard: substring), e.g. 'core.c4a.*.long'")
    p.add_argument("--full", action="store_true", help="add the large shapes (sweeps marked full: GPU machines)")
    p.add_argument("--device", help="device under test (default: cuda when available, else cpu)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"directory for the JSON and Markdown (default ./{DEFAULT_OUT})")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge parity JSON files into the cross-vendor table")
    p.add_argument("--emulate-aiter", nargs="?", const="1", metavar="ARCH[:FLAVOR]",
                   help="run the aiter backend through the AITER emulator (dsv4_attn.rocm.emulate; e.g. "
                        "gfx950, gfx942, gfx950:0.1.7); its cells are labelled emulated")
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: 1 on a CPU device, else torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _write(out_dir: Path, stem: str, report: dict, markdown: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    md_path.write_text(markdown)
    return json_path, md_path


def _finite_json(obj):
    """Replace non-finite floats (strict JSON has none) with strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite_json(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.merge:
            reports = [load_report(p) for p in args.merge]
            merged = merge_reports(reports, args.merge)
            markdown = render_merge(merged)
            print(markdown, end="")
            paths = _write(Path(args.out), "merged", _finite_json(merged), markdown)
            print(f"wrote {paths[0]} and {paths[1]}", file=sys.stderr)
            return int(any(c["status"] in ("fail", "error") for case in merged["cases"]
                           for c in case["cells"].values()))
        if args.emulate_aiter:
            _enable_aiter_emulator(args.emulate_aiter)
        matrix = load_matrix(args.matrix, full=args.full)
        cases = matrix.select(args.cases)
        if args.list:
            print("\n".join(c.name for c in cases))
            return 0
        device = _device(args.device) if args.device else default_device()
        if args.threads or device.type == "cpu":
            # One thread by default: on an idle 2-core machine the default matrix takes 37 s instead
            # of 25 s, but when other processes share the cores OpenMP workers spin-wait and two
            # threads ran 3-4x slower than one (measured), which would break the 3-minute budget.
            torch.set_num_threads(args.threads or 1)
        backends = resolve_backends(args.backends) if args.backends else default_backends(matrix, device)
        if args.emulate_aiter and not args.backends and "aiter" not in backends:
            backends.append("aiter")
    except ValueError as exc:
        print(f"dsv4-attn parity: {exc}", file=sys.stderr)
        return 2
    report = run(matrix, backends, device, cases, progress=not args.no_progress)
    markdown = render_report(report)
    print(markdown, end="")
    plat = report["platform"]
    paths = _write(Path(args.out), f"parity-{plat['vendor']}-{plat['arch']}", _finite_json(report), markdown)
    print(f"wrote {paths[0]} and {paths[1]}", file=sys.stderr)
    if not any(s["pass"] + s["fail"] + s["error"] for s in report["summary"].values()):
        print("dsv4-attn parity: no cell ran (every backend skipped every case)", file=sys.stderr)
        return 1
    return int(failed(report))


def _device(arg: str) -> torch.device:
    try:
        device = torch.device(arg)
    except RuntimeError:
        raise ValueError(f"--device: got {arg!r}; allowed: a torch device such as cpu, cuda, cuda:1") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: got {arg!r}, but torch sees no GPU; allowed: cpu")
    return device


def _enable_aiter_emulator(value: str) -> None:
    """Switch the AITER emulator on for this process (``value``: 1, ARCH or ARCH:FLAVOR)."""
    try:
        from .rocm import emulate

        emulator = emulate.parse_env(value)
        if emulator is None:
            raise ValueError("it switches the emulator off")
        emulate.enable(emulator.arch, emulator.flavor)
    except ImportError as exc:
        raise ValueError(f"--emulate-aiter: the AITER emulator is not available ({exc})") from None
    except ValueError as exc:
        raise ValueError(f"--emulate-aiter: got {value!r} ({exc}); allowed: 1, gfx950, gfx942, "
                         "or ARCH:FLAVOR such as gfx950:0.1.7") from None
