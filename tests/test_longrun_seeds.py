"""The long-run noise-floor tool (``foxhunt.conformance.longrun_seeds``): seed parsing, the
JSON-lines records and the per-seed comparison (the runs themselves need a GPU or 11 CPU minutes
each and are not run here)."""

from __future__ import annotations

import json

import pytest
from foxhunt.conformance import longrun_seeds as ls


def _record(seed, sharpe, mean_q, gmean, gmax, precision="f32", gemm_workspace="none"):
    return {"seed": seed, "backend": "fast", "precision": precision, "gemm_workspace": gemm_workspace,
            "final_sharpe": sharpe, "mean_q": mean_q, "grad_norm_mean": gmean, "grad_norm_max": gmax}


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_parse_seeds():
    assert ls.parse_seeds("0-3") == [0, 1, 2, 3]
    assert ls.parse_seeds("5") == [5]
    assert ls.parse_seeds("0, 2,5-6") == [0, 2, 5, 6]
    for bad in ("a", "3-1", "-1", "1-", ""):
        with pytest.raises(ValueError, match="--seeds"):
            ls.parse_seeds(bad)


def test_compare_marks_each_criterion_per_seed(tmp_path):
    base = ls.load_runs(_write(tmp_path / "a.jsonl", [_record(0, 2.0, 1.0, 4.0, 10.0),
                                                      _record(1, -4.0, 0.5, 3.0, 6.0)]))
    # seed 0: Sharpe 4.5% off (in), mean Q 11% (out), norms 10% and 25% (in, out);
    # seed 1: Sharpe 5.5% off (out, relative to |f32|), mean Q 8% (in), norms 0% and 18% (in, in).
    other = ls.load_runs(_write(tmp_path / "b.jsonl", [
        _record(0, 2.09, 1.11, 4.4, 12.5, "bf16"), _record(1, -4.22, 0.46, 3.0, 7.1, "bf16"),
        _record(2, 1.0, 1.0, 1.0, 1.0, "bf16")]))
    lines, met, n = ls.compare(base, other)
    assert n == 2  # seed 2 has no F32 run
    assert met == {"final_sharpe": 1, "mean_q": 1, "grad_norm_mean": 2, "grad_norm_max": 1}
    row0, row1 = lines[2], lines[3]
    assert row0.startswith("| 0 |") and row1.startswith("| 1 |")
    assert [c.strip().endswith("*") for c in row0.split("|")[2:-1]] == [False, True, False, True]
    assert [c.strip().endswith("*") for c in row1.split("|")[2:-1]] == [True, False, False, False]
    assert "2 vs 2.09: 4.5%" in row0 and "-4 vs -4.22: 5.5% *" in row1
    assert lines[-1] == "| within tolerance | 1 of 2 | 1 of 2 | 2 of 2 | 1 of 2 |"


def test_load_runs_rejects_bad_files(tmp_path):
    with pytest.raises(ValueError, match="no runs"):
        ls.load_runs(_write(tmp_path / "empty.jsonl", []))
    with pytest.raises(ValueError, match="missing grad_norm_max"):
        r = _record(0, 1.0, 1.0, 1.0, 1.0)
        del r["grad_norm_max"]
        ls.load_runs(_write(tmp_path / "short.jsonl", [r]))
    with pytest.raises(ValueError, match="mixes variants"):
        ls.load_runs(_write(tmp_path / "mixed.jsonl", [_record(0, 1, 1, 1, 1),
                                                      _record(1, 1, 1, 1, 1, gemm_workspace="default")]))
    with pytest.raises(ValueError, match="seed 0 appears twice"):
        ls.load_runs(_write(tmp_path / "twice.jsonl", [_record(0, 1, 1, 1, 1), _record(0, 2, 1, 1, 1)]))
    with pytest.raises(ValueError, match="no seed in common"):
        ls.compare({0: _record(0, 1, 1, 1, 1)}, {1: _record(1, 1, 1, 1, 1)})


def test_cli_compare_and_argument_errors(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [_record(0, 2.0, 1.0, 4.0, 10.0)])
    b = _write(tmp_path / "b.jsonl", [_record(0, 2.0, 1.0, 4.0, 10.0, "bf16")])
    assert ls.main(["compare", str(a), str(b)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "| within tolerance | 1 of 1 | 1 of 1 | 1 of 1 | 1 of 1 |"
    with pytest.raises(SystemExit):
        ls.main(["run", "--precision", "f32", "--seeds", "2-1", "--out", str(tmp_path / "x")])
    assert "--seeds='2-1'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ls.main(["run", "--precision", "f32", "--backend", "reference", "--gemm-workspace", "default",
                 "--out", str(tmp_path / "x")])
    assert "only for --backend fast" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
