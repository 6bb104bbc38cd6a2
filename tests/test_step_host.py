"""benches/step_host.py on the CPU: its phase clocks around the CPU executor's ``Trainer.step``
(the same ``Trainer.step``: ``CpuTrainer`` only swaps the engine), and its command line where
there is no GPU (the timings need one)."""

from __future__ import annotations

import numpy as np
import pytest
from bench_modules import load_bench

from foxhunt.fast import trainer as fast_trainer
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import CORE_STEP, DQNConfig

load_bench("critical_path")  # step_host imports it by name
sh = load_bench("step_host")


@pytest.fixture
def cpu_trainer():
    from foxhunt.fast.cpu_executor import CpuTrainer

    trainer = CpuTrainer(DQNConfig.preset("tiny", precision="f32", **CORE_STEP), seed=0)
    yield trainer
    trainer.close()


def test_phase_clocks_time_each_callee_and_put_them_back(cpu_trainer):
    config = cpu_trainer.config
    batch = Batch.random(config, np.random.default_rng(1))
    before = (fast_trainer.check_step_batch, fast_trainer.write_batch)
    engine = cpu_trainer.engine
    calls = []
    real_launch = engine.launch
    own_launch = engine.launch = lambda slot: calls.append(slot) or real_launch(slot)  # a patch
    phases = sh.step_phases(cpu_trainer, lambda: cpu_trainer.step(batch), 3)
    assert set(phases) == set(sh.PHASES)
    assert all(phases[name] > 0 for name in sh.PHASES[:-1])
    assert calls == [0, 1, 0] and cpu_trainer.step_count == 3
    assert (fast_trainer.check_step_batch, fast_trainer.write_batch) == before
    assert "staging" not in engine.__dict__ and engine.__dict__["launch"] is own_launch


def test_phase_clocks_put_the_callees_back_when_the_step_raises(cpu_trainer):
    bad = Batch.random(cpu_trainer.config, np.random.default_rng(2))
    bad = Batch(**{**bad.__dict__, "isw": -bad.isw})
    before = (fast_trainer.check_step_batch, fast_trainer.write_batch)
    with pytest.raises(ValueError, match=r"batch\.isw\[0\]"):
        sh.step_phases(cpu_trainer, lambda: cpu_trainer.step(bad), 1)
    assert (fast_trainer.check_step_batch, fast_trainer.write_batch) == before
    assert "staging" not in cpu_trainer.engine.__dict__


def test_without_a_gpu_the_command_line_says_so(capsys):
    from foxhunt.fast.device import cuda_available

    if cuda_available()[0]:
        pytest.skip("a CUDA device is present (the command would run)")
    assert sh.main(["core"]) == 2
    assert "step_host: no CUDA device" in capsys.readouterr().err
    for argv in (["nope"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            sh.main(argv)
