"""What the bench prints and writes: the per-case table rows, auto's worst picks, the step notes,
the CSV rows and the plot."""

from __future__ import annotations

import torch

from .runners import backend_mode

HEADER = (f"{'case':<30} {'format':<12} {'backend':<9} {'us':>8} {'us_p90':>8} {'TFLOP/s':>7} {'GB/s':>6} {'floor':>7} "
          f"{'x_flr':>6} {'gather':>7} {'x_gth':>6} "
          f"{'fmla_api':>9} {'speedup':>7} {'fmla_raw':>9} {'speedup':>7}")


def _fmt_row(res: dict, name: str) -> str:
    r = res["backends"][name]
    cells = []
    for label in ("flashmla", "flashmla_raw"):
        fm = res.get(label, {})
        cells.append(f"{fm['us']:9.1f}" if "us" in fm else f"{'n/a':>9}")
        key = f"speedup_vs_{label}"
        cells.append(f"{r[key]:6.2f}x" if key in r else f"{'':>7}")
    return (f"{res['case']:<30} {res['format']:<12} {name:<9} {r['us']:8.1f} {r['us_p90']:8.1f} {r['tflops']:7.1f} "
            f"{r['gbps']:6.0f} {res['floor_us']:7.1f} {r['x_floor']:6.2f} {_cell(res.get('gather_us'), 7, 1)} "
            f"{_cell(r.get('x_gather'), 6, 2)} " + " ".join(cells))


def _cell(value: float | None, width: int, digits: int) -> str:
    """A number right-aligned in ``width`` columns, or n/a where the case has none."""
    return f"{value:{width}.{digits}f}" if value is not None else f"{'n/a':>{width}}"


def auto_gaps(results: list[dict]) -> list[tuple[float, float, str, str, str]]:
    """Per case timed with ``auto`` and named backends: (the backend auto picked, timed under its
    own name, vs the fastest named backend - 1; auto's own time vs that - 1, the same launches
    timed again: run-to-run spread; case; picked; fastest), worst pick first. A backend's time is
    its layer + its per-step work where measured (decode: a step of one layer of the case's kind,
    what auto orders the case's model by)."""
    gaps = []
    for r in results:
        rows = r.get("backends", {})
        named = {name: b for name, b in rows.items()  # auto chooses among backends, not modes
                 if name != "auto" and "us" in b and not backend_mode(name)[1]}
        cost = {name: b["us"] + b.get("per_step_us", 0.0) for name, b in named.items()}
        auto = rows.get("auto", {})
        if "us" in auto and named:
            best = min(cost, key=cost.__getitem__)
            picked = auto.get("picked", "?")
            pick_layer_us = named[picked]["us"] if picked in named else auto["us"]
            gaps.append((cost.get(picked, auto["us"]) / cost[best] - 1, auto["us"] / pick_layer_us - 1,
                         f"{r['case']} {r.get('format', '')}", picked, best))
    return sorted(gaps, reverse=True)


def print_auto_gaps(results: list[dict]) -> None:
    gaps = auto_gaps(results)
    if not gaps:
        return
    hits = sum(picked == best for *_, picked, best in gaps)
    print(f"auto picked the fastest backend in {hits} of {len(gaps)} cases; worst picks (the picked backend's time "
          "vs the fastest, decode: layer + per-step work; auto's own replay vs the picked backend's):")
    for gap, spread, case, picked, best in gaps[:10]:
        print(f"  {gap * 100:+6.1f} %  ({spread * 100:+5.1f} %)  {case:<40} auto -> {picked:<10} fastest {best}")


STEP_HEADER = (f"{'step (plan once + every layer)':<34} {'format':<12} {'backend':<9} {'us/step':>9} {'us_p90':>9} "
               f"{'us/layer':>8} {'written':>7} {'fmla_vllm':>10} {'speedup':>7}")


