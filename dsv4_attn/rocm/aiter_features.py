"""What the installed AITER can run, read from its functions' signatures and shipped code objects
(never from the version string): a reason per entry point, and ``describe_aiter`` for the probe."""

from __future__ import annotations

import itertools
import os
from typing import Any

from .. import envs
from ..common.layout import Fp8Dialect, KVFormat
from ..common.platform import LibraryInfo, Platform
from ..common.spec import ModelSpec
from .aiter_api import AiterAPI, load_aiter, parameters

ARCHS = ("gfx942", "gfx950")
NATIVE_DIALECT = {"gfx942": Fp8Dialect.FNUZ, "gfx950": Fp8Dialect.OCP}
PATHS = ("sparse_mla_fwd", "mla_decode_fwd_v4_nm", "mla_decode_fwd")
# what each path costs or gains, shown by explain() for the path auto picks
PATH_NOTES = {
    "sparse_mla_fwd": "caches read in place; both scopes and the sink in one launch",
    "mla_decode_fwd_v4_nm": "AITER's DSv4 kernel: both scopes and the sink in one launch over this step's MODEL1 "
                            "records repacked byte for byte; q in e4m3 with per-tile scales",
    "mla_decode_fwd": "this step's rows gathered into 576-wide rows; one launch per scope, LSE merge and sink "
                      "in the front end; fp8 q/kv below the persistent batch, bf16 above",
}
ROW = 576  # elements per q head / KV row that mla_decode_fwd's code objects read
NM_ROW = 512  # v4 nm packed row bytes
NM_HEADS = (16, 32, 64, 128)
NM_OBJECT = "mla_a8w8_qh64_qseqlen1_gqaratio64_nm.co"
# split mode (bf16/bf16): heads -> code object; 24-bit rows, 32-bit byte offsets
SPLIT_OBJECTS = {16: "mla_dec_stage1_bf16_a16w16_subQ16_mqa16.co", 128: "mla_dec_stage1_bf16_a16w16_subQ128_mqa128.co"}
SPLIT_MAX_ROWS, SPLIT_MAX_BYTES = 1 << 24, 1 << 32
# persistent FP8/FP8 heads -> the code object AITER 0.1.20 launches with an LSE, where it writes
# one (gfx950's 32-head *_lse_ps object is its non-LSE twin: docs/rocm.md "Evidence")
PERSISTENT_LSE = {
    "gfx950": {16: "mla_a8w8_qh16_qseqlen1_gqaratio16_lse_ps.co", 64: "mla_a8w8_qh16_qseqlen4_gqaratio16_lse_v3_ps.co",
               128: "mla_a8w8_qh32_qseqlen4_gqaratio32_lse_ps.co"},
    "gfx942": {64: "mla_a8w8_qh64_qseqlen1_gqaratio64_lse_v3_ps.co"},
}
# the kernels fold an in-kernel sink into their running max, where +inf gives inf - inf = NaN;
# staged as this instead it still zeroes the head (exp(s - 1e30) = 0)
SINK_MAX = 1e30
ENV_AITER_EXPERIMENTAL = "AITER_ENABLE_EXPERIMENTAL"  # routes 64/128-head FP8 persistent decode to HK kernels
_SPARSE_KWARGS = ("out", "attn_sink", "extra_kv", "extra_indptr", "extra_indices", "has_invalid", "kv_scale",
                  "kv_lora_rank", "qk_rope_head_dim")
_DECODE_PARAMS = ("q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens",
                  "max_seqlen_q", "sm_scale", "num_kv_splits", "num_kv_splits_indptr", "q_scale", "kv_scale",
                  "return_lse")
_NM_PARAMS = ("q", "qrope", "kv_buffer", "kvrope", "output", "qo_indptr", "kv_indptr", "kv_page_indices",
              "max_seqlen_q", "sink", "num_kv_splits")
# The first AITER release whose path behaves as the adapter needs (the signatures cannot tell):
# v4 nm before 0.1.18 merges unwritten splits of short rows (#4117) and folds out-of-range page
# ids to row 0 (#4245); split mode before 0.1.19 looks for an LSE-writing split code object
# (asm_mla.cu ``lse_flag = lse != nullptr``), finds none and raises.
MIN_VERSION = {"mla_decode_fwd_v4_nm": ((0, 1, 18), "0.1.17 lacks AITER #4117 (empty splits of short rows merged) "
                                                    "and #4245 (out-of-range page ids read row 0)"),
               "mla_decode_fwd": ((0, 1, 19), "before 0.1.19 split mode with return_lse=True finds no code object "
                                              "(asm_mla.cu lse_flag lacks '&& persistent') and raises")}
