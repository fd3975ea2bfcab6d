"""Backend `aiter`: DeepSeek-V4 / V4.1 sparse decode on AMD gfx950 (MI355X) / gfx942 (MI300X) via AITER.

Decode only (``phases = (DECODE,)``): prefill tokens go to `triton` / `torch` through the front
end. Three AITER entry points, tried in this order (``PATHS``; features are probed from the
installed functions' signatures and the shipped code objects, never from the version string).
DeepSeek-V4.1's top-k kinds (C1A, C2A) run on ``sparse_mla_fwd`` only: that is the one AITER
entry point vLLM 0.33 runs V4.1 through on ROCm (``models/deepseek_v41/amd/rocm.py``, V4 record);
the other two refuse them with that reason.

``sparse_mla_fwd`` (``aiter.ops.triton.attention.sparse_mla``, gfx950)
    One call per layer: both scopes (``extra_*``), compacted ragged CSR of GLOBAL slots and the
    sink in the kernel; caches read in place (MODEL1, BF16, FP8_TENSOR in gfx950's OCP). The
    keyword set vLLM 0.33 calls; no AITER release has it yet.

``mla_decode_fwd_v4_nm`` (``aiter.mla``, AITER >= 0.1.18, gfx950 code object ``hsa/gfx950/mla_v4``)
    AITER's own DeepSeek-V4 decode, MODEL1 caches only: one call for both scopes with the sink in
    the kernel. Its rows are 512-byte packs (448 e4m3 NoPE, each tile's UE8M0 scale written
    twice) plus a separate bf16 RoPE tensor, which a MODEL1 cache cannot be read as in place: this
    step's selected records are repacked byte for byte into a bounded scratch. q is packed the
    same way (e4m3 with per-64 e8m0 scales; the kernel's fixed 1/sqrt(512) scale folded in).

``mla_decode_fwd`` (``aiter.mla``, ``return_lse=True``)
    Any format. The code objects read 576-element rows (per-head q stride and KV row fixed at
    512 + 64), so q is staged zero-padded to 576 and this step's selected rows are gathered
    (decoded in their own FP8 dialect) into a bounded scratch of 576-wide rows with a zero RoPE
    tail, as AITER's own tests lay them out. One call per scope, natural-log LSE, merged with
    ``common.merge.merge_lse`` and ``apply_sink``. Modes per batch size:

    persistent  T < ``persistent_max_batch`` (default 32, AITER's own batch gate, #4144): FP8/FP8
                operands (power-of-two per-tensor scales), heads padded to a count whose code
                object writes the LSE (gfx950 16/64/128, gfx942 64; :data:`PERSISTENT_LSE`),
                fixed-stride compacted indices and a ``topk=`` work plan sized for the
                persistent batch (``get_mla_metadata_info_v1``), refilled once per step per scope;
    split       otherwise: BF16/BF16 (FP8 split kernels need >= 128 keys per split, AITER's fp8
                cap, and write no LSE with one split), heads 16 / 128, ragged CSR, >= 2 splits
                (the LSE comes from stage 2). Its code objects address rows with 24-bit row
                numbers and 32-bit byte offsets: the gathered scratch must stay below both.

Every index list is compacted (no -1 or out-of-range entry inside a range: the kernels read
every index of a range). Rows with no key are masked from the adapter's own counts, whatever
the kernel reports there. AITER loads kernels on first use, so the first eager decode of a layer
configuration also runs every kernel variant the batch size could later select (persistent and
split, single- and multi-split) on a one-token dummy; a first use inside a graph capture raises.

Everything a step touches lives in :mod:`.scratch` buffers (graph-stable, shared by layers).
The AITER API comes through ONE seam, :func:`.aiter_api.load_aiter`: the real library on ROCm,
or the AITER EMULATOR (:mod:`dsv4_attn.emulation`, a model of the kernels) when
``emulation.enable()`` was called or ``DSV4_ATTN_AITER_EMULATOR`` is set; then CPU/CUDA devices
are accepted and every result is labelled emulated. See docs/rocm.md.

One job per module: :mod:`.aiter_api` (loading AITER, calling it by keyword across revisions),
:mod:`.aiter_features` (what the installed AITER can run, and the probe's description),
:mod:`.aiter_steps` (per-step metadata, scratch, index lists, warm-up), :mod:`.aiter_paths` (the
three entry points' calls), this module (the ``Backend``: selection, capacity, forward).
"""

