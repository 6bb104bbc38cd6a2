"""Long-run parity as a statistic over seeds (``foxhunt.conformance.longrun_seeds``, SPEC 8):
the spread and bias criteria on hand-computed and planted cases, the JSON-lines files, the CLI's
exit statuses, the committed H200 runs, and the parallel runner with fake runs (the real runs
need a GPU)."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

import pytest
from foxhunt.conformance import longrun_seeds as ls
from foxhunt.conformance import test_longrun

COMMITTED = Path(__file__).resolve().parents[1] / ".readme" / "longrun"
METRICS = list(ls.METRICS)


def _record(variant, seed, values, **extra):
    """A run of ``variant`` with ``values`` (a number for every metric, or metric -> number)."""
    if not isinstance(values, dict):
        values = dict.fromkeys(METRICS, values)
    return {"seed": seed, **ls.variant_fields(variant), **values, **extra}


def _runs(base, dn, dp, metric="final_sharpe", other=1.0):
    """Three variants over seeds 0..K-1: f32 ``base``, f32_alt ``base + dn``, bf16 ``base + dp``
    in ``metric`` (dyadic numbers, so the differences are exact); ``other`` in every other
    metric of every variant (differences 0)."""
    out = {}
    for variant, delta in (("f32", [0.0] * len(base)), ("f32_alt", dn), ("bf16", dp)):
        out[variant] = {k: _record(variant, k, {**dict.fromkeys(METRICS, other), metric: b + d})
                        for k, (b, d) in enumerate(zip(base, delta))}
    return out


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _write_runs(tmp_path, runs):
    return {v: _write(tmp_path / f"{v}.jsonl", by_seed.values()) for v, by_seed in runs.items()}


def _row(rows, metric):
    (row,) = [r for r in rows if r.metric == metric]
    return row


# ------------------------------------------------------------------------------ the statistic
def test_hand_computed_k3_passes():
    # dp = (-1, 0, 1): median |dp| = 1, mean 0, var (1 + 0 + 1) / 2 = 1.
    # dn = (2, -2, 0): median |dn| = 2 -> spread bound 4; mean 0, var (4 + 4 + 0) / 2 = 4.
    # bias |0 - 0| = 0 <= 3 * sqrt(1/3 + 4/3) = 3 * sqrt(5/3) = 3.872983346...
    runs = _runs([10.0, 20.0, 30.0], dn=[2.0, -2.0, 0.0], dp=[-1.0, 0.0, 1.0])
    rows = ls.parity_statistic(runs["f32"], runs["f32_alt"], runs["bf16"])
    assert [r.metric for r in rows] == METRICS
    row = _row(rows, "final_sharpe")
    assert (row.k, row.median_dp, row.spread_bound, row.bias) == (3, 1.0, 4.0, 0.0)
    assert row.bias_bound == pytest.approx(3.872983346207417, rel=1e-12)
    assert row.spread_ok and row.bias_ok and row.ok
    # the metrics with no difference at all: 0 <= 0 on both criteria
    for r in rows[1:]:
        assert (r.median_dp, r.spread_bound, r.bias, r.bias_bound) == (0.0, 0.0, 0.0, 0.0) and r.ok


def test_hand_computed_k4_passes_on_the_bias_bound():
    # dp = (1, 3, -1, 1): |dp| sorted 1, 1, 1, 3 -> median 1; mean 1; var (0 + 4 + 4 + 0) / 3 = 8/3.
    # dn = (2, -2, 4, -4): |dn| sorted 2, 2, 4, 4 -> median 3, bound 6; mean 0; var 40/3.
    # bias |1 - 0| = 1 <= 3 * sqrt((8/3 + 40/3) / 4) = 3 * sqrt(4) = 6.
    runs = _runs([0.5, 1.5, -2.0, 4.0], dn=[2.0, -2.0, 4.0, -4.0], dp=[1.0, 3.0, -1.0, 1.0], metric="mean_q")
    row = _row(ls.parity_statistic(runs["f32"], runs["f32_alt"], runs["bf16"]), "mean_q")
    assert (row.k, row.median_dp, row.spread_bound, row.bias) == (4, 1.0, 6.0, 1.0)
    assert row.bias_bound == pytest.approx(6.0, rel=1e-12)
    assert row.ok


def test_hand_computed_k5_passes():
    # dp = (0.5, -0.25, 0.25, 0, -0.5): median |dp| 0.25; mean 0; var (0.25+0.0625+0.0625+0+0.25)/4
    #      = 0.15625.
    # dn = (1, -1, 0.5, -0.5, 0): median |dn| 0.5 -> bound 1; mean 0; var (1+1+0.25+0.25+0)/4 = 0.625.
    # bias 0 <= 3 * sqrt((0.15625 + 0.625) / 5) = 3 * sqrt(0.15625) = 1.185854122...
    runs = _runs([1.0] * 5, dn=[1.0, -1.0, 0.5, -0.5, 0.0], dp=[0.5, -0.25, 0.25, 0.0, -0.5],
                 metric="grad_norm_max")
    row = _row(ls.parity_statistic(runs["f32"], runs["f32_alt"], runs["bf16"]), "grad_norm_max")
    assert (row.k, row.median_dp, row.spread_bound, row.bias) == (5, 0.25, 1.0, 0.0)
    assert row.bias_bound == pytest.approx(1.1858541225631423, rel=1e-12)
    assert row.ok


def test_planted_systematic_shift_fails_the_bias_test_only():
    # dn = (1, -1) x 4: median |dn| 1 -> spread bound 2; mean 0; var 8/7.
    # dp = dn + 1.75 = (2.75, 0.75) x 4: median |dp| = (0.75 + 2.75) / 2 = 1.75 <= 2, so the
    #    spread test passes;
    # mean dp = 1.75, var 8/7: bias 1.75 > 3 * sqrt((8/7 + 8/7) / 8) = 3 * sqrt(2/7) = 1.603567...
    # Without the bias term this systematic shift would pass: the bias term is what catches it.
    dn = [1.0, -1.0] * 4
    runs = _runs([3.0] * 8, dn=dn, dp=[d + 1.75 for d in dn], metric="grad_norm_mean")
    row = _row(ls.parity_statistic(runs["f32"], runs["f32_alt"], runs["bf16"]), "grad_norm_mean")
    assert (row.k, row.median_dp, row.spread_bound, row.bias) == (8, 1.75, 2.0, 1.75)
    assert row.bias_bound == pytest.approx(3 * math.sqrt(2 / 7), rel=1e-12)
    assert row.spread_ok
    assert not row.bias_ok
    assert not row.ok


def test_planted_spread_fails_the_spread_test_only():
    # dn = (0.5, -0.5) x 2: median |dn| 0.5 -> bound 1. dp = (3, -3) x 2: median |dp| 3 > 1.
    # Both means 0: bias 0 <= 3 * sqrt((12 + 1/3) / 4) (var dp = 36/3 = 12, var dn = 1/3).
    runs = _runs([0.0] * 4, dn=[0.5, -0.5] * 2, dp=[3.0, -3.0] * 2)
    row = _row(ls.parity_statistic(runs["f32"], runs["f32_alt"], runs["bf16"]), "final_sharpe")
    assert (row.median_dp, row.spread_bound, row.bias) == (3.0, 1.0, 0.0)
    assert row.bias_bound == pytest.approx(3 * math.sqrt((12 + 1 / 3) / 4), rel=1e-12)
    assert not row.spread_ok and row.bias_ok and not row.ok


def test_fewer_than_three_common_seeds_is_rejected():
    runs = _runs([1.0, 2.0], dn=[0.0, 0.0], dp=[0.0, 0.0])
    with pytest.raises(ValueError, match=r"^K=2 seeds: the statistic needs at least 3$"):
        ls.parity_statistic(runs["f32"], runs["f32_alt"], runs["bf16"])
    # three seeds in f32 and f32_alt, but bf16 has only two of them
    runs = _runs([1.0, 2.0, 3.0], dn=[0.0] * 3, dp=[0.0] * 3)
    del runs["bf16"][1]
    with pytest.raises(ValueError, match="K=2 seeds"):
        ls.parity_statistic(runs["f32"], runs["f32_alt"], runs["bf16"])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_metric_fails_the_parity(bad):
    runs = _runs([1.0, 2.0, 3.0], dn=[0.0] * 3, dp=[0.0] * 3)
    runs["bf16"][2]["mean_q"] = bad
    with pytest.raises(ls.RunFailed, match=f"bf16 seed 2: non-finite mean_q={bad}"):
        ls.parity_statistic(runs["f32"], runs["f32_alt"], runs["bf16"])


def test_a_halted_run_fails_the_parity():
    runs = _runs([1.0, 2.0, 3.0], dn=[0.0] * 3, dp=[0.0] * 3)
    runs["f32_alt"][0].update(halted="halt_nan at fold 0 epoch 6", epochs=7)
    with pytest.raises(ls.RunFailed, match=r"f32_alt seed 0: the run halted \(halt_nan .*\) after 7 epochs"):
        ls.parity_statistic(runs["f32"], runs["f32_alt"], runs["bf16"])


def test_metrics_are_fields_of_a_run_summary():
    fields = {f.name for f in dataclasses.fields(test_longrun.RunSummary)}
    assert set(ls.METRICS) <= fields


def test_format_seeds():
    assert ls.format_seeds([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert ls.format_seeds([3]) == "3"


# ------------------------------------------------------------------------------ the files
def test_load_runs_rejects_bad_files(tmp_path):
    assert ls.load_runs(_write(tmp_path / "empty.jsonl", []), "f32") == {}
    r = _record("f32", 0, 1.0)
    del r["grad_norm_max"]
    with pytest.raises(ValueError, match=r"short.jsonl:1: not a longrun_seeds record \(missing grad_norm_max\)"):
        ls.load_runs(_write(tmp_path / "short.jsonl", [r]), "f32")
    with pytest.raises(ValueError, match=r"wrong.jsonl:2: a run with .*precision='bf16'.* not the "
                                         r"f32_alt variant \(.*precision='f32', gemm_workspace='default'"):
        ls.load_runs(_write(tmp_path / "wrong.jsonl", [_record("f32_alt", 0, 1.0), _record("bf16", 1, 1.0)]),
                     "f32_alt")
    with pytest.raises(ValueError, match="mixed.jsonl:2: .* not the variant of the file's first run"):
        ls.load_runs(_write(tmp_path / "mixed.jsonl", [_record("f32", 0, 1.0), _record("f32_alt", 1, 1.0)]))
    with pytest.raises(ValueError, match="twice.jsonl:2: seed 0 appears twice"):
        ls.load_runs(_write(tmp_path / "twice.jsonl", [_record("f32", 0, 1.0), _record("f32", 0, 2.0)]), "f32")
    with pytest.raises(ValueError, match=r"typed.jsonl:1: seed='0', mean_q=None: the seed must be an integer"):
        ls.load_runs(_write(tmp_path / "typed.jsonl", [_record("f32", "0", 1.0, mean_q=None)]), "f32")
    (tmp_path / "torn.jsonl").write_text('{"seed": 0, "back\n')
    with pytest.raises(ValueError, match="torn.jsonl:1: not JSON"):
        ls.load_runs(tmp_path / "torn.jsonl", "f32")


def test_compare_uses_the_common_seeds_and_says_which_it_left_out(tmp_path):
    runs = _runs([10.0, 20.0, 30.0], dn=[2.0, -2.0, 0.0], dp=[-1.0, 0.0, 1.0])
    runs["bf16"][7] = _record("bf16", 7, 5.0)
    table, ok = ls.compare(_write_runs(tmp_path, runs))
    assert ok
    lines = table.splitlines()
    assert lines[0] == ("| metric | K | median \\|dp\\| | 2 x median \\|dn\\| | spread | "
                        "\\|mean dp - mean dn\\| | 3 standard errors | bias |")
    assert lines[2] == "| final held-out Sharpe | 3 | 1 | 4 | pass | 0 | 3.873 | pass |"
    assert lines[-2] == "K = 3 seeds (0-2): every criterion passes"
    assert lines[-1] == "left out (not in every file): bf16: 7"


# ------------------------------------------------------------------------------ the CLI
def _cli(tmp_path, runs):
    paths = _write_runs(tmp_path, runs)
    return ls.main(["compare", *(str(paths[v]) for v in ls.VARIANTS)])


def test_cli_exit_status_0_when_every_criterion_passes(tmp_path, capsys):
    assert _cli(tmp_path, _runs([10.0, 20.0, 30.0], dn=[2.0, -2.0, 0.0], dp=[-1.0, 0.0, 1.0])) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "K = 3 seeds (0-2): every criterion passes"


def test_cli_exit_status_1_on_the_planted_shift(tmp_path, capsys):
    dn = [1.0, -1.0] * 4
    assert _cli(tmp_path, _runs([3.0] * 8, dn=dn, dp=[d + 1.75 for d in dn], metric="grad_norm_mean")) == 1
    out = capsys.readouterr().out.splitlines()
    assert "| gradient-norm mean | 8 | 1.75 | 2 | pass | 1.75 | 1.604 | **fail** |" in out
    assert out[-1] == "K = 8 seeds (0-7): FAIL (gradient-norm mean bias)"


def test_cli_exit_status_1_on_a_halted_run(tmp_path, capsys):
    runs = _runs([1.0, 2.0, 3.0], dn=[0.0] * 3, dp=[0.0] * 3)
    runs["bf16"][1]["halted"] = "halt_grad_collapse"
    assert _cli(tmp_path, runs) == 1
    assert "bf16 seed 1: the run halted (halt_grad_collapse)" in capsys.readouterr().err


def test_cli_exit_status_2_on_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _cli(tmp_path, _runs([1.0, 2.0], dn=[0.0] * 2, dp=[0.0] * 2))
    assert exc.value.code == 2 and "K=2 seeds: the statistic needs at least 3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        ls.main(["compare", str(tmp_path / "f32.jsonl"), str(tmp_path / "f32_alt.jsonl")])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        ls.main(["compare", *(str(tmp_path / f"no_{v}.jsonl") for v in ls.VARIANTS)])
    assert exc.value.code == 2 and "no_f32.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        ls.main(["run", "--seeds", "2-1", "--out-dir", str(tmp_path / "x")])
    assert exc.value.code == 2 and "--seeds='2-1'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        ls.main(["run", "--backend", "reference", "--out-dir", str(tmp_path / "x")])
    assert exc.value.code == 2 and "exists on the fast backend only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        ls.main(["run", "--jobs", "0", "--out-dir", str(tmp_path / "x")])
    assert exc.value.code == 2 and "--jobs=0" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_parse_seeds():
    assert ls.parse_seeds("0-3") == [0, 1, 2, 3]
    assert ls.parse_seeds("5") == [5]
    assert ls.parse_seeds("0, 2,5-6") == [0, 2, 5, 6]
    for bad in ("a", "3-1", "-1", "1-", ""):
        with pytest.raises(ValueError, match="--seeds"):
            ls.parse_seeds(bad)


def test_seed_count_of_the_gated_test(monkeypatch):
    monkeypatch.delenv("FOXHUNT_LONGRUN_SEEDS", raising=False)
    assert test_longrun.seed_count() == 16
    monkeypatch.setenv("FOXHUNT_LONGRUN_SEEDS", "5")
    assert test_longrun.seed_count() == 5
    for bad in ("2", "x", ""):
        monkeypatch.setenv("FOXHUNT_LONGRUN_SEEDS", bad)
        with pytest.raises(ValueError, match=f"FOXHUNT_LONGRUN_SEEDS={bad!r}: expected an integer of at least 3"):
            test_longrun.seed_count()


# ------------------------------------------------------------------------------ the committed runs
def test_the_committed_h200_runs_pass(capsys):
    paths = [COMMITTED / f"{v}.jsonl" for v in ls.VARIANTS]
    assert ls.main(["compare", *map(str, paths)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "K = 12 seeds (0-11): every criterion passes"


def test_the_committed_runs_agree_with_the_statistics_module():
    """The rows recomputed another way: Python's ``statistics`` (median, fmean, variance with
    K - 1) over the committed files read as plain JSON."""
    by_variant = {v: {r["seed"]: r for r in map(json.loads, (COMMITTED / f"{v}.jsonl").read_text().splitlines())}
                  for v in ls.VARIANTS}
    rows = ls.parity_statistic(*(ls.load_runs(COMMITTED / f"{v}.jsonl", v) for v in ls.VARIANTS))
    seeds = sorted(by_variant["f32"])
    assert seeds == list(range(12))
    for row in rows:
        m = row.metric
        dp = [by_variant["bf16"][s][m] - by_variant["f32"][s][m] for s in seeds]
        dn = [by_variant["f32_alt"][s][m] - by_variant["f32"][s][m] for s in seeds]
        k = len(seeds)
        assert row.k == k
        assert row.median_dp == pytest.approx(statistics.median(map(abs, dp)), rel=1e-12)
        assert row.spread_bound == pytest.approx(2 * statistics.median(map(abs, dn)), rel=1e-12)
        assert row.bias == pytest.approx(abs(statistics.fmean(dp) - statistics.fmean(dn)), rel=1e-9)
        se = math.sqrt(statistics.variance(dp) / k + statistics.variance(dn) / k)
        assert row.bias_bound == pytest.approx(3 * se, rel=1e-12)
        assert row.ok


# ------------------------------------------------------------------------------ the runner
def _fake_record(variant, seed, backend="fast"):
    return {**_record(variant, seed, float(seed)), "backend": backend, "wall_s": 0.5}


def test_run_skips_what_is_present_and_completes_what_is_missing(tmp_path, monkeypatch):
    calls = []
    failing = {("bf16", 1)}

    def fake(variant, seed, backend):
        calls.append((variant, seed))
        if (variant, seed) in failing:
            raise ls.RunFailed(f"{variant} seed {seed}: the worker exited with 1: boom\nboom")
        return _fake_record(variant, seed, backend)

    monkeypatch.setattr(ls, "run_in_subprocess", fake)
    _write(tmp_path / "f32.jsonl", [_fake_record("f32", 0)])
    log = []
    failures = ls.run_variants([0, 1], tmp_path, jobs=3, log=log.append)
    assert sorted(calls) == [("bf16", 0), ("bf16", 1), ("f32", 1), ("f32_alt", 0), ("f32_alt", 1)]
    assert failures == ["bf16 seed 1: the worker exited with 1: boom"]
    assert log[0] == f"5 runs to do, 1 already in {tmp_path}, 3 at a time"
    assert {v: sorted(ls.load_runs(tmp_path / f"{v}.jsonl", v)) for v in ls.VARIANTS} == \
        {"f32": [0, 1], "f32_alt": [0, 1], "bf16": [0]}
    # a second invocation runs only what is missing
    calls.clear()
    failing.clear()
    assert ls.run_variants([0, 1], tmp_path, jobs=3, log=log.append) == []
    assert calls == [("bf16", 1)]
    assert sorted(ls.load_runs(tmp_path / "bf16.jsonl", "bf16")) == [0, 1]
    assert not list(tmp_path.glob(".*.tmp"))


def test_cli_run_exit_status_1_when_a_run_fails(tmp_path, monkeypatch, capsys):
    def fake(variant, seed, backend):
        raise ls.RunFailed(f"{variant} seed {seed}: the worker exited with 1: no CUDA device\n...")

    monkeypatch.setattr(ls, "run_in_subprocess", fake)
    assert ls.main(["run", "--seeds", "0", "--variants", "f32", "--out-dir", str(tmp_path)]) == 1
    assert "1 runs failed:\nf32 seed 0: the worker exited with 1: no CUDA device\n" in capsys.readouterr().err
    assert not (tmp_path / "f32.jsonl").exists()


CHILD = """
import json, os, sys
if sys.argv[2] == "fail":
    print("boom"); sys.exit(3)