# Paths that compute in fp8 (AITER's a8w8 kernels: q rounded to e4m3, P rounded to fp8 before
# P.V): opt-in (FP8_COMPUTE). Their error, measured through the emulator on the adversarial cases
# of tests/test_aiter.py (garbage past the valid top-k, permuted block tables, MTP, 16-128 heads,
# +-inf sinks), against the bf16 paths' (tests/test_aiter.py::test_fp8_compute_is_opt_in_and_labelled).
FP8_REL_L2 = 5e-2
FP8_NOTE = (f"computes in fp8 (e4m3 q, fp8 probabilities): rel L2 up to {FP8_REL_L2:.1e} against float64, "
            "EMULATED, vs <= 5e-3 for every default path")
# kv_granularity of a persistent work plan: the gfx942 64-head FP8 object (and AITER's own test for
# 64 fp8 heads on either arch) needs works of whole 32-key passes (SUB_KV = 32, AITER #3188)
PLAN_GRANULARITY = {64: 32}


# ---- features (signatures and code objects, not the version string) --------------------------
def native_dialect(api: AiterAPI) -> Fp8Dialect:
    """The FP8 encoding ``api``'s arch reads natively (asked once ``base_reasons`` passed)."""
    dialect = NATIVE_DIALECT.get(api.arch or "")
    if dialect is None:
        raise ValueError(f"arch: got {api.arch!r}; allowed: {ARCHS}")
    return dialect


def sparse_reasons(api: AiterAPI) -> list[str]:
    if api.sparse_mla_fwd is None:
        return ["aiter.ops.triton.attention.sparse_mla.sparse_mla_fwd not found (no AITER release has it; "
                "vLLM 0.33 calls it)"]
    missing = [k for k in _SPARSE_KWARGS if k not in parameters(api.sparse_mla_fwd)]
    if missing:
        return [f"sparse_mla_fwd lacks keyword(s) {missing} (the sink and second scope vLLM 0.33 passes)"]
    if api.arch != "gfx950":
        return [f"sparse_mla_fwd is gfx950-only (its Gluon kernels; it asserts so), got {api.arch}"]
    return []


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """(major, minor, patch) of an AITER version string ("0.1.20.post1" -> (0, 1, 20)); None when
    unreadable (a source build without metadata: no version gate applies)."""
    parts = []
    for piece in (text or "").split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts) if len(parts) == 3 else None


def version_reasons(api: AiterAPI, path: str) -> list[str]:
    minimum, why = MIN_VERSION[path]
    have = parse_version(api.version)
    if have is None or have >= minimum:
        return []
    return [f"AITER {api.version}: {why}; allowed: AITER >= {'.'.join(map(str, minimum))}"]


def nm_reasons(api: AiterAPI, fmt: KVFormat, heads: int) -> list[str]:
    if api.mla_decode_fwd_v4_nm is None:
        return ["aiter.mla.mla_decode_fwd_v4_nm not found (AITER >= 0.1.17)"]
    if version_reasons(api, "mla_decode_fwd_v4_nm"):
        return version_reasons(api, "mla_decode_fwd_v4_nm")
    missing = [k for k in _NM_PARAMS if k not in parameters(api.mla_decode_fwd_v4_nm)]
    if missing:
        return [f"mla_decode_fwd_v4_nm lacks parameter(s) {missing}"]
    if NM_OBJECT not in api.asm_objects:
        return [f"no v4 nm code object ({NM_OBJECT}) under hsa/{api.arch}/mla_v4 (AITER ships it for gfx950)"]
    if fmt is not KVFormat.MODEL1_FP8:
        return [f"reads MODEL1 (fp8_ds_mla) records only, got {fmt.value}"]
    if heads > NM_HEADS[-1]:
        return [f"{heads} heads; allowed: <= {NM_HEADS[-1]} (padded to {NM_HEADS})"]
    return []


def decode_reasons(api: AiterAPI) -> list[str]:
    if api.mla_decode_fwd is None:
        return ["aiter.mla.mla_decode_fwd not found"]
    missing = [k for k in _DECODE_PARAMS if k not in parameters(api.mla_decode_fwd)]
    if "return_lse" in missing:
        return ["mla_decode_fwd has no return_lse (AITER 0.1.7: final_lse is returned unwritten), so the two "
                "scopes cannot be merged nor the sink applied"]
    if missing:
        return [f"mla_decode_fwd lacks parameter(s) {missing}"]
    if version_reasons(api, "mla_decode_fwd"):
        return version_reasons(api, "mla_decode_fwd")
    absent = [name for name in SPLIT_OBJECTS.values() if name not in api.asm_objects]
    return [f"split-mode code object(s) {absent} missing under hsa/{api.arch}/mla"] if absent else []


def aiter_experimental() -> bool:
    """AITER's ``is_experimental_enabled()`` (aiter/jit/core.py): an int other than 0."""
    try:
        return int(os.environ.get(ENV_AITER_EXPERIMENTAL, "0")) != 0
    except ValueError:
        return False


