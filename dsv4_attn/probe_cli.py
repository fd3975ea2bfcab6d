"""`dsv4-attn probe`: what this machine offers dsv4_attn (collect-env style).

Prints the platform (vendor, arch, device, torch / CUDA / HIP / Triton versions, fp8 dialect),
the vendor libraries found (version, location), what each vendor backend module says about
its binary (which FlashMLA library loaded, which AITER build), and for one model shape
(``--heads``, ``--format``, ``--topk``) which backend runs each layer kind and phase, and
why the backends ahead of it in the priority list were passed over, followed by
``SparseMLA.explain()``. ``--json`` prints the same facts as one JSON object.

Never raises on a machine without a GPU or vendor libraries: every failure becomes text.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform as _pyplatform
import sys

import torch

from . import envs
from .cli import check_environment, parse_device
from .common import backend as backend_mod
from .common.backend import BackendUnavailableError, Phase
from .common.checks import resolve_device
from .common.layout import KVFormat
from .common.platform import platform_for_device, probe
from .common.spec import LayerKind, ModelSpec


def _flashmla(plat) -> dict:
    from .cuda.flashmla import load_flashmla  # loads the library only when this is asked

    lib = load_flashmla()
    return {"loaded": lib.ops is not None, "source": lib.source, "version": lib.version, "location": lib.location,
            "summary": lib.describe()}


def _flashinfer(plat) -> dict | str:
    cap = plat.capability
    if cap is None or cap[0] < 10:  # load_flashinfer imports flashinfer: only where its kernels can run
        return f"not loaded: the TRTLLM-gen DSv4 kernels need an NVIDIA SM100-family GPU (this is {plat.arch})"
    from .cuda.flashinfer import load_flashinfer

    fn, version, reasons = load_flashinfer()
    return {"usable": fn is not None, "version": version, "reasons": list(reasons)}


def _aiter(plat) -> dict:
    from .rocm.aiter import describe_aiter  # never imports aiter off ROCm

    return describe_aiter(plat)


# What each vendor backend module says about its binary.
_DESCRIBERS = {"flashmla": ("dsv4_attn.cuda.flashmla", _flashmla),
               "flashinfer": ("dsv4_attn.cuda.flashinfer", _flashinfer),
               "aiter": ("dsv4_attn.rocm.aiter", _aiter)}


def describe_vendor(key: str, plat) -> dict:
    """What vendor module ``key`` reports about its binary: {"module", "status", "info"}; status
    is ok, absent (module not in this build) or error (the message says what failed)."""
    module_name, describer = _DESCRIBERS[key]
    try:
        return {"module": module_name, "status": "ok", "info": _jsonable(describer(plat))}
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return {"module": module_name, "status": "absent", "info": "module not in this dsv4_attn build"}
        return {"module": module_name, "status": "error", "info": f"{type(exc).__name__}: {exc}"}
    except Exception as exc:  # the probe never raises
        return {"module": module_name, "status": "error", "info": f"{type(exc).__name__}: {exc}"}


def _jsonable(value):
    """A describer's result as JSON-able data (dataclasses and odd objects become strings)."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        if isinstance(value, dict):
            return {str(k): _jsonable(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [_jsonable(v) for v in value]
        return str(value)


def engine_plugin(engine: str) -> dict[str, str]:
    """An engine plugin's state (``dsv4_attn.integrations.<engine>.status()``, "vllm" or "sglang";
    imports no engine code)."""
    try:
        status = importlib.import_module(f"{__package__}.integrations.{engine}").status
    except ModuleNotFoundError:
        return {f"{engine} plugin": "module not in this dsv4_attn build"}
    try:
        return status()
    except Exception as exc:  # the probe never raises
        return {f"{engine} plugin": f"error: {type(exc).__name__}: {exc}"}


def choose(spec: ModelSpec, fmt: KVFormat, device: torch.device) -> dict:
    """Per layer kind and phase: the backend that runs it and why ({"backend", "source",
    "passed_over": {name: reasons}} or {"error": text})."""
    plat = platform_for_device(device)
    requested, source = backend_mod.requested_backend()
    out: dict[str, dict] = {}
    for kind in spec.kinds:
        for phase in Phase:
            key = f"{kind.name}/{phase.value}"
            try:
                name = backend_mod.select(plat, spec, fmt, kind, phase, requested, source)
            except (BackendUnavailableError, ValueError) as exc:
                out[key] = {"error": str(exc)}
                continue
            if name == requested:
                out[key] = {"backend": name, "source": f"forced by {source}", "passed_over": {}}
                continue
            why = f"auto ({plat.vendor} {phase.value} priority list)"
            if requested != "auto":
                why += f"; the forced {requested!r} does not implement {phase.value}"
            passed: dict[str, list[str]] = {}
            for cand in backend_mod.priority_for(plat, phase):
                if cand == name:
                    break
                passed[cand] = backend_mod.reasons_for(cand, plat, spec, fmt, kind, phase)
            out[key] = {"backend": name, "source": why, "passed_over": passed}
    return out


def explain(spec: ModelSpec, fmt: KVFormat, device: torch.device) -> str:
    from .api import SparseMLA

    try:
        return SparseMLA(spec, fmt, device=device, max_tokens=1, max_reqs=1).explain()
    except Exception as exc:  # e.g. a forced backend that cannot run here: its message lists why
        return f"SparseMLA could not be built: {type(exc).__name__}: {exc}"


def collect(heads: int = 64, fmt: str = "fp8_ds_mla", topk: int = 512, max_model_len: int = 65536,
            device: str | None = None) -> dict:
    """Every fact `dsv4-attn probe` prints, as JSON-able data."""
    from . import __version__

    dev = resolve_device(device)
    plat = platform_for_device(dev)
    base = probe()
    spec = ModelSpec(num_heads=heads, topk=topk, max_model_len=max_model_len)
    kv_format = KVFormat.parse(fmt)
    facts = plat.as_dict()
    libraries = facts.pop("libraries")
    backends = {}
    for name in backend_mod.backend_names():
        instance = backend_mod.get_backend(name)
        backends[name] = {"importable": instance is not None,
                          "error": None if instance is not None else
                          backend_mod.reasons_for(name, plat, spec, kv_format, LayerKind.SWA, Phase.DECODE)[0],
                          "phases": [p.value for p in instance.phases] if instance is not None else []}
    return {
        "dsv4_attn": __version__,
        "python": sys.version.split()[0],
        "os": _pyplatform.platform(),
        "device": str(dev),
        "gpu_visible": base.is_gpu,
        "platform": facts,
        "libraries": libraries,
        "vendor_binaries": {key: describe_vendor(key, plat) for key in _DESCRIBERS},
        "backends": backends,
        "vllm_plugin": engine_plugin("vllm"),
        "sglang_plugin": engine_plugin("sglang"),
        "env": envs.table(),
        "selection": {"heads": heads, "format": kv_format.value, "topk": topk,
                      "max_model_len": max_model_len, "choices": choose(spec, kv_format, dev)},
        "explain": explain(spec, kv_format, dev),
    }


def render(info: dict) -> str:
    p = info["platform"]
    lines = [
        f"dsv4-attn {info['dsv4_attn']} probe",
        f"platform   {p['vendor']}/{p['arch']}  {p['device_name']}"
        + (f", {p['num_sms']} SMs/CUs" if p.get("num_sms") else "") + f", fp8 dialect {p['fp8_dialect']}",
        f"device     {info['device']} (GPU visible to torch: {'yes' if info['gpu_visible'] else 'no'})",
        f"torch      {p['torch_version']} (CUDA {p['cuda_version'] or '-'}, HIP {p['hip_version'] or '-'}), "
        f"triton {p['triton_version'] or '-'}",
        f"python     {info['python']} on {info['os']}",
        "",
        "environment (dsv4_attn's variables, then other projects' that matter here)",
        f"  {'name':<37} {'value':<12} {'default':<8} meaning",
        *(f"  {v['name']:<37} {v['value'] or '-':<12} {v['default'] or '-':<8} {v['meaning']}" for v in info["env"]),
        "",
        "libraries",
        f"  {'name':<14} {'found':<6} {'version':<22} location",
    ]
    for name, lib in info["libraries"].items():
        extra = lib.get("location") or lib.get("note") or ""
        if lib.get("location") and lib.get("note"):
            extra += f" ({lib['note']})"
        lines.append(f"  {name:<14} {'yes' if lib['found'] else 'no':<6} {lib.get('version') or '-':<22} {extra}")
    lines += ["", "vendor binaries (what each vendor backend found to run on)"]
    for key, desc in info["vendor_binaries"].items():
        first, *more = vendor_text(key, desc, info["libraries"])
        lines.append(f"  {key:<11} {first}")
        lines += [f"  {'':<11} {line}" for line in more]
    for engine in ("vllm", "sglang"):
        lines += ["", f"{engine} plugin"] + [f"  {k:<17} {v}" for k, v in info[f"{engine}_plugin"].items()]
    lines += ["", "backends (registered; whether each can run here is under backend choice and explain())"]
    for name, b in info["backends"].items():
        state = f"implements {', '.join(b['phases'])}" if b["importable"] else f"cannot be imported: {b['error']}"
        lines.append(f"  {name:<18} {state}")
    sel = info["selection"]
    lines += ["", f"backend choice for {sel['heads']} heads, {sel['format']}, top-k {sel['topk']}, "
                  f"max_model_len {sel['max_model_len']} on {info['device']}"]
    for key, choice in sel["choices"].items():
        if "error" in choice:
            lines.append(f"  {key:<16} none: {_one_line(choice['error'])}")
            continue
        lines.append(f"  {key:<16} {choice['backend']:<18} ({choice['source']})")
        for name, reasons in choice["passed_over"].items():
            lines.append(f"  {'':<16}   passed over {name}: {'; '.join(reasons)}")
    lines += ["", "explain()", info["explain"]]
    return "\n".join(lines) + "\n"


def vendor_text(key: str, desc: dict, libraries: dict) -> list[str]:
    """A vendor's section of the probe in words: first line a status (loaded, usable, not
    found, not used, ...), then details; every reason once, no raw None / False."""
    body = desc["info"]
    if desc["status"] == "absent":
        return ["module not in this dsv4_attn build"]
    if desc["status"] == "error":
        return [f"the probe failed: {_one_line(body)}"]
    return _VENDOR_TEXT[key](body, libraries)


def _flashmla_text(info: dict, libraries: dict) -> list[str]:
    if info["loaded"]:
        return [f"loaded: {_one_line(info['summary'])}"]
    return ["not found: " + _one_line(info["summary"]).removeprefix("FlashMLA not loaded: ")]


def _flashinfer_text(info, libraries: dict) -> list[str]:
    lib = libraries.get("flashinfer", {})
    found = f"flashinfer-python {lib.get('version')} installed; " if lib.get("found") else ""
    if isinstance(info, str):  # not loaded on this platform
        return [f"not used: {found}" + info.removeprefix("not loaded: ")]
    if info["usable"]:
        return [f"usable: flashinfer-python {info['version']} with its TRTLLM-gen DSv4 kernel"]
    return [f"not usable: {found}" + "; ".join(info["reasons"])]


def _aiter_text(info: dict, libraries: dict) -> list[str]:
    lib = libraries.get("aiter", {})
    if not info["found"]:
        where = (f"AITER {lib.get('version') or '(version unknown)'} installed at {lib.get('location')}; "
                 if lib.get("found") else "")
        return [f"not usable: {where}{_one_line(info['error'])}"]
    emulated = ", EMULATED" if info["emulated"] else ""
    lines = [f"found: AITER {info['version']} on {info['arch']} (fp8 dialect {info['dialect']}{emulated})"]
    enabled = [f"{path} ({status.removeprefix('enabled').strip(' ()')})" if status != "enabled" else path
               for path, status in info["paths"].items() if status.startswith("enabled")]
    lines.append(f"serves: {', '.join(enabled) or 'nothing'}")
    lacking: dict[str, list[str]] = {}  # reason -> paths, so that each reason is printed once
    for path, status in info["paths"].items():
        if not status.startswith("enabled"):
            lacking.setdefault(status, []).append(path)
    lines += [f"lacks ({', '.join(paths)}): {_one_line(why)}" for why, paths in lacking.items()]
    if lacking:
        lines.append('what each AITER version has: docs/rocm.md "Install AITER"')
    return lines


_VENDOR_TEXT = {"flashmla": _flashmla_text, "flashinfer": _flashinfer_text, "aiter": _aiter_text}


def _one_line(value) -> str:
    if isinstance(value, (list, tuple)):
        return "; ".join(map(str, value)) or "-"
    return " ".join(str(value).split())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv4-attn probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=64, help="query heads per rank (default 64, V4-Flash)")
    parser.add_argument("--format", default="fp8_ds_mla", help="KV format: fp8_ds_mla, bfloat16, fp8_e4m3")
    parser.add_argument("--topk", type=int, default=512, help="the indexer's top-k width (default 512)")
    parser.add_argument("--max-model-len", type=int, default=65536, help="longest sequence (default 65536)")
    parser.add_argument("--device", help="device the backends would run on: cpu or cuda[:N] (default: cuda when "
                        "torch sees a GPU); a GPU torch cannot see is an error")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    try:
        check_environment()
        if args.device:
            parse_device(args.device)
        info = collect(args.heads, args.format, args.topk, args.max_model_len, args.device)
    except (ValueError, RuntimeError) as exc:  # bad variables / --heads / --format / --device
        print(f"dsv4-attn probe: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=1) if args.json else render(info), end="\n" if args.json else "")
    return 0
