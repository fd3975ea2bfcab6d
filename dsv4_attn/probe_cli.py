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
from .common import registry
from .common.backend import BackendUnavailableError, Phase
from .common.checks import resolve_device
from .common.layout import KVFormat
from .common.platform import platform_for_device, probe
from .common.spec import LayerKind, ModelSpec


def describe_vendor(name: str, plat) -> dict | None:
    """What backend ``name`` reports about its vendor binary (``Backend.describe_binary``):
    {"module", "status", "info", "text"}; status is ok, absent (module not in this build) or error
    (the message says what failed); None for a backend with no binary of its own."""
    backend = registry.get_backend(name)
    if backend is None:
        why = registry.import_error(name)
        absent = "No module named 'dsv4_attn" in why  # a vendor directory left out of this build
        return {"module": registry.module_of(name), "status": "absent" if absent else "error",
                "info": "module not in this dsv4_attn build" if absent else why,
                "text": ["module not in this dsv4_attn build" if absent else f"the probe failed: {_one_line(why)}"]}
    try:
        described = backend.describe_binary(plat)
        if described is None:
            return None
        info, text = described
        return {"module": type(backend).__module__, "status": "ok", "info": _jsonable(info), "text": list(text)}
    except Exception as exc:  # the probe never raises
        why = f"{type(exc).__name__}: {exc}"
        return {"module": type(backend).__module__, "status": "error", "info": why,
                "text": [f"the probe failed: {_one_line(why)}"]}


def vendor_binaries(plat) -> dict[str, dict]:
    """Per packaged backend that has a vendor binary: what it found (``describe_vendor``)."""
    out = {}
    for name in registry.PACKAGED:
        desc = describe_vendor(name, plat)
        if desc is not None:
            out[name] = desc
    return out


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
    requested, source = registry.requested_backend()
    out: dict[str, dict] = {}
    for kind in spec.kinds:
        for phase in Phase:
            key = f"{kind.name}/{phase.value}"
            try:
                name = registry.select(plat, spec, fmt, kind, phase, requested, source)
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
            for cand in registry.priority_for(plat, phase):
                if cand == name:
                    break
                passed[cand] = registry.reasons_for(cand, plat, spec, fmt, kind, phase)
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
    for name in registry.backend_names():
        instance = registry.get_backend(name)
        backends[name] = {"importable": instance is not None,
                          "error": None if instance is not None else
                          registry.reasons_for(name, plat, spec, kv_format, LayerKind.SWA, Phase.DECODE)[0],
                          "phases": [p.value for p in instance.phases] if instance is not None else []}
    return {
        "dsv4_attn": __version__,
        "python": sys.version.split()[0],
        "os": _pyplatform.platform(),
        "device": str(dev),
        "gpu_visible": base.is_gpu,
        "platform": facts,
        "libraries": libraries,
        "vendor_binaries": vendor_binaries(plat),
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
        first, *more = desc["text"]
        lines.append(f"  {key:<17} {first}")
        lines += [f"  {'':<17} {line}" for line in more]
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