def persistent_lse_heads(api: AiterAPI, heads: int) -> tuple[int | None, str | None]:
    """(heads handed to the persistent kernel, None) or (None, why persistent mode is off)."""
    for name in ("get_mla_metadata_info_v1", "get_mla_metadata_v1"):
        if getattr(api, name) is None:
            return None, f"aiter.{name} not found"
    if "topk" not in parameters(api.function("get_mla_metadata_v1")):
        return None, "get_mla_metadata_v1 has no topk (sparse work plans)"
    table = {h: n for h, n in PERSISTENT_LSE.get(api.arch or "", {}).items() if n in api.asm_objects}
    if aiter_experimental():
        table = {h: n for h, n in table.items() if h not in (64, 128)}
    padded = next((h for h in sorted(table) if h >= heads), None)
    if padded is None:
        return None, (f"no persistent FP8 code object that writes an LSE for {heads} heads on {api.arch} (have "
                      f"{sorted(table) or 'none'}; {ENV_AITER_EXPERIMENTAL} reroutes 64/128 heads to kernels "
                      "without one)")
    return padded, None


def split_heads(heads: int) -> int:
    return 16 if heads <= 16 else 128


def split_mgc(split_heads: int) -> int:
    """Keys per split stage 2 counts for bf16 split mode (aiter/mla.py ``mgc``: 64 at 16 heads,
    16 at 128): it merges ``min(S, cdiv(L, mgc))`` partials of a row of L keys."""
    return 64 if split_heads == 16 else 16


def scope_widths(spec: ModelSpec) -> tuple[tuple[str, int], ...]:
    """Row width of every scope, by name: the window ("swa") and each compressed layer kind of the
    model. One scratch serves every layer kind (the window scope is shared)."""
    return (("swa", spec.window),) + tuple((k.name.lower(), spec.comp_width(k)) for k in spec.kinds
                                           if k.has_comp_scope)


def base_reasons(api: AiterAPI) -> list[str]:
    if api.error:
        return [api.error]
    if api.arch not in ARCHS:
        return [f"arch {api.arch}: allowed {ARCHS}"]
    return []


def aiter_text(info: dict, lib: LibraryInfo) -> list[str]:
    """``describe_aiter``'s facts in words (``lib``: the platform's LibraryInfo of aiter): first
    line found / not usable, then the paths it serves and what the others lack, each reason once."""
    if not info["found"]:
        where = (f"AITER {lib.version or '(version unknown)'} installed at {lib.location}; " if lib.found else "")
        return [f"not usable: {where}{' '.join(str(info['error']).split())}"]
    emulated = ", EMULATED" if info["emulated"] else ""
    lines = [f"found: AITER {info['version']} on {info['arch']} (fp8 dialect {info['dialect']}{emulated})"]
    enabled = [f"{path} ({status.removeprefix('enabled').strip(' ()')})" if status != "enabled" else path
               for path, status in info["paths"].items() if status.startswith("enabled")]
    lines.append(f"serves: {', '.join(enabled) or 'nothing'}")
    lacking: dict[str, list[str]] = {}  # reason -> paths, so that each reason is printed once
    for path, status in info["paths"].items():
        if not status.startswith("enabled"):
            lacking.setdefault(status, []).append(path)
    lines += [f"lacks ({', '.join(paths)}): {' '.join(why.split())}" for why, paths in lacking.items()]
    if lacking:
        lines.append('what each AITER version has: docs/rocm.md "Install AITER"')
    return lines


def describe_aiter(platform: Platform | None = None) -> dict:
    """What ``dsv4-attn probe`` prints for AITER: version, arch, FP8 dialect, which paths are
    enabled (or why not), and whether this is the emulator."""
    api = load_aiter(platform)
    native = NATIVE_DIALECT.get(api.arch or "")
    out: dict[str, Any] = {"found": api.error is None, "emulated": api.emulated, "version": api.version,
                           "arch": api.arch, "dialect": native.value if native else None, "error": api.error}
    base = base_reasons(api)
    decode = base or decode_reasons(api)
    persistent = decode or [r for r in [persistent_lse_heads(api, 1)[1]] if r]
    fp8_on = envs.AITER_FP8_COMPUTE.get()
    switch = "opted in" if fp8_on else f"off: opt in with {envs.AITER_FP8_COMPUTE.name}=1"
    fp8 = f"fp8 compute, {switch}: {FP8_NOTE}"
    lse_heads = sorted(h for h, n in PERSISTENT_LSE.get(api.arch or "", {}).items() if n in api.asm_objects)
    out["fp8_compute"] = fp8_on
    out["paths"] = {
        "sparse_mla_fwd": "; ".join(base or sparse_reasons(api)) or "enabled (bf16 compute)",
        "mla_decode_fwd_v4_nm": "; ".join(base or nm_reasons(api, KVFormat.MODEL1_FP8, 1)) or (
            f"{'enabled' if fp8_on else 'available'} (fp8_ds_mla; {fp8})"),
        "mla_decode_fwd (split)": "; ".join(decode) or "enabled (bf16 compute)",
        "mla_decode_fwd (persistent)": "; ".join(persistent) or (
            f"{'enabled' if fp8_on else 'available'} (heads "
            f"{lse_heads}; {fp8})"),
    }
    return out

