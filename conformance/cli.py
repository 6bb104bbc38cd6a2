"""``foxhunt conformance [--quick|--full] [--json PATH]``: run the conformance suite on this
machine, print the table and the device, optionally write the JSON report.

``run_conformance`` runs pytest programmatically on this package (the same suite as
``pytest conformance/``) with :class:`foxhunt.conformance.report.ResultsCollector` as a
plugin. Without a GPU it says so up front and runs only the reference self-checks: every
GPU case skips with its reason. The exit code is pytest's (0 when everything that ran passed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence, TextIO

MODES = ("quick", "full")


def conformance_dir() -> Path:
    """The directory of this package (a source checkout's ``conformance/`` or the installed one)."""
    return Path(__file__).resolve().parent


def run_conformance(mode: str = "full", json_path: str | Path | None = None, *,
                    pytest_args: Sequence[str] = (), out: TextIO | None = None) -> int:
    """Run the suite in ``mode`` (``"quick"``: without the seed-size cases; ``"full"``), print
    the table, write the JSON report to ``json_path`` if given, return pytest's exit code."""
    import pytest

    from foxhunt.conformance import registry
    from foxhunt.conformance.report import (
        ResultsCollector,
        aggregate,
        build_report,
        describe_device,
        device_info,
        format_table,
        write_json,
    )

    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not allowed; expected one of {MODES}")
    out = sys.stdout if out is None else out
    device = device_info()
    if not device["available"]:
        print(f"foxhunt conformance: no CUDA device ({device['reason']}).\n"
              "Running the reference self-checks only; every GPU case is skipped.", file=out)
    else:
        print(f"foxhunt conformance ({mode}) on {describe_device(device)}", file=out)
    problems = registry.consistency_problems()
    collector = ResultsCollector()
    # This process imported hypothesis (the registry) before pytest could rewrite it: harmless.
    args = [str(conformance_dir()), "-q", "-p", "no:cacheprovider", f"--conformance-mode={mode}",
            "-W", "ignore::pytest.PytestAssertRewriteWarning", *pytest_args]
    exit_code = int(pytest.main(args, plugins=[collector]))
    report = build_report(collector.records, mode=mode, exit_code=exit_code, device=device,
                          kernels=list(registry.SPECS), problems=problems)
    print("", file=out)
    print(format_table(aggregate(collector.records), device), file=out)
    if problems:
        print("\nregistry consistency problems:", file=out)
        for problem in problems:
            print(f"  {problem}", file=out)
    s = report["summary"]
    print(f"\n{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped "
          f"(exit code {exit_code})", file=out)
    if json_path is not None:
        print(f"JSON report: {write_json(report, json_path)}", file=out)
    return exit_code


#: What the suite imports beyond foxhunt's own dependencies (the `conformance` extra).
SUITE_MODULES = ("pytest", "hypothesis")


def missing_suite_modules() -> list[str]:
    import importlib.util

    return [m for m in SUITE_MODULES if importlib.util.find_spec(m) is None]


def _command(args: argparse.Namespace) -> int:
    missing = missing_suite_modules()
    if missing:
        print(f"foxhunt conformance needs {', '.join(missing)}: pip install 'foxhunt[gpu]' "
              "(or 'foxhunt[conformance]' for the suite alone)", file=sys.stderr)
        return 2
    return run_conformance(args.mode, args.json)


def register(subparsers) -> None:
    """Add the ``conformance`` subcommand to the ``foxhunt`` parser."""
    p = subparsers.add_parser(
        "conformance", help="check every fast kernel against the reference on this GPU",
        description=__doc__.splitlines()[0])
    group = p.add_mutually_exclusive_group()
    group.add_argument("--quick", dest="mode", action="store_const", const="quick",
                       help="leave out the seed-size shape cases")
    group.add_argument("--full", dest="mode", action="store_const", const="full",
                       help="every case (the default)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the report as JSON")
    p.set_defaults(mode="full", func=_command)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="foxhunt")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["conformance", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