with open(sys.argv[1], "w") as fh:
    json.dump({v: os.environ.get(v) for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}, fh)
"""


def test_workers_run_with_one_blas_thread_and_report_their_failures(monkeypatch):
    monkeypatch.setattr(ls, "child_command",
                        lambda variant, seed, backend, record: [sys.executable, "-c", CHILD, str(record), variant])
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert ls.run_in_subprocess("ok", 0, "fast") == dict.fromkeys(ls.BLAS_THREAD_VARS, "1")
    with pytest.raises(ls.RunFailed, match="fail seed 4: the worker exited with 3: boom\nboom"):
        ls.run_in_subprocess("fail", 4, "fast")


def test_child_command_runs_one():
    cmd = ls.child_command("f32_alt", 3, "fast", Path("/tmp/r.json"))
    assert cmd[1:] == ["-m", "foxhunt.conformance.longrun_seeds", "one", "--variant", "f32_alt",
                       "--seed", "3", "--backend", "fast", "--record", "/tmp/r.json"]


def test_one_records_the_variant_and_sets_its_gemm_workspace(tmp_path, monkeypatch):
    from foxhunt.fast import Trainer as FastTrainer

    seen = []

    def fake_train(precision, seed, backend):
        seen.append((precision, seed, backend.func, backend.keywords))
        return test_longrun.RunSummary(precision, 50, None, 1.0, 2.0, 3.0, 4.0, 150, [1.0])

    monkeypatch.setattr(test_longrun, "train", fake_train)
    for variant, workspace in (("f32_alt", "default"), ("bf16", "none")):
        out = tmp_path / f"{variant}.json"
        assert ls.main(["one", "--variant", variant, "--seed", "3", "--record", str(out)]) == 0
        record = json.loads(out.read_text())
        assert seen[-1] == (ls.VARIANTS[variant][0], 3, FastTrainer, {"gemm_workspace": workspace})
        assert {k: record[k] for k in ("seed", *ls.VARIANT_KEYS)} == {"seed": 3, **ls.variant_fields(variant)}
        assert (record["final_sharpe"], record["grad_norm_max"]) == (1.0, 4.0) and record["wall_s"] >= 0
