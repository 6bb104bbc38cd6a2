"""Turn a saved pytest-benchmark JSON into a Markdown report and a PNG bar chart.

    python -m pytest benches/ --benchmark-json=bench.json
    python benches/report.py bench.json [scaling.json ...] --md bench.md --png bench.png

The report (all numbers from the one run in the JSON):

- the run: date, GPU, driver, library versions, CPU, quick/full mode, commit;
- the headline per precision: the fast step, the best PyTorch mode, the reference step and the
  ratios between them;
- one table per step / epoch workload group (``step-seed-bf16``, ``epoch-seed-f32``, ...): each
  implementation's median and minimum time, GPU event time, "fast speedup" = that
  implementation's median / the fast median (fast vs each peer, fast vs the reference), GEMM
  TFLOP/s and graph nodes;
- scaling tables (step time vs batch size and trunk width, fast vs the best peer);
- the kernel table (reference on the CPU vs fast on the GPU) and the GEMM table.

Rows are identified by ``extra_info["impl"]`` (``fast``, ``reference``, ``torch-<mode>``,
``torch-eager-cpu``; the benchmark name when absent).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

FAST = "fast"
REFERENCE = "reference"
COLORS = {"fast": "tab:red", "torch": "tab:blue", "cpu": "tab:gray"}


# ------------------------------------------------------------------------------ loading
def load(path: str | Path) -> dict:
    with open(path) as fh:
        data = json.load(fh)
    if "benchmarks" not in data:
        raise ValueError(f"{path}: not a pytest-benchmark JSON (no 'benchmarks' key)")
    return data


def impl_of(bench: dict) -> str:
    return bench.get("extra_info", {}).get("impl") or bench["name"]


def median(bench: dict) -> float:
    return float(bench["stats"]["median"])


def by_group(data: dict) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for bench in data["benchmarks"]:
        groups[bench.get("group") or bench["name"]].append(bench)
    for rows in groups.values():
        rows.sort(key=median)
    return dict(groups)


def is_torch_gpu(impl: str) -> bool:
    return impl.startswith("torch-") and not impl.endswith("-cpu")


# ------------------------------------------------------------------------------ formatting
def fmt_time(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "–"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if abs(seconds) >= scale or unit == "ns":
            value = seconds / scale
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    return "–"


def fmt_ratio(ratio: float | None) -> str:
    if ratio is None or not math.isfinite(ratio):
        return "–"
    if ratio < 10:
        return f"{ratio:.2f}x"
    return f"{ratio:.3g}x" if ratio < 1000 else f"{ratio:,.0f}x"


def fmt_num(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, (int, float)):
        return f"{value:.{digits}g}" if isinstance(value, float) else str(value)
    if isinstance(value, dict):
        return " + ".join(f"{v}" for v in value.values()) + f" ({', '.join(map(str, value))})"
    if isinstance(value, list):
        return " + ".join(map(str, value))
    return str(value)


def gpu_s(bench: dict) -> float | None:
    us = bench.get("extra_info", {}).get("gpu_us")
    return None if us is None else float(us) * 1e-6


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def find(rows: list[dict], impl: str) -> dict | None:
    return next((b for b in rows if impl_of(b) == impl), None)


# ------------------------------------------------------------------------------ sections
def run_line(data: dict) -> str:
    mi = data.get("machine_info", {})
    fx = mi.get("foxhunt", {})
    ci = data.get("commit_info", {})
    parts = [f"run {data.get('datetime', '?')}"]
    parts.append(f"GPU: {fx.get('gpu', 'none')}")
    if fx.get("driver"):
        parts.append(f"driver: {fx['driver']}")
    versions = [f"{name} {fx[name]}" for name in ("torch", "cuda-bindings", "nvmath-python", "numpy",
                                                  "pytest-benchmark") if fx.get(name)]
    if fx.get("torch_cuda"):
        versions.append(f"torch CUDA {fx['torch_cuda']}")
    if versions:
        parts.append(", ".join(versions))
    parts.append(f"Python {fx.get('python') or mi.get('python_version', '?')}")
    cpu = mi.get("cpu", {})
    parts.append(f"CPU: {cpu.get('brand_raw', mi.get('processor', '?'))} ({fx.get('cpu_count', '?')} cores)")
    parts.append("mode: " + ("full" if fx.get("full_mode") else "quick"))
    if ci.get("id"):
        parts.append(f"commit {ci['id'][:10]}{' (dirty)' if ci.get('dirty') else ''}")
    return " · ".join(parts)


def headline(groups: dict[str, list[dict]]) -> list[str]:
    rows = []
    for name in sorted(groups):
        if not name.startswith(("step-", "epoch-")):
            continue
        benches = groups[name]
        fast = find(benches, FAST)
        peers = [b for b in benches if is_torch_gpu(impl_of(b))]
        best = min(peers, key=median) if peers else None
        ref = find(benches, REFERENCE)
        if fast is None and best is None:
            continue
        f = median(fast) if fast else None
        rows.append([
            name,
            fmt_time(f),
            f"{fmt_time(median(best))} ({impl_of(best)})" if best else "–",
            fmt_ratio(median(best) / f) if best and f else "–",
            fmt_time(median(ref)) if ref else "–",
            fmt_ratio(median(ref) / f) if ref and f else "–",
        ])
    if not rows:
        return []
    return ["## Headline", "",
            "Ratios are medians from this one run; \"x\" = how many times faster the fast path is.", "",
            *table(["workload", "fast", "best PyTorch (GPU)", "fast vs best PyTorch",
                    "reference (CPU)", "fast vs reference"], rows), ""]


def workload_tables(groups: dict[str, list[dict]], prefix: str, title: str) -> list[str]:
    names = sorted(n for n in groups if n.startswith(prefix))
    if not names:
        return []
    out = [f"## {title}", ""]
    for name in names:
        benches = groups[name]
        fast = find(benches, FAST)
        rows = []
        for b in benches:
            info = b.get("extra_info", {})
            nodes = info.get("graph_nodes")
            ops = info.get("device_ops_per_step")
            rows.append([
                f"**{impl_of(b)}**" if impl_of(b) == FAST else impl_of(b),
                info.get("device", "?"),
                fmt_time(median(b)),
                fmt_time(float(b["stats"]["min"])),
                fmt_time(gpu_s(b)),
                fmt_ratio(median(b) / median(fast)) if fast else "–",
                fmt_num(info.get("gemm_tflops")),
                fmt_num(nodes) if nodes is not None else (f"{ops} ops" if ops is not None else "–"),
                f"{b['stats']['rounds']} x {b['stats']['iterations']}",
            ])
        unit = benches[0].get("extra_info", {}).get("unit", "call")
        out += [f"### {name} (per {unit})", "",
                *table(["implementation", "device", "median", "min", "GPU time", "fast speedup",
                        "GEMM TFLOP/s", "graph nodes", "rounds x iters"], rows), ""]
    return out


def scaling_tables(groups: dict[str, list[dict]]) -> list[str]:
    points: dict[str, dict[int, list[dict]]] = defaultdict(dict)
    for name, benches in groups.items():
        info = benches[0].get("extra_info", {})
        if "scaling_axis" in info:
            points[info["scaling_axis"]][int(info["scaling_value"])] = benches
    if not points:
        return []
    out = ["## Scaling (step time; where it stops being flat, the step stops being launch-bound)", ""]
    labels = {"batch": "batch size B", "width": "trunk width SH1 = SH2"}
    for axis in sorted(points):
        values = sorted(points[axis])
        peer_impls = sorted({impl_of(b) for v in values for b in points[axis][v] if impl_of(b) != FAST})
        base: dict[str, float] = {}
        rows = []
        for v in values:
            benches = points[axis][v]
            fast = find(benches, FAST)
            row = [str(v)]
            for impl in [FAST, *peer_impls]:
                b = find(benches, impl)
                if b is not None:
                    base.setdefault(impl, median(b))
                row += [fmt_time(median(b)) if b else "–",
                        fmt_num(b.get("extra_info", {}).get("gemm_tflops")) if b else "–",
                        fmt_ratio(median(b) / base[impl]) if b else "–"]
            for impl in peer_impls:
                b = find(benches, impl)
                row.append(fmt_ratio(median(b) / median(fast)) if b and fast else "–")
            rows.append(row)
        header = [labels.get(axis, axis)]
        for impl in [FAST, *peer_impls]:
            header += [impl, f"{impl} TFLOP/s", f"{impl} vs first point"]
        header += [f"fast vs {impl}" for impl in peer_impls]
        out += [f"### {labels.get(axis, axis)}", "", *table(header, rows), ""]
    return out


def kernel_table(groups: dict[str, list[dict]]) -> list[str]:
    names = sorted(n for n in groups if n.startswith("kernel-"))
    if not names:
        return []
    rows = []
    for name in names:
        benches = groups[name]
        ref, fast = find(benches, REFERENCE), find(benches, FAST)
        fast_gpu = gpu_s(fast) if fast else None
        launches = fast.get("extra_info", {}).get("launches") if fast else None
        rows.append([
            name.removeprefix("kernel-"),
            fmt_time(median(ref)) if ref else "–",
            fmt_time(median(fast)) if fast else "–",
            fmt_time(fast_gpu),
            fmt_ratio(median(ref) / fast_gpu) if ref and fast_gpu else "–",
            str(len(launches)) if launches else "–",
        ])
    return ["## Kernels (`seed` shapes)", "",
            "Fast: launch + stream sync from Python (median) and device time per call (CUDA "
            "events around a graph of 100 calls).", "",
            *table(["kernel", "reference (CPU)", "fast launch+sync", "fast GPU time",
                    "reference / fast GPU", "launches"], rows), ""]


def gemm_table(groups: dict[str, list[dict]]) -> list[str]:
    names = sorted((n for n in groups if n.startswith("gemm-")),
                   key=lambda n: (groups[n][0].get("extra_info", {}).get("gflop", 0), n))
    if not names:
        return []
    rows = []
    for name in names:
        benches = groups[name]
        fast, torch_, ref = find(benches, FAST), find(benches, "torch"), find(benches, REFERENCE)
        rows.append([
            name.removeprefix("gemm-"),
            fmt_time(gpu_s(fast)) if fast else "–",
            fmt_num(fast["extra_info"].get("gemm_tflops")) if fast else "–",
            fmt_time(gpu_s(torch_)) if torch_ else "–",
            fmt_num(torch_["extra_info"].get("gemm_tflops")) if torch_ else "–",
            fmt_time(median(ref)) if ref else "–",
        ])
    return ["## GEMMs (device time per GEMM from a CUDA graph of 100)", "",
            *table(["m x n x k - precision", "fast (cuBLASLt plan)", "fast TFLOP/s", "torch.mm",
                    "torch TFLOP/s", "reference (CPU)"], rows), ""]


def render_markdown(data: dict) -> str:
    groups = by_group(data)
    lines = ["# foxhunt benchmarks", "", run_line(data), ""]
    lines += headline(groups)
    lines += workload_tables(groups, "step-", "Training step")
    lines += workload_tables(groups, "epoch-", "Epoch (300 steps + epoch-end readback)")
    lines += scaling_tables(groups)
    lines += kernel_table(groups)
    lines += gemm_table(groups)
    return "\n".join(lines).rstrip() + "\n"


# ------------------------------------------------------------------------------ chart
def plot(data: dict, path: str | Path) -> Path:
    """Horizontal bars (log time axis) of every step and epoch group; scaling curves if any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ms_format = FuncFormatter(lambda v, _: fmt_time(v * 1e-3))

    def time_axis(axis) -> None:  # log scale, ticks labelled as times
        axis.set_major_formatter(ms_format)
        axis.set_minor_formatter(NullFormatter())

    groups = by_group(data)
    panels = [n for n in sorted(groups) if n.startswith(("step-", "epoch-"))]
    scaling = scaling_points(groups)
    count = len(panels) + len(scaling)
    if count == 0:
        raise ValueError("no step, epoch or scaling benchmarks in this JSON: nothing to plot")
    cols = 2 if count > 1 else 1
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 3.2 * rows), squeeze=False)
    flat = list(axes.ravel())
    for ax, name in zip(flat, panels):
        benches = groups[name]
        labels = [impl_of(b) for b in benches]
        values = [median(b) * 1e3 for b in benches]
        colors = [COLORS["fast"] if lab == FAST else COLORS["cpu"] if lab == REFERENCE or lab.endswith("-cpu")
                  else COLORS["torch"] for lab in labels]
        ax.barh(labels, values, color=colors)
        ax.set_xscale("log")
        ax.set_xlim(min(values) / 3, max(values) * 6)  # bars from a common origin a decade left
        time_axis(ax.xaxis)
        ax.invert_yaxis()
        ax.set_xlabel("median time (log scale)")
        ax.set_title(name)
        for y, v in enumerate(values):
            ax.text(v, y, f" {fmt_time(v * 1e-3)}", va="center", fontsize=8)
    for ax, (axis, series) in zip(flat[len(panels):], scaling.items()):
        for impl, pts in sorted(series.items()):
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, [y * 1e3 for y in ys], marker="o", label=impl,
                    color="tab:red" if impl == FAST else None)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({x for pts in series.values() for x, _ in pts}))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        time_axis(ax.yaxis)
        ax.set_xlabel({"batch": "batch size", "width": "trunk width"}.get(axis, axis))
        ax.set_ylabel("step time (median)")
        ax.set_title(f"scaling: {axis}")
        ax.legend(fontsize=8)
    for ax in flat[count:]:
        ax.axis("off")
    fig.legend(handles=[Patch(color=c, label=lab) for lab, c in
                        (("fast (GPU)", COLORS["fast"]), ("PyTorch (GPU)", COLORS["torch"]),
                         ("CPU", COLORS["cpu"]))], loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(run_line(data)[:160], fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def scaling_points(groups: dict[str, list[dict]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    out: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for benches in groups.values():
        for b in benches:
            info = b.get("extra_info", {})
            if "scaling_axis" in info:
                out[info["scaling_axis"]][impl_of(b)].append((int(info["scaling_value"]), median(b)))
    return {axis: dict(series) for axis, series in out.items()}


# ------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+",
                        help="pytest-benchmark JSON (--benchmark-json=...); several are merged "
                             "(e.g. the main run and a separate scaling run; the run line is the first's)")
    parser.add_argument("--md", help="write the Markdown report here (default: stdout)")
    parser.add_argument("--png", help="write the bar chart here")
    args = parser.parse_args(argv)
    data = load(args.json[0])
    for extra in args.json[1:]:
        data["benchmarks"] = data["benchmarks"] + load(extra)["benchmarks"]
    text = render_markdown(data)
    if args.md:
        Path(args.md).write_text(text)
        print(f"wrote {args.md}")
    else:
        sys.stdout.write(text)
    if args.png:
        print(f"wrote {plot(data, args.png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
