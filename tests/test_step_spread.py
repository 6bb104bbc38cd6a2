"""benches/step_spread.py on the CPU: its arms, the interleaved build and timing order, the
statistics and the clean-up with fake trainers, and its command line where there is no GPU (the
timings need one)."""

from __future__ import annotations

import contextlib
import statistics

import pytest
from bench_modules import load_bench

cp = load_bench("critical_path")  # step_spread imports it (and step_host) by name
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


def test_switch_arms_are_one_per_group_named_by_its_switches(monkeypatch):
    from foxhunt.fast import step_program

    allowed = step_program.plan_switches()
    assert allowed == {"FUSE_HEAD_OUTPUTS": frozenset({"bf16", "f32"}),
                       "FUSE_AUX_TRUNK_GRAD": False, "FUSE_GUARD_MASK": False,
                       "FUSE_HEADS_DH2": frozenset({"tf32"}), "EARLY_UPLOAD_RELEASE": False,
                       "WAVE_SCALARS_BESIDE_ADAM": False,
                       "SPECTRAL_FIT_CLUSTERS": frozenset({"f32", "tf32"}),
                       "SPLIT_STEP_GRAPH": frozenset({"bf16", "f32", "tf32"}),
                       "PRIORITY_BY_GRAPH": frozenset({"bf16", "f32", "tf32"}),
                       "GRAPH2_EARLY_LAUNCH": frozenset({"f32", "tf32"})}
    monkeypatch.setattr(step_program, "FUSE_GUARD_MASK", False)  # the other side of the default
    assert step_program.plan_switches()["FUSE_GUARD_MASK"] is True
    assert all(hasattr(step_program, name) for name in allowed)
    assert ss.switch_arms([], allowed) == {}
    assert ss.switch_arms(["FUSE_AUX_TRUNK_GRAD", "FUSE_AUX_TRUNK_GRAD,FUSE_HEAD_OUTPUTS"],
                          allowed) == {
        "FUSE_AUX_TRUNK_GRAD=off": {"FUSE_AUX_TRUNK_GRAD": False},
        "FUSE_AUX_TRUNK_GRAD=off+FUSE_HEAD_OUTPUTS={bf16,f32}": {
            "FUSE_AUX_TRUNK_GRAD": False, "FUSE_HEAD_OUTPUTS": frozenset({"bf16", "f32"})}}
    assert ss.show_switch(True) == "on"
    for groups, message in (
            (["FUSE_NOPE"], r"^--switch 'FUSE_NOPE': 'FUSE_NOPE' is not a plan switch; allowed: "
                            r"FUSE_HEAD_OUTPUTS, FUSE_AUX_TRUNK_GRAD, FUSE_GUARD_MASK, "
                            r"FUSE_HEADS_DH2, EARLY_UPLOAD_RELEASE, "
                            r"WAVE_SCALARS_BESIDE_ADAM, SPECTRAL_FIT_CLUSTERS, "
                            r"SPLIT_STEP_GRAPH, PRIORITY_BY_GRAPH, GRAPH2_EARLY_LAUNCH$"),
            (["FUSE_GUARD_MASK,"], r"^--switch 'FUSE_GUARD_MASK,': '' is not a plan switch"),
            (["FUSE_GUARD_MASK,FUSE_GUARD_MASK"], r"^--switch 'FUSE_GUARD_MASK,FUSE_GUARD_MASK': "
                                                  r"a switch named twice$"),
            (["FUSE_GUARD_MASK", "FUSE_GUARD_MASK"], r"^--switch 'FUSE_GUARD_MASK': given twice$")):
        with pytest.raises(ValueError, match=message):
            ss.switch_arms(groups, allowed)


@pytest.mark.parametrize("fail", [False, True])
def test_switched_sets_the_values_inside_the_block_and_restores_them(fail):
    import types

    module = types.SimpleNamespace(A=False, B=frozenset({"bf16"}), C=1)
    seen = []
    with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():
        with ss.switched(module, {"A": True, "B": frozenset({"bf16", "f32"})}):
            seen.append((module.A, module.B, module.C))
            if fail:
                raise RuntimeError("build failed")
    assert seen == [(True, frozenset({"bf16", "f32"}), 1)]
    assert (module.A, module.B, module.C) == (False, frozenset({"bf16"}), 1)


def test_a_switched_plan_differs_from_the_default_and_restoring_gives_the_default_back():
    """What an arm's trainer is built with: the CPU executor's graph 1 of the step with every
    second-wave source has more nodes with the trunk-gradient switches off (their default is
    on: the launches fused), and the default's plan again after the block."""
    from foxhunt.fast import step_program

    def paths():
        return cp.step_paths(cp.variant_config("tiny", "bf16", "all"))["graph1"].nodes

    default = paths()
    arms = ss.switch_arms(["FUSE_AUX_TRUNK_GRAD,FUSE_GUARD_MASK"], step_program.plan_switches())
    with ss.switched(step_program, arms["FUSE_AUX_TRUNK_GRAD=off+FUSE_GUARD_MASK=off"]):
        unfused = paths()
    assert unfused == default + 7
    assert paths() == default


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
    for argv in (["nope"], ["--instances", "0"], ["--option", "gemm_workspace"], ["--switch"],
                 ["--switch", "FUSE_NOPE"], ["--switch", "FUSE_GUARD_MASK,FUSE_GUARD_MASK"]):
        with pytest.raises(SystemExit):
            ss.main(argv)