def _fmt_step_row(res: dict, name: str) -> str:
    r = res["backends"][name]
    fm = res.get("flashmla_vllm", {})
    vllm = f"{fm['us']:10.1f}" if "us" in fm else f"{'n/a':>10}"
    speedup = f"{r['speedup_vs_flashmla_vllm']:6.2f}x" if "speedup_vs_flashmla_vllm" in r else f"{'':>7}"
    label = f"{res['case']} ({res['layers']} layers)"
    return (f"{label:<34} {res['format']:<12} {name:<9} {r['us']:9.1f} {r['us_p90']:9.1f} {r['us_per_layer']:8.1f} "
            f"{r['layers_written']:>3}/{res['layers']:<3} {vllm} {speedup}")


def print_step_notes(res: dict) -> None:
    """What auto picked per layer kind, how FlashMLA was driven (or why not), and the largest
    difference of any layer from auto's outputs."""
    picked = ", ".join(f"{k} {b}" for k, b in res["backends"]["auto"]["picked"].items())
    print(f"  auto picked: {picked}; layers: {res['layer_kinds']}")
    fm = res.get("flashmla_vllm", {})
    if "unavailable" in fm:
        print(f"  FlashMLA as vLLM: {fm['unavailable'][:160]}")
    elif fm:
        print(f"  FlashMLA as vLLM: {fm['via']}; {fm['us_per_layer']:.1f} us/layer, {fm['layers_written']} layers "
              f"written, vs auto: worst layer rel_l2 {fm['vs_auto']['max_rel_l2']:.1e}")
    for name, r in res["backends"].items():
        if "vs_auto" in r:
            print(f"  {name} vs auto: worst layer rel_l2 {r['vs_auto']['max_rel_l2']:.1e}")


def step_auto_gaps(results: list[dict]) -> list[tuple[float, str, str]]:
    """Per whole step timed with auto and named backends: (auto's step vs the fastest named
    backend's - 1, case, that backend), worst first."""
    gaps = []
    for r in results:
        named = {name: b["us"] for name, b in r.get("backends", {}).items() if name != "auto" and "us" in b}
        auto = r.get("backends", {}).get("auto", {})
        if "us" in auto and named:
            best = min(named, key=named.__getitem__)
            gaps.append((auto["us"] / named[best] - 1, f"{r['case']} {r.get('format', '')}", best))
    return sorted(gaps, reverse=True)


def print_step_auto_gaps(results: list[dict]) -> None:
    gaps = step_auto_gaps(results)
    if gaps:
        print(f"whole steps: auto vs the fastest named backend (auto's own replay), worst {len(gaps[:5])} of "
              f"{len(gaps)}:")
        for gap, case, best in gaps[:5]:
            print(f"  {gap * 100:+6.1f} %  {case:<40} fastest {best}")


# One CSV row per (case, backend): the case's facts, then its timing (median, fastest, 90th
# percentile), rates against the floor, FlashMLA's timing beside it, and host µs per eager call (host_us).
# A step row (phase "step") times a whole decode step: its layers, µs per layer and FlashMLA driven as
# vLLM drives it beside it; no kind, keys or floor.
CSV_COLUMNS = ("case", "phase", "config", "kind", "format", "batch", "s_q_per_req", "heads", "tokens", "valid_keys",
               "layers", "backend", "timing", "runs", "us", "us_min", "us_p90", "us_per_layer", "tflops", "gbps",
               "floor_us", "x_floor", "gather_us", "x_gather", "flashmla_us", "flashmla_us_p90",
               "speedup_vs_flashmla", "flashmla_raw_us", "flashmla_raw_us_p90", "speedup_vs_flashmla_raw",
               "flashmla_vllm_us", "flashmla_vllm_us_p90", "speedup_vs_flashmla_vllm", "host_us", "error")


FLASHMLA_LABELS = ("flashmla", "flashmla_raw", "flashmla_vllm")


