"""The ``foxhunt`` command: ``info``, ``train``, ``eval``, ``sweep``, ``conformance``.

Each subcommand is a small function taking the parsed arguments and returning an exit code;
errors a user can fix (a missing CSV, a bad preset) print one clear line and exit with status
2, as argparse does for a bad option.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
from importlib import metadata

from .config import ADAPTIVE_ON, PRESETS, DQNConfig
from .layout import ParamLayout


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cuda_status() -> tuple[bool, str]:
    """(available, reason) from the fast path's own check; never raises."""
    try:
        fast = importlib.import_module("foxhunt.fast")
        return fast.cuda_available()
    except Exception as exc:  # the fast package itself failing to import is also "no CUDA"
        return False, f"foxhunt.fast unavailable: {exc}"


def cmd_info(args: argparse.Namespace) -> int:
    print(f"foxhunt {_version('foxhunt')} on Python {platform.python_version()} ({platform.machine()})")
    for dist in ("numpy", "torch", "safetensors", "cuda-bindings", "nvidia-cuda-nvrtc",
                 "nvmath-python"):
        print(f"  {dist:<18} {_version(dist)}")
    ok, reason = cuda_status()
    print(f"CUDA device: {'yes, ' + reason if ok else 'none (' + reason + ')'}")
    print("presets:")
    for name in PRESETS:
        cfg = DQNConfig.preset(name)
        lay = ParamLayout(cfg)
        print(f"  {name:<6} params={lay.total_params:,} (padded {lay.num_elements:,}) "
              f"B={cfg.batch_size} SD={cfg.state_dim} trunk={cfg.shared_h1}/{cfg.shared_h2} "
              f"heads={cfg.value_h}/{cfg.adv_h} atoms={cfg.num_atoms} branches={cfg.branches} "
              f"weight matrices={len(lay.weight_matrices)}")
        print(f"         {lay.counts_text()}")
        print(f"         {adaptive_text(cfg)}")
    return 0


def adaptive_text(cfg: DQNConfig) -> str:
    """``adaptive: <the ADAPTIVE_ON fields that are on>`` (or ``off``): the ISV mechanisms of
    issue 19 a config runs."""
    on = [name for name in ADAPTIVE_ON if getattr(cfg, name)]
    return f"adaptive: {', '.join(on) if on else 'off'}"


class FoxhuntParser(argparse.ArgumentParser):
    """The parser of ``foxhunt`` and (as its subparsers' class) of every subcommand: no
    abbreviated options (``--epoch`` must not silently mean ``--epochs``), and a usage error is
    one line on stderr with exit status 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = FoxhuntParser(prog="foxhunt", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--version", action="version", version=f"foxhunt {_version('foxhunt')}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=FoxhuntParser)
    p_info = sub.add_parser("info", help="versions, CUDA visibility, presets and parameter counts")
    p_info.set_defaults(func=cmd_info)
    for register in _EXTRA_COMMANDS:
        register(sub)
    return parser


#: Modules that add subcommands: each has ``register(subparsers)``; a module that is not
#: there (not written yet, or left out of an install) adds nothing.
EXTRA_COMMAND_MODULES = ("foxhunt.reference.train_cli", "foxhunt.reference.eval_cli",
                         "foxhunt.reference.sweep_cli", "foxhunt.conformance.cli")
_EXTRA_COMMANDS: list = []


def _load_extra_commands() -> None:
    if _EXTRA_COMMANDS:
        return  # main() may run more than once in a process (tests)
    for mod in EXTRA_COMMAND_MODULES:
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise
            continue
        if hasattr(module, "register"):
            _EXTRA_COMMANDS.append(module.register)


#: Set (to "1") by ``foxhunt sweep`` for the runs it starts: such a run asks the kernel to send it
#: SIGTERM when the process that started it (the trial's Ray worker) dies, so a worker that is
#: killed outright leaves no orphaned run on the GPU (Linux; elsewhere nothing happens).
DIE_WITH_PARENT_ENV = "FOXHUNT_DIE_WITH_PARENT"


def die_with_parent() -> None:
    """``prctl(PR_SET_PDEATHSIG, SIGTERM)`` for this process (Linux only), then exit at once
    if the parent is already gone (it may have died before the call)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import os
    import signal

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    import os

    if os.environ.get(DIE_WITH_PARENT_ENV) == "1":
        die_with_parent()
    _load_extra_commands()
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
