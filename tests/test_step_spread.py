"""benches/step_spread.py on the CPU: its arms, the interleaved build and timing order, the
statistics and the clean-up with fake trainers, and its command line where there is no GPU (the
timings need one)."""

from __future__ import annotations

import statistics

import pytest
from bench_modules import load_bench

load_bench("critical_path")  # step_spread imports it (and step_host) by name
load_bench("step_host")
ss = load_bench("step_spread")


def test_the_options_are_the_trainers_boolean_keywords():
    assert ss.trainer_options() == ("fused_trunk", "fused_heads", "stacked_backward")


def test_arms_are_the_default_then_one_per_option():
    allowed = ss.trainer_options()
    assert ss.arms([], allowed) == {"default": {}}
    assert ss.arms(["fused_trunk", "stacked_backward"], allowed) == {
        "default": {}, "fused_trunk": {"fused_trunk": True},
        "stacked_backward": {"stacked_backward": True}}
    with pytest.raises(ValueError, match=r"^--option 'fused_trunk': given twice$"):
        ss.arms(["fused_trunk", "fused_trunk"], allowed)
    with pytest.raises(ValueError, match=r"^--option 'gemm_workspace': not a boolean Trainer "
                                         r"option; allowed: fused_trunk, fused_heads, "
                                         r"stacked_backward$"):
        ss.arms(["gemm_workspace"], allowed)


class FakeTrainer:
    def __init__(self, log, name, times):
        self.log, self.name, self.times = log, name, list(times)
        self.closed = False

    def time(self):
        self.log.append(("time", self.name))
        return self.times.pop(0)


def test_builds_and_timings_interleave_and_each_instance_is_its_rounds_median():
    log, made = [], []
    # instance times per round, by (arm, instance): medians 2, 5 (default) / 7, 1 (opt)
    plan = {("default", 0): [1, 2, 9], ("opt", 0): [7, 7, 8], ("default", 1): [5, 4, 6],
            ("opt", 1): [0, 1, 3]}
    counts = {"default": 0, "opt": 0}

    def build(options):
        arm = "opt" if options else "default"
        i, counts[arm] = counts[arm], counts[arm] + 1
        log.append(("build", (arm, i)))
        made.append(FakeTrainer(log, (arm, i), plan[arm, i]))
        return made[-1]

    result = ss.spread(build, {"default": {}, "opt": {"x": True}}, 2, 3, lambda t: t.time(),
                       close=lambda t: setattr(t, "closed", True))
    order = [("default", 0), ("opt", 0), ("default", 1), ("opt", 1)]
    assert log == [("build", k) for k in order] + [("time", k) for _ in range(3) for k in order]
    assert result.instances == {"default": [2, 5], "opt": [7, 1]}
    assert result.summary("default") == (3.5, 2, 5) and result.summary("opt") == (4, 1, 7)
    assert all(t.closed for t in made)
    text = ss.format_spread("core", result)
    assert text.splitlines()[1].split()[:4] == ["default", "3.50", "2.00", "5.00"]
    assert text.splitlines()[2].split()[-2:] == ["7.0", "1.0"]


@pytest.mark.parametrize("fail_at", ["build", "time"])
def test_every_trainer_built_is_closed_when_a_build_or_a_timing_raises(fail_at):
    made = []

    def build(options):
        if fail_at == "build" and len(made) == 2:
            raise RuntimeError("capture failed")
        made.append(FakeTrainer([], len(made), [1.0, 2.0]))
        return made[-1]

    def time_one(trainer):
        if fail_at == "time" and trainer.name == 1:
            raise RuntimeError("launch failed")
        return trainer.time()

    with pytest.raises(RuntimeError):
        ss.spread(build, {"default": {}, "opt": {"x": True}}, 2, 2, time_one,
                  close=lambda t: setattr(t, "closed", True))
    assert len(made) == (2 if fail_at == "build" else 4) and all(t.closed for t in made)


def test_the_median_of_an_even_number_of_rounds_is_the_mean_of_the_middle_two():
    made = []
    result = ss.spread(lambda o: made.append(FakeTrainer([], 0, [1.0, 4.0])) or made[-1],
                       {"default": {}}, 1, 2, lambda t: t.time())
    assert result.instances["default"] == [statistics.median([1.0, 4.0])] == [2.5]


def test_without_a_gpu_the_command_line_says_so(capsys):
    from foxhunt.fast.device import cuda_available

    if cuda_available()[0]:
        pytest.skip("a CUDA device is present (the command would run)")
    assert ss.main(["core"]) == 2
    assert "step_spread: no CUDA device" in capsys.readouterr().err
    for argv in (["nope"], ["--instances", "0"], ["--option", "gemm_workspace"]):
        with pytest.raises(SystemExit):
            ss.main(argv)