def csv_rows(results: list[dict]) -> list[dict]:
    """The results as CSV rows (``CSV_COLUMNS``; a failed case is one row with its error)."""
    rows = []
    for res in results:
        case = {k: res.get(k) for k in CSV_COLUMNS if k in res}
        if "error" in res:
            rows.append(case)
            continue
        for name, r in res["backends"].items():
            row = {**case, "backend": name, **{k: r.get(k) for k in CSV_COLUMNS if k in r}}
            for label in FLASHMLA_LABELS:
                fm = res.get(label, {})
                row[f"{label}_us"], row[f"{label}_us_p90"] = fm.get("us"), fm.get("us_p90")
            rows.append(row)
    return rows


def write_csv(results: list[dict], path: str) -> None:
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, restval="")
        writer.writeheader()
        writer.writerows(csv_rows(results))


def plot(results: list[dict], path: str, backend: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list[dict]] = {}
    for r in results:
        if r["phase"] == "decode":
            groups.setdefault((r["config"], r["format"], r["s_q_per_req"]), []).append(r)
    if not groups:
        return
    n = len(groups)
    cols = min(n, 4)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(4.5 * cols, 3.6 * ((n + cols - 1) // cols)),
                             squeeze=False)
    for ax, ((cfg, fmt, sq), rs) in zip(axes.flat, sorted(groups.items())):
        rs = sorted(rs, key=lambda r: r["batch"])
        bs = [r["batch"] for r in rs]
        ax.plot(bs, [r["backends"][backend]["us"] for r in rs], "o-", label=f"{backend} (ours)")
        for label, style, text in (("flashmla", "s-", "FlashMLA (API)"), ("flashmla_raw", "^:", "FlashMLA (raw op)")):
            fm = [(r["batch"], r[label]["us"]) for r in rs if "us" in r.get(label, {})]
            if fm:
                ax.plot([b for b, _ in fm], [u for _, u in fm], style, label=text)
        ax.plot(bs, [r["floor_us"] for r in rs], "k--", label="roofline floor")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (requests)")
        ax.set_ylabel("µs per layer")
        ax.set_title(f"{cfg} {fmt}, {sq} q/req")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_banner(meta: dict, cpu: bool, flushed: bool) -> None:
    """The run's facts before its first case: device, versions, ceilings and how it times."""
    if cpu:
        print("CPU run: the torch backend at small decode shapes, to try the tool and its outputs; the numbers say "
              "nothing about GPU kernels")
    ceilings = meta["ceilings"]
    print(f"device {meta['device']}" + (f" ({meta['sms']} SMs)" if meta["sms"] else "") +
          f", torch {torch.__version__}, triton {meta['triton']}; copy {ceilings['copy_bytes_per_s'] / 1e9:.0f} "
          f"GB/s, bf16 mm {ceilings['bf16_flops_per_s'] / 1e12:.2f} TFLOP/s; timing: "
          f"{'graph replay' if meta['graph'] else 'eager'}"
          f"{', L2 flushed' if flushed else ''}, median and p90 of {meta['reps']}")


def print_case(res: dict, backends: list[str]) -> None:
    """One finished case: its rows (a step: every backend it timed, and its notes), why FlashMLA
    did not run beside it, and the range checks' cost."""
    if res["phase"] == "step":
        for name in res["backends"]:
            print(_fmt_step_row(res, name), flush=True)
        print_step_notes(res)
    else:
        for name in backends:
            print(_fmt_row(res, name), flush=True)
    for label in ("flashmla", "flashmla_raw"):
        if "unavailable" in res.get(label, {}):
            print(f"  {label}: {res[label]['unavailable'][:160]}")
    for impl, g in res.get("guard_cost", {}).items():
        print(f"  range checks, {impl} kernel: {g['us_checked']:.1f} us with, {g['us_unchecked']:.1f} us without: "
              f"{g['cost_pct']:+.2f} % (same bits: {g['same_bits']})")
