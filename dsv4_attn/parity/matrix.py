"""The parity matrix file: YAML -> validated, expanded, named and seeded cases.

A matrix (format in docs/parity.md; the packaged one is ``dsv4_attn/data/parity.yaml``) expands
each sweep into cases: layer kind x heads x KV format x batch mix x length bucket (+ block
sizes, fp8 dialects, page strides, huge slot offsets). Every mistake in the file is a
ValueError naming the key, what it holds and what is allowed.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.resources
import itertools
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import yaml

from ..common.backend import Phase
from ..common.layout import Fp8Dialect, KVFormat
from ..common.spec import LayerKind, ModelSpec

_METRICS = ("max_abs", "rel_l2", "cosine")


def default_matrix_path() -> Path:
    """The packaged default matrix (works after ``pip install``; ci/parity.yaml is the same file)."""
    return Path(str(importlib.resources.files("dsv4_attn") / "data" / "parity.yaml"))


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
    topk: int
    max_model_len: int
    window: int
    sink: str
    kv_scale: float
    swa_dialect: Fp8Dialect
    comp_dialect: Fp8Dialect
    page_stride: int
    byte_offset: int
    shared: bool = False

    @property
    def spec(self) -> ModelSpec:
        """A model of this case's layer (and a window-only one beside it)."""
        layers = (LayerKind.SWA,) if self.kind is LayerKind.SWA else (LayerKind.SWA, self.kind)
        return ModelSpec(num_heads=self.heads, topk=self.topk, max_model_len=self.max_model_len,
                         window=self.window, layers=layers)

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
            "topk": self.topk, "max_model_len": self.max_model_len, "window": self.window,
            "sink": self.sink, "kv_scale": self.kv_scale, "swa_dialect": self.swa_dialect.value,
            "comp_dialect": self.comp_dialect.value, "page_stride": self.page_stride,
            "byte_offset": self.byte_offset, "shared": self.shared,
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

    @property
    def shown_path(self) -> str:
        """The file as reports name it: the packaged matrix by its place in the package, another
        one relative to the working directory when it lies below it (no home directories in
        tables shared between machines)."""
        path = Path(self.path).resolve()
        if path == default_matrix_path().resolve():
            return "dsv4_attn/data/parity.yaml"
        try:
            return str(path.relative_to(Path.cwd().resolve()))
        except ValueError:
            return self.path

    def tolerance(self, case: Case, backend: str) -> Tolerance:
        """Default tolerance with every matching override applied in order."""
        return self.tolerance_for(backend, case.fmt, case.kind)

    def tolerance_for(self, backend: str, fmt: KVFormat | str, kind: LayerKind | None = None) -> Tolerance:
        """The tolerance of ``backend`` on ``fmt`` caches (and ``kind`` layers; None: only the
        overrides that name no kind apply)."""
        values = dict(self.tolerance_default.__dict__)
        facts = {"backend": backend, "format": KVFormat.parse(fmt).value,
                 "kind": None if kind is None else kind.name.lower()}
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
         "comp_dialect", "page_stride", "byte_offset", "shared")
_EXTRA_TAGS = {"swa_block_size": "swabs{}", "block_size": "bs{}", "swa_dialect": "swa-{}",
               "comp_dialect": "comp-{}", "page_stride": "stride{}", "byte_offset": "off{}", "shared": "shared"}
_MODEL_KEYS = ("topk", "max_model_len", "window")


def _fail(where: str, got: object, allowed: str) -> NoReturn:
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
    """``base`` updated with a matrix's / sweep's ``model`` mapping (keys topk, max_model_len,
    window)."""
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
    model = _model({"topk": 512, "max_model_len": 65536, "window": 128}, doc.get("model"), "model")
    defaults = {"swa_block_size": 64, "block_size": 256, "swa_dialect": "ocp", "comp_dialect": "ocp",
                "page_stride": 1, "byte_offset": 0, "shared": False, **(doc.get("defaults") or {})}
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
    given = {k: sweep.get(k, defaults.get(k)) for k in _AXES}
    axes: dict[str, list] = {k: (v if isinstance(v, list) else [v]) for k, v in given.items()}
    out = []
    for values in itertools.product(*(axes[k] for k in _AXES)):
        point = dict(zip(_AXES, values))
        tags = [_EXTRA_TAGS[k].format(point[k]) for k in _EXTRA_TAGS if k in sweep and point[k] is not False]
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
    shared = point["shared"]
    if not isinstance(shared, bool) or (shared and not kind.uses_topk):
        _fail(f"case {name}: shared", shared, "false, or true for a top-k kind (a second layer's top-k over the "
                                              "same compressed cache runs first)")
    case_seed = zlib.crc32(f"{seed}/{name}".encode()) & 0x7FFFFFFF
    return Case(
        name=name, seed=case_seed, sweep=sweep, kind=kind, heads=heads, held_heads=held, fmt=fmt, mix=mix,
        length=length, query_lens=tuple(q_lens), seq_lens=tuple(s_lens), decode_reqs=decode,
        padding=_int(shape.get("padding", 0), f"batches.{mix}.{length}.padding"),
        swa_block_size=_int(point["swa_block_size"], f"case {name}: swa_block_size", 1),
        block_size=_int(point["block_size"], f"case {name}: block_size", 1),
        topk=model["topk"], max_model_len=model["max_model_len"], window=model["window"], sink=sink,
        kv_scale=kv_scale, swa_dialect=Fp8Dialect.parse(point["swa_dialect"]),
        comp_dialect=Fp8Dialect.parse(point["comp_dialect"]),
        page_stride=_int(point["page_stride"], f"case {name}: page_stride", 1),
        byte_offset=_int(point["byte_offset"], f"case {name}: byte_offset"), shared=shared,
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

