"""Phase profile of the fused greedy walk (issue 20): where a bar's microseconds go.

    python benches/walk_profile.py [--bars 10000] [--precision bf16] [--n-features 125]
                                   [--variants barrier-1024,mbarrier-1024,...] [--timeout 180]

Builds ``cuda_src/walk.cu`` with ``-DWALK_PROFILE`` (the normal build compiles none of the
profile: see walk.cu's ``WALK_PROFILE`` comment), walks ``--bars`` bars of the seed network
(random weights as in ``conformance/specs/walk.py``, a random-walk price table) with
``greedy_walk_cluster`` (on sm_90 and newer) and ``greedy_walk``, reads the kernel's
``walk_profile`` global (thread 0 of block 0 adds the ``clock64()`` cycles of each phase of
every bar) and prints per phase the cycles and microseconds per bar (at the device's clock
rate; ``--clock-mhz`` overrides it) and its share of the bar. Also checks that the profiled
build's records equal the normal build's one-block kernel's, bit for bit (the profile only
reads the clock), and prints the test entry's wall time (it includes the tables' copies).

Variants of the cluster kernel (:data:`VARIANTS`), each built and run in its own process with
a ``--timeout`` (a variant that hangs is reported, not waited for): ``barrier-N`` is the
cluster barrier exchange (the normal build's) with N threads per block, ``mbarrier-N`` the
opt-in st.async / mbarrier exchange (``-DWALK_MBARRIER``); N = 1024 is the launch plan's;
``-c4``: clusters of 4 blocks instead of 8 (bf16 only: the f32 slices do not fit). The first
variant also profiles the one-block ``greedy_walk``.

Needs a GPU. Phases (walk.cu): ``layer l`` = warp 0's rows of layer l; ``sync after l`` = its
wait at the barrier after that layer (the cluster barrier in the cluster kernel): the slowest
warp's or block's lag plus the barrier's own latency; ``q rows``, ``q sync``, ``advance``
(actions, env step, next state row), ``advance sync``; ``top`` (next bar's prefetch hints).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

#: Variant name -> (extra NVRTC options, threads per block, blocks per cluster).
VARIANTS = {
    "barrier-1024": ((), 1024, 8),
    "mbarrier-1024": (("-DWALK_MBARRIER",), 1024, 8),
    "barrier-512": (("-DWALK_CLUSTER_THREADS=512",), 512, 8),
    "mbarrier-512": (("-DWALK_MBARRIER", "-DWALK_CLUSTER_THREADS=512"), 512, 8),
    "barrier-256": (("-DWALK_CLUSTER_THREADS=256",), 256, 8),
    "mbarrier-256": (("-DWALK_MBARRIER", "-DWALK_CLUSTER_THREADS=256"), 256, 8),
    "barrier-1024-c4": (("-DWALK_CLUSTER_SIZE=4",), 1024, 4),
    "mbarrier-1024-c4": (("-DWALK_MBARRIER", "-DWALK_CLUSTER_SIZE=4"), 1024, 4),
}
#: The sources a variant's build needs: walk.cu, and dense.cu for the test entry's BF16 mirror.
UNITS = ("walk.cu", "dense.cu")
SLOTS = 16
NAMES = {0: "layer s1", 1: "layer s2", 2: "layer heads' hidden", 3: "layer heads' out",
         4: "sync after s1", 5: "sync after s2", 6: "sync after hidden", 7: "sync after out",
         8: "q rows", 9: "q sync", 10: "advance", 11: "advance sync", 12: "top",
         14: "setup (once, whole walk)"}
BARS_SLOT = 13
SETUP_SLOT = 14
KERNEL_INDEX = {"greedy_walk": 0, "greedy_walk_cluster": 1}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bars", type=int, default=10_000, help="bars walked (default 10000)")
    p.add_argument("--precision", choices=("bf16", "f32"), default="bf16")
    p.add_argument("--n-features", type=int, default=125,
                   help="market features per bar (default 125: the seed state row's market part)")
    p.add_argument("--clock-mhz", type=float, default=None,
                   help="SM clock for cycles -> us (default: the device's reported clock rate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--timeout", type=float, default=180.0,
                   help="seconds per variant's process (default 180)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a variant's own process
    args = p.parse_args(argv)
    for v in args.variants.split(","):
        if v not in VARIANTS:
            p.error(f"--variants: {v!r} is not allowed; expected some of {', '.join(VARIANTS)}")
    return args


def walk_inputs(bars: int, precision: str, n_features: int, seed: int) -> dict:
    """The seed network (conformance/specs/walk.py's weights) on a ``bars + 4``-bar table."""
    from foxhunt.conformance.kernel_spec import case_dims
    from foxhunt.conformance.specs.walk import ENTRIES, FIRST_BAR
    from foxhunt.reference.config import DQNConfig

    config = DQNConfig.preset("seed", precision=precision)
    if not 1 <= n_features <= config.state_dim - 3:
        raise SystemExit(f"--n-features: {n_features} is not allowed; expected 1 .. "
                         f"{config.state_dim - 3} (the seed state row's market part)")
    rng = np.random.default_rng(seed)
    kwargs = ENTRIES[0].sample(case_dims("seed"), rng)
    T = bars + FIRST_BAR + 1
    close = (100.0 * np.exp(np.cumsum(rng.normal(0, 0.004, T)))).astype(np.float32)
    spread = np.abs(rng.normal(0, 0.003, T)) * close
    kwargs.update(bf16=precision == "bf16", close=close,
                  high=(close + spread).astype(np.float32), low=(close - spread).astype(np.float32),
                  features=rng.standard_normal((T, n_features)).astype(np.float32),
                  start=FIRST_BAR, n_steps=bars)
    return kwargs


def use_module(module) -> None:
    """Point the test entries' runtime (fast.kernels._runtime) at ``module``'s build."""
    from foxhunt.fast.device import Device
    from foxhunt.fast.kernels import _runtime

    rt = object.__new__(_runtime.Runtime)
    rt.device = _runtime._runtime.device if _runtime._runtime is not None else Device(0)
    rt.module = rt.device.load_module(module)
    rt.stream = rt.device.stream
    _runtime._runtime = rt


def read_profile(loaded) -> np.ndarray:
    """walk.cu's ``walk_profile`` global: [2 kernels, SLOTS] uint64."""
    from foxhunt.fast.device import _driver, call

    ptr, nbytes = call(_driver().cuModuleGetGlobal, loaded._handles["walk.cu"], b"walk_profile")
    out = np.zeros((2, SLOTS), np.uint64)
    assert nbytes == out.nbytes, (nbytes, out.nbytes)
    loaded.device.synchronize()
    loaded.device.copy_to_host(out, int(ptr))
    return out


def clock_mhz(device, override) -> float:
    if override is not None:
        return float(override)
    from foxhunt.fast.device import _driver, call

    drv = _driver()
    khz = call(drv.cuDeviceGetAttribute, drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE,
               device.handle)
    return khz / 1000.0


def report(name: str, row: np.ndarray, mhz: float, wall_s: float) -> None:
    bars = int(row[BARS_SLOT])
    per_bar = {s: row[s] / max(bars, 1) for s in NAMES if s != SETUP_SLOT}
    total = sum(per_bar.values())
    print(f"\n{name}: {bars} bars, clock {mhz:.0f} MHz, test-entry wall {wall_s * 1e3:.1f} ms "
          f"(with copies); profiled bar {total:.0f} cycles = {total / mhz:.2f} us")
    print(f"  {'phase':26s} {'cycles/bar':>11s} {'us/bar':>8s} {'share':>6s}")
    for s, c in per_bar.items():
        print(f"  {NAMES[s]:26s} {c:11.0f} {c / mhz:8.3f} {100 * c / max(total, 1):5.1f}%")
    print(f"  {NAMES[SETUP_SLOT]:26s} {float(row[SETUP_SLOT]):11.0f} "
          f"{float(row[SETUP_SLOT]) / mhz:8.3f}")


def run_variant(args) -> int:
    """One variant in this process: the normal build's one-block records, then the variant's
    profiled build (its kernels' records compared with them, bit for bit, and its profile)."""
    from foxhunt.fast._build import HEADER_SUFFIXES, compile_sources, source_files
    from foxhunt.fast.device import default_arch
    from foxhunt.fast.kernels import _runtime
    from foxhunt.fast.kernels import walk as fast_walk

    options, threads, cluster = VARIANTS[args.one]
    kwargs = walk_inputs(args.bars, args.precision, args.n_features, args.seed)
    arch = default_arch()
    sources = {n: b for n, b in source_files().items()
               if n in UNITS or n.endswith(HEADER_SUFFIXES)}
    use_module(compile_sources(arch, sources=sources))  # the normal build (of these units)
    reference = fast_walk.greedy_walk(**kwargs)  # its one-block kernel
    kernels = ["greedy_walk_cluster"] if fast_walk.cluster_size(arch) > 1 else []
    if args.one == next(iter(VARIANTS)):
        kernels.append("greedy_walk")
    use_module(compile_sources(arch, sources=sources,
                               extra_options=("-DWALK_PROFILE", *options)))
    fast_walk.CLUSTER_THREADS = threads  # the plan's block (its shared bytes suit any fewer)
    fast_walk.WALK_CLUSTER_SM90 = cluster  # the plan's grid and slices
    rt = _runtime.runtime()
    mhz = clock_mhz(rt.device, args.clock_mhz)
    for k in kernels:
        t0 = time.perf_counter()
        try:
            rec = fast_walk.KERNELS[k](**kwargs)
        except ValueError as exc:  # the slices do not fit this variant's blocks
            print(f"{args.one} {k}: not run: {exc}")
            continue
        wall = time.perf_counter() - t0
        same = all(a.tobytes() == b.tobytes() for a, b in zip(rec, reference))
        print(f"{args.one} {k}: records {'==' if same else '!= (WRONG)'} the normal one-block "
              f"kernel's, bit for bit")
        report(f"{args.one} {k}", read_profile(rt.module)[KERNEL_INDEX[k]], mhz, wall)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    from foxhunt.fast.device import cuda_available

    ok, why = cuda_available()
    if not ok:
        print(f"walk_profile needs a GPU: {why}", file=sys.stderr)
        return 2
    if args.one is not None:
        return run_variant(args)
    import subprocess

    failed = 0
    for v in args.variants.split(","):
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--one", v]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            print(done.stdout, end="")
            if done.returncode != 0:
                failed += 1
                print(f"{v}: FAILED (exit {done.returncode})\n{done.stderr[-3000:]}")
        except subprocess.TimeoutExpired:
            failed += 1
            print(f"{v}: TIMED OUT after {args.timeout:.0f} s (a hang: not usable)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