from __future__ import annotations

import warnings

import torch

from .. import envs
from ..common.backend import (
    Backend,
    Capabilities,
    LaunchLimit,
    LayerInputs,
    LayerShape,
    Phase,
    PlatformSupport,
)
from ..common.layout import Fp8Dialect, KVFormat
from ..common.plan import StepPlan
from ..common.platform import Platform
from ..common.spec import V4_KINDS, LayerKind, ModelSpec
from .aiter_api import AiterAPI, load_aiter
from .aiter_features import (
    ARCHS,
    FP8_NOTE,
    PATH_NOTES,
    PATHS,
    ROW,
    SPLIT_MAX_BYTES,
    SPLIT_MAX_ROWS,
    aiter_text,
    base_reasons,
    decode_reasons,
    describe_aiter,
    native_dialect,
    nm_reasons,
    scope_widths,
    sparse_reasons,
)
from .aiter_paths import AiterPaths
from .aiter_steps import AiterMeta
from .scratch import AiterScratch, ScopeBuffers, ScratchKey


# ---- the backend --------------------------------------------------------------------------------
class AiterBackend(AiterPaths, Backend):
    """AITER decode adapter (see module docstring). EMULATED / contract-tested only.

    path                  "auto" (the first of PATHS that serves the layer) or one of PATHS;
                          env DSV4_ATTN_AITER_PATH
    fp8_compute           run the paths that compute in fp8 (mla_decode_fwd_v4_nm, mla_decode_fwd
                          persistent): opt-in, they are ~10x less accurate than the bf16 paths
                          (:data:`FP8_NOTE`); env DSV4_ATTN_AITER_FP8_COMPUTE, default off
    persistent_max_batch  with fp8_compute, mla_decode_fwd runs persistent for T < this many
                          decode tokens (0 = never); env DSV4_ATTN_AITER_PERSISTENT_MAX_BATCH, default 32
    max_decode_tokens     scratch capacity in decode tokens (bounds the gathered-rows scratch);
                          env DSV4_ATTN_AITER_MAX_DECODE_TOKENS; unset: the engine's decode
                          tokens when it reserves memory at start (:meth:`reserve`, capped by
                          what split mode can address), else 1024. It is the backend's launch
                          limit (:meth:`launch_limit`): selection sends larger decode launches
                          to the next backend that serves the layer (``explain()`` says which)
    max_splits            split budget per batch row (split mode, persistent work plans)
    """

    splits_phases = True
    capabilities = Capabilities(
        platforms=(PlatformSupport("rocm", archs=ARCHS, label="AMD gfx950 (MI355X), gfx942 (MI300X) via AITER"),),
        formats=(KVFormat.MODEL1_FP8, KVFormat.BF16, KVFormat.FP8_TENSOR),
        kinds=V4_KINDS + (LayerKind.C1A, LayerKind.C2A),  # V4.1's on sparse_mla_fwd only (path_reasons)
        phases=(Phase.DECODE,),
        dialects=(Fp8Dialect.OCP, Fp8Dialect.FNUZ),  # gathered rows are decoded in their own dialect
        heads_note="padded to what each kernel takes: 16/32/64/128",
        validated="emulated (a model of AITER 0.1.20's kernels: CPU CI, H100 CUDA-graph test); never run on "
                  "MI300X/MI355X",
        notes="decode only; bf16 compute by default: sparse_mla_fwd (gfx950, vLLM 0.33's AITER; V4.1's C1A/C2A "
              "only there), else mla_decode_fwd split mode + LSE merge (AITER >= 0.1.19); fp8 compute "
              "(mla_decode_fwd_v4_nm, persistent mode) opt-in: DSV4_ATTN_AITER_FP8_COMPUTE",
    )

    def __init__(self, path: str | None = None, persistent_max_batch: int | None = None,
                 max_decode_tokens: int | None = None, max_splits: int = 16, name: str = "aiter",
                 fp8_compute: bool | None = None) -> None:
        self.name = name
        self.fp8_compute = envs.AITER_FP8_COMPUTE.get() if fp8_compute is None else fp8_compute
        if not isinstance(self.fp8_compute, bool):
            raise ValueError(f"fp8_compute: got {fp8_compute!r}; allowed: True or False")
        self.path = path if path is not None else envs.AITER_PATH.get()
        if self.path not in ("auto",) + PATHS:
            raise ValueError(f"path: got {self.path!r}; allowed: 'auto', {PATHS}")
        self.persistent_max_batch = (persistent_max_batch if persistent_max_batch is not None
                                     else envs.AITER_PERSISTENT_MAX_BATCH.get())
        self.max_decode_tokens = (max_decode_tokens if max_decode_tokens is not None
                                  else envs.AITER_MAX_DECODE_TOKENS.get())
        # given (argument or environment): kept; else reserve() sizes it from the engine
        self._capacity_fixed = max_decode_tokens is not None or envs.AITER_MAX_DECODE_TOKENS.raw is not None
        for arg, value in (("persistent_max_batch", self.persistent_max_batch),
                           ("max_decode_tokens", self.max_decode_tokens), ("max_splits", max_splits)):
            low = 0 if arg == "persistent_max_batch" else (2 if arg == "max_splits" else 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{arg}: got {value!r}; allowed: an int >= {low}")
        self.max_splits = max_splits
        self._scratch: dict[ScratchKey, AiterScratch] = {}
        self._warmed: set[tuple] = set()
        self._warned_env = False

    def label(self) -> str:
        """"aiter" plus "[EMULATED gfx950 ...]" when the emulator serves it (for result files)."""
        api = load_aiter()
        return f"{self.name} [EMULATED {api.arch}, AITER {api.version}]" if api.emulated else self.name

    @property
    def emulated(self) -> bool:
        """True while the AITER emulator serves this backend (--emulate-aiter, DSV4_ATTN_AITER_EMULATOR)."""
        return load_aiter().emulated

    def emulation_tag(self) -> str:
        api = load_aiter()
        return f"{self.name}-{api.arch}-{api.version}"

    def describe_binary(self, platform: Platform) -> tuple[dict, list[str]]:
        info = describe_aiter(platform)
        return info, aiter_text(info, platform.library("aiter"))

    # ---- selection --------------------------------------------------------------------------
    def _split_rows_reasons(self, spec: ModelSpec) -> list[str]:
        width = max(w for _, w in scope_widths(spec))  # the gathered-rows scratch serves every scope
        rows = self.max_decode_tokens * width + 2  # + the scatter dump and the sentinel row
        if rows < SPLIT_MAX_ROWS and rows * ROW * 2 < SPLIT_MAX_BYTES:
            return []
        return [f"split mode gathers up to max_decode_tokens x {width} = {rows} rows of {ROW * 2} B; its code "
                f"objects address rows with 24-bit numbers and 32-bit byte offsets (allowed: < {SPLIT_MAX_ROWS} "
                f"rows and < 4 GiB; lower max_decode_tokens or {envs.AITER_MAX_DECODE_TOKENS.name})"]

    def path_reasons(self, api: AiterAPI, spec: ModelSpec | None, fmt: KVFormat, kind: LayerKind, path: str,
                     dialects=None, heads: int | None = None) -> list[str]:
        """Why ``path`` cannot serve the layer ([] = it can). ``spec`` None skips the checks of the
        model's heads and widths, ``dialects`` (SWA, compressed) None those of the caches' FP8
        encodings; ``heads`` defaults to the spec's."""
        if heads is None and spec is not None:
            heads = spec.num_heads
        if path != "sparse_mla_fwd" and kind not in V4_KINDS:
            return [f"serves DeepSeek-V4.1's {kind.name} layers through sparse_mla_fwd only, the AITER entry point "
                    "vLLM 0.33 runs V4.1 through on ROCm (models/deepseek_v41/amd/rocm.py)"]
        if path == "sparse_mla_fwd":
            why = sparse_reasons(api)
            in_place = fmt is not KVFormat.BF16
        elif path == "mla_decode_fwd_v4_nm":
            why = nm_reasons(api, fmt, heads or 1)
            if not why and not self.fp8_compute:
                why = [f"{FP8_NOTE}; opt in with {envs.AITER_FP8_COMPUTE.name}=1 or AiterBackend(fp8_compute=True)"]
            in_place = True  # MODEL1 bytes copied as they are
        else:
            why = decode_reasons(api) or (self._split_rows_reasons(spec) if spec is not None else [])
            in_place = False  # gathered rows are decoded in their own dialect
        if why or not in_place or dialects is None:
            return why
        native = native_dialect(api)
        names = ("swa_dialect", "comp_dialect")[: 2 if kind.has_comp_scope else 1]
        return [f"{name}: got {d.value}; allowed: {native.value} ({api.arch} reads its native FP8 encoding from "
                f"{fmt.value} bytes on this path)" for name, d in zip(names, dialects) if d is not native]

    def choose_path(self, api: AiterAPI, spec: ModelSpec | None, fmt: KVFormat, kind: LayerKind, dialects=None,
                    heads: int | None = None) -> tuple[str | None, list[str]]:
        """(path, []) or (None, reasons) for a layer."""
        reasons = base_reasons(api)
        if reasons:
            return None, reasons
        for path in PATHS if self.path == "auto" else (self.path,):
            why = self.path_reasons(api, spec, fmt, kind, path, dialects, heads)
            if not why:
                return path, []
            reasons += [f"{path}: {r}" for r in why]
        return None, reasons

    def platform_reasons(self, platform: Platform) -> list[str]:
        return []  # load_aiter decides: a ROCm gfx942/gfx950 with AITER, or the emulator on any device

    def extra_reasons(self, platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, phase: Phase,
                      dialects) -> list[str]:
        api = load_aiter(platform)
        if api.emulated and platform.vendor == "rocm" and not self._warned_env:
            self._warned_env = True
            warnings.warn("dsv4_attn: the AITER EMULATOR is switched on on a ROCm machine; results are emulated",
                          stacklevel=2)
        return self.choose_path(api, spec, fmt, kind, tuple(dialects))[1]

    def choice(self, platform: Platform, spec: ModelSpec, fmt: KVFormat, kind: LayerKind, phase: Phase,
               dialects) -> str:
        """The AITER path auto picks for the layer and why (shown by ``SparseMLA.explain()``)."""
        api, kind = load_aiter(platform), LayerKind.parse(kind)
        path, _ = self.choose_path(api, spec, fmt, kind, tuple(dialects))
        if path is None:
            return ""
        skipped = [f"{p} skipped: {'; '.join(self.path_reasons(api, spec, fmt, kind, p, tuple(dialects)))}"
                   for p in PATHS[: PATHS.index(path)]]
        status = ("EMULATED: a model of AITER's kernels, not AITER" if api.emulated
                  else "this adapter has not yet been validated on MI300X/MI355X hardware (docs/rocm.md)")
        fp8 = self._computes_fp8(api, path, fmt, spec.num_heads)
        precision = (f"fp8 compute opted in ({envs.AITER_FP8_COMPUTE.name}): {FP8_NOTE}" if fp8
                     else "bf16 compute (the accuracy of every other backend)")
        return "; ".join([f"path {path} ({PATH_NOTES[path]})", precision] + skipped + [status])

    def _computes_fp8(self, api: AiterAPI, path: str, fmt: KVFormat, heads: int) -> bool:
        """Whether ``path`` runs AITER's a8w8 kernels for this layer (for some batch size)."""
        if path == "mla_decode_fwd_v4_nm":
            return True
        return path == "mla_decode_fwd" and self._persistent_heads_for(api, fmt, heads) is not None

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, plan: StepPlan, layer: LayerInputs, out: torch.Tensor) -> None:
        T = plan.num_tokens
        if T == 0:
            return
        if T > self.max_decode_tokens:  # SparseMLA never sends one (launch_limit); a direct caller may
            raise ValueError(f"plan: got {T} decode tokens; allowed: <= max_decode_tokens ({self.max_decode_tokens}) "
                             "of the aiter backend (SparseMLA runs larger launches on the next backend; raise it: "
                             f"AiterBackend(max_decode_tokens=...) or {envs.AITER_MAX_DECODE_TOKENS.name})")
        api = load_aiter()
        meta = self.meta(plan, layer.shape)
        {"sparse_mla_fwd": self._forward_sparse, "mla_decode_fwd_v4_nm": self._forward_nm,
         "mla_decode_fwd": self._forward_decode}[meta.path](api, plan, meta, layer, out)

    # ---- capacity ---------------------------------------------------------------------------
    def launch_limit(self, phase: Phase) -> LaunchLimit | None:
        """Decode launches fit the scratch's ``max_decode_tokens`` tokens (selection sends larger
        ones to the next backend); prefill never runs here."""
        if Phase(phase) is not Phase.DECODE:
            return None
        set_by = "" if self._capacity_fixed else ", or the engine decode tokens reserve() sets"
        return LaunchLimit(self.max_decode_tokens, f"the scratch's capacity{set_by}")

    def addressable_tokens(self, spec: ModelSpec) -> int:
        """The most decode tokens split mode's gathered rows can address (24-bit row numbers,
        32-bit byte offsets: :meth:`_split_rows_reasons`)."""
        width = max(w for _, w in scope_widths(spec))
        return max(1, min(SPLIT_MAX_ROWS - 3, (SPLIT_MAX_BYTES - 1) // (ROW * 2) - 3) // width)

    def reserve(self, plan: StepPlan, fmt: KVFormat, num_heads: int, dialects, decode_tokens: int) -> None:
        """Engine start (vLLM's memory profile): unless ``max_decode_tokens`` was given, size the
        scratch for the engine's ``decode_tokens`` (capped by :meth:`addressable_tokens`); then
        allocate every scratch the model's layers will use and run every kernel variant once, so
        no step allocates scratch or loads a kernel (the engine counts this memory before it
        sizes its KV cache)."""
        if not self._capacity_fixed:
            self.max_decode_tokens = min(decode_tokens, self.addressable_tokens(plan.spec))
        api = load_aiter()
        for kind in plan.spec.kinds:
            path, _ = self.choose_path(api, plan.spec, fmt, kind, tuple(dialects), num_heads)
            if path is not None:
                self._path_scratch(path, api, plan, fmt, num_heads)

    def _path_scratch(self, path: str, api: AiterAPI, plan: StepPlan, fmt: KVFormat, heads: int) -> AiterScratch:
        """The scratch ``path`` runs a layer on (allocated, kernels warmed, on first use)."""
        scratch = {"sparse_mla_fwd": self._sparse_scratch, "mla_decode_fwd_v4_nm": self._nm_scratch,
                   "mla_decode_fwd": self._decode_scratch}[path]
        return scratch(api, plan, fmt, heads)

    def prepare(self, plan: StepPlan, shape: LayerShape) -> AiterMeta:
        """The shape's path and scratch (every kernel variant it may run warmed first)."""
        api = load_aiter()
        path, reasons = self.choose_path(api, plan.spec, shape.fmt, shape.kind, shape.dialects, shape.num_heads)
        if path is None:
            raise ValueError("aiter: cannot run this layer:\n" + "\n".join(f"  - {r}" for r in reasons))
        scratch = self._path_scratch(path, api, plan, shape.fmt, shape.num_heads)
        shared: dict[str, ScopeBuffers] = {}
        window_path = self.choose_path(api, plan.spec, shape.fmt, LayerKind.SWA, shape.dialects, shape.num_heads)[0]
        if shape.kind.has_comp_scope and path != "mla_decode_fwd_v4_nm" and window_path == path:
            window = self.meta(plan, shape.window_only())
            if window.scratch is scratch:  # the same buffers: the window scope is built once per step
                shared = window.shared
        return AiterMeta(path, scratch, shared)

