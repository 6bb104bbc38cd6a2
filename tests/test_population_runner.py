"""Members in lockstep (``population_runner``, issue 24 item 4) on the CPU: the rendezvous and
the one lock on a recording population, the prefixed output, then tiny populations trained in
lockstep on the reference twin against the same population trained one after the other (the
members are independent: lockstep must not change a bit), a member that halts, raises or
never starts while the others go on, a failing population step, and a signal."""

import dataclasses
import functools
import io
import os
import signal
import threading
import time

import numpy as np
import pytest
from test_cli import TIMING, TINY, foxhunt, strict_loads

from foxhunt.fast.cpu_executor import CpuTrainer
from foxhunt.fast.population import CpuPopulation
from foxhunt.reference import cli, loop, population_cli, train_cli
from foxhunt.reference.collector import Collector, fold_collector
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.evaluator import device_segments, segment_evaluator
from foxhunt.reference.market import SyntheticMarket, feature_warmup, market_features
from foxhunt.reference.population import Population
from foxhunt.reference.population_runner import (Lockstep, Marshaled, PopulationStepError,
                                                  PopulationThread, PrefixedLines, run_lockstep)
from foxhunt.reference.trainer import Trainer

SEEDS = (0, 1, 2)
#: Every member's steps: TINY's 1 fold x 2 epochs x 5 steps per epoch.
STEPS = 10


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---------------------------------------------------------------------------------- the rendezvous
class RecordingPopulation:
    """``n`` members; ``step`` records its batches and returns ``batch * 10 + member`` per
    member; a member's ``q_values(x)`` is ``x * 100 + member``. Any call that starts while
    another runs (the one lock broken) is recorded in ``overlaps``, and the thread of every
    call (its construction included) in ``threads``; ``fail_at``: the round whose step
    raises."""

    def __init__(self, n, fail_at=None):
        self.n, self.fail_at = n, fail_at
        self.rounds, self.overlaps, self._busy = [], [], False
        self.threads = {threading.get_ident()}

    def __len__(self):
        return self.n

    def _call(self, what, fn):
        self.threads.add(threading.get_ident())
        if self._busy:
            self.overlaps.append(what)
        self._busy = True
        try:
            time.sleep(0.002)  # widen the window an overlapping call would fall into
            return fn()
        finally:
            self._busy = False

    def step(self, batches):
        def step():
            self.rounds.append(list(batches))
            if self.fail_at == len(self.rounds):
                raise FloatingPointError("injected step failure")
            return [b * 10 + i for i, b in enumerate(batches)]
        return self._call("step", step)

    def member(self, i):
        population = self
        self.threads.add(threading.get_ident())

        class Member:
            backend_name = "fast-member"
            seed = 100 + i

            def q_values(self, x):
                return population._call("q_values", lambda: x * 100 + i)

            def step(self, batch):
                raise AssertionError("a member's own step is never called")
        return Member()


def _run_threads(lockstep, plans):
    """Member ``i`` steps ``plans[i]``'s batches through its proxy (a ``q_values`` call after
    each), then leaves; returns ``(what each got, what each raised)``."""
    proxies = [lockstep.member(i) for i in range(len(plans))]
    got, raised = [[] for _ in plans], [None] * len(plans)

    def member(i):
        try:
            for b in plans[i]:
                got[i].append(proxies[i].step(b))
                got[i].append(proxies[i].q_values(b))
        except Exception as exc:
            raised[i] = exc
        finally:
            lockstep.leave(i)
    threads = [threading.Thread(target=member, args=(i,)) for i in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a member thread is stuck at the rendezvous"
    return got, raised


def test_rendezvous_fills_departed_slots_and_keeps_one_lock():
    """Member 0 steps 3 batches, member 1 one then leaves, member 2 leaves without stepping.
    No round runs before every active member has deposited, so round 1 waits for member 2 to
    leave: its slot gets the lowest active member's batch (1), and keeps it; member 1's slot
    keeps its last batch (2) once it has left."""
    pop = RecordingPopulation(3)
    lockstep = Lockstep(pop)
    got, raised = _run_threads(lockstep, [[1, 3, 4], [2], []])
    assert raised == [None, None, None]
    assert pop.rounds == [[1, 2, 1], [3, 2, 1], [4, 2, 1]]
    # Each member its own result of each round (batch * 10 + member), then its own q_values.
    assert got == [[10, 100, 30, 300, 40, 400], [21, 201], []]
    assert pop.overlaps == [] and lockstep.active == set()
    # Everything but step is the member's own, backend_name included (the host collector for
    # a fast population's member).
    proxy = lockstep.member(2)
    assert proxy.backend_name == "fast-member" and proxy.seed == 102


def test_a_fast_member_gets_the_host_collector_and_its_own_device_walk():
    """A fast population's member (``backend_name`` "fast-member", through its proxy) is
    collected on the host (the device cycle belongs to a single fast trainer) and evaluated by
    its own device walk (``Member.device_segments``), built and run in the population's thread
    (``Marshaled``): the metrics equal a ``DeviceEvaluator`` on the member itself."""
    config = DQNConfig.preset("tiny")
    bars = SyntheticMarket.preset("default", seed=3, n_bars=600).generate()
    windows = loop.choose_windows(config.state_dim)
    feats = market_features(bars, windows)
    seg = loop.fold_segments(len(bars), feature_warmup(windows), 1, 0.125, 0.125)[0]
    recording = Lockstep(RecordingPopulation(1)).member(0)
    made = fold_collector(recording, config, bars, feats, seg.train, loop.LoopSettings(n_envs=2), 0)
    assert type(made) is Collector
    assert segment_evaluator(recording, bars, feats, [seg.val, seg.test]) is None  # no walk
    pop = CpuPopulation(config, [0, 1])
    with PopulationThread() as thread:
        lockstep = Lockstep(pop, call=thread.call)
        walk = segment_evaluator(lockstep.member(1), bars, feats, [seg.val, seg.test])
        assert type(walk) is Marshaled
        got, curve = walk.evaluate(seg.test, "greedy", 252.0, equity=True)
        walk.close()
    direct = device_segments(pop.member(1), bars, feats, [seg.val, seg.test])
    want, want_curve = direct.evaluate(seg.test, "greedy", 252.0, equity=True)
    assert got == want and np.array_equal(curve, want_curve)


def test_a_failing_step_raises_in_every_waiting_member():
    pop = RecordingPopulation(2, fail_at=2)
    got, raised = _run_threads(Lockstep(pop), [[1, 2, 3], [5, 6, 7]])
    assert got == [[10, 100], [51, 501]] and len(pop.rounds) == 2
    for exc in raised:
        assert isinstance(exc, PopulationStepError)
        assert str(exc) == "the population step failed: FloatingPointError: injected step failure"
        assert isinstance(exc.__cause__, FloatingPointError)
    assert raised[0] is not raised[1]  # one exception each: their tracebacks are their own


def test_a_member_that_left_may_not_step():
    lockstep = Lockstep(RecordingPopulation(2))
    proxy = lockstep.member(0)
    lockstep.leave(0)
    with pytest.raises(RuntimeError, match="member 0 has left the lockstep"):
        proxy.step(1)


def test_run_lockstep_returns_results_and_exceptions(capsys):
    """A job that raises ends its member (traceback printed with its prefix); the other steps
    on alone; each job's lines carry its label, the calling thread's do not."""
    pop = RecordingPopulation(2)

    def steady(trainer):
        print("steady start")
        return [trainer.step(b) for b in (1, 2, 3)]

    def broken(trainer):
        trainer.step(7)
        raise KeyError("broken job")

    print("before")
    outcomes = run_lockstep(pop, [steady, broken], ["[a] ", "[b] "], poll_s=0.01)
    out, err = capsys.readouterr()
    assert outcomes[0] == [10, 20, 30] and isinstance(outcomes[1], KeyError)
    assert pop.rounds == [[1, 7], [2, 7], [3, 7]]
    assert out == "before\n[a] steady start\n"
    lines = err.splitlines()
    assert lines[0] == "[b] Traceback (most recent call last):"
    assert lines[-1] == "[b] KeyError: 'broken job'"
    assert all(line.startswith("[b] ") for line in lines)
    with pytest.raises(ValueError, match="one each per member"):
        run_lockstep(pop, [steady], ["[a] "])


def test_every_population_call_runs_in_the_population_thread():
    """Built, stepped and asked (``member``, ``q_values``) in one thread, none of the members'
    (a CUDA context is current in the thread that made it so)."""
    member_threads = set()

    def job(trainer):
        member_threads.add(threading.get_ident())
        return [(trainer.step(b), trainer.q_values(b)) for b in (1, 2)]

    with PopulationThread() as on_population:
        pop = on_population.call(RecordingPopulation, 2)
        outcomes = run_lockstep(pop, [job, job], ["[a] ", "[b] "], call=on_population.call,
                                poll_s=0.01)
        where = on_population.call(threading.get_ident)
    assert outcomes == [[(10, 100), (20, 200)], [(11, 101), (21, 201)]]
    assert pop.threads == {where} and pop.overlaps == []
    assert len(member_threads) == 2 and where not in member_threads | {threading.get_ident()}


def test_prefixed_lines_keep_each_threads_lines_whole():
    target = io.StringIO()
    stream = PrefixedLines(target)

    def writer(name):
        stream.set_prefix(f"[{name}] ")
        for k in range(200):  # each line in three pieces, interleaved with the other thread's
            stream.write("li")
            stream.write(f"ne {k}")
            stream.write(f" {name}\n" if k < 199 else f" {name} (unfinished)")
        stream.end_thread()
    threads = [threading.Thread(target=writer, args=(n,)) for n in "AB"]
    for t in threads:
        t.start()
    stream.write("from the main thread\n")
    for t in threads:
        t.join()
    lines = target.getvalue().splitlines()
    assert "from the main thread" in lines and not stream.isatty()
    for name in "AB":
        mine = [line for line in lines if line.startswith(f"[{name}] ")]
        assert mine == [f"[{name}] line {k} {name}" for k in range(199)] + \
            [f"[{name}] line 199 {name} (unfinished)"]
    assert len(lines) == 401


# ---------------------------------------------------------------------------------- populations
@pytest.fixture(scope="module")
def one_after_another(tmp_path_factory):
    """The population of ``SEEDS`` trained one after the other (the reference path)."""
    out = tmp_path_factory.mktemp("sequential") / "pop"
    assert cli.main(["train", *TINY, "--seeds", "0-2", "--out", str(out)]) == 0
    return out


def lockstep(argv, capsys, monkeypatch, factory=Population):
    """``foxhunt train argv`` with the members in lockstep on ``factory``'s population."""
    real = population_cli.cmd_train_population
    monkeypatch.setattr(population_cli, "cmd_train_population",
                        functools.partial(real, population_factory=factory))
    return foxhunt(["train", *argv], capsys)


def _records(member_dir):
    return [{k: v for k, v in strict_loads(line).items() if k not in TIMING}
            for line in (member_dir / "metrics.jsonl").read_text().splitlines()]


def _summary(member_dir):
    return strict_loads((member_dir / "summary.json").read_text())


def _state(path):
    return Trainer.load(path).state_dict()


def assert_same_member(a, b):
    """Members ``a`` and ``b`` (directories) trained bit for bit alike: epoch records (but the
    wall-clock fields), summary results, and the last and best checkpoints."""
    assert _records(a) == _records(b)
    sa, sb = _summary(a), _summary(b)
    for key in ("status", "halted", "stopped_by", "seed", "config", "loop", "data", "overall"):
        assert sa[key] == sb[key], key
    for fa, fb in zip(sa["folds"], sb["folds"], strict=True):  # paths under each run's directory
        assert os.path.basename(fa.pop("checkpoint")) == os.path.basename(fb.pop("checkpoint"))
        assert fa == fb
    for name in ("last.safetensors", "fold0_best.safetensors"):
        x, y = _state(a / "checkpoints" / name), _state(b / "checkpoints" / name)
        assert x.keys() == y.keys()
        for key in x:
            assert np.array_equal(x[key], y[key]), (name, key)


class CountingPopulation(Population):
    """The reference twin, counting its steps."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = 0

    def step(self, batches):
        self.steps += 1
        return super().step(batches)


def test_lockstep_equals_one_after_another(in_tmp, capsys, monkeypatch, one_after_another):
    made = []

    def factory(config, seeds, **kwargs):
        made.append(CountingPopulation(config, seeds, **kwargs))
        return made[-1]
    rc, out, err = lockstep([*TINY, "--seeds", "0-2", "--out", "pop"], capsys, monkeypatch, factory)
    assert rc == 0, err
    (pop,) = made
    # One population step per training step of the run; every member stepped by those alone.
    assert pop.steps == STEPS and [pop.member(i).step_count for i in range(3)] == [STEPS] * 3
    for seed in SEEDS:
        member_dir = in_tmp / "pop" / f"member{seed}"
        assert_same_member(member_dir, one_after_another / f"member{seed}")
        # Its plots, drawn by the population's one pool of plot workers.
        plots = _summary(member_dir)["plots"]
        assert len(plots) == 4 and [os.path.basename(p) for p in plots] == [
            os.path.basename(p) for p in _summary(one_after_another / f"member{seed}")["plots"]]
        assert all((member_dir / os.path.basename(p)).stat().st_size > 0 for p in plots)
    got = strict_loads((in_tmp / "pop" / "population.json").read_text())
    want = strict_loads((one_after_another / "population.json").read_text())
    assert got["status"] == "completed" and got["members"] == want["members"]
    assert got["spread"] == want["spread"]
    assert "trained in lockstep" in out and "trained one after the other" not in out
    # Each member's lines carry its seed; the population's table does not.
    for seed in SEEDS:
        assert f"[seed {seed}]   run directory: pop/member{seed}\n" in out
    assert "\nseed " in out[out.index("population: overall"):]


class HaltingPopulation(Population):
    """The reference twin whose member 1 gets NaN rewards from its second step on (market data
    may hold NaN: the step takes them and the sentinels flag them): its epoch end reads a
    non-finite loss, and its run halts there (halt_nan)."""

    def step(self, batches):
        batches = list(batches)
        if self.member(1).step_count >= 1:
            batches[1] = dataclasses.replace(batches[1], r=np.full_like(batches[1].r, np.nan))
        return super().step(batches)


def _fail_on_first_record(monkeypatch):
    """Member 1's run raises once it has recorded its first epoch (after 5 steps)."""
    real = train_cli.jsonio.append_jsonl

    def append(path, obj):
        real(path, obj)
        if os.path.basename(os.path.dirname(path)) == "member1":
            raise OSError("injected failure after the first epoch")
    monkeypatch.setattr(train_cli.jsonio, "append_jsonl", append)


def _fail_before_training(monkeypatch):
    """Member 1's run raises before its first step."""
    real = train_cli.run

    def run(config, bars, settings, **kwargs):
        if settings.seed == 1:
            raise RuntimeError("injected failure before training")
        return real(config, bars, settings, **kwargs)
    monkeypatch.setattr(train_cli, "run", run)


@pytest.mark.parametrize("case", ["halts", "raises after an epoch", "raises before training"])
def test_a_member_that_ends_early_does_not_block_the_others(in_tmp, capsys, monkeypatch,
                                                            one_after_another, case):
    """Member 1 ends at its first epoch (or before it); 0 and 2 train on, bit for bit as they
    do one after the other."""
    factory = Population
    if case == "halts":
        factory = HaltingPopulation
    elif case == "raises after an epoch":
        _fail_on_first_record(monkeypatch)
    else:
        _fail_before_training(monkeypatch)
    rc, out, err = lockstep([*TINY, "--seeds", "0-2", "--out", "pop"], capsys, monkeypatch, factory)
    assert rc == 1, err
    for seed in (0, 2):
        assert_same_member(in_tmp / "pop" / f"member{seed}", one_after_another / f"member{seed}")
    population = strict_loads((in_tmp / "pop" / "population.json").read_text())
    assert population["status"] == "completed"  # every member ran; one ended early
    first, early, last = population["members"]
    assert first["status"] == last["status"] == "completed"
    if case == "halts":
        assert early["status"] == "halted" and early["exit_status"] == 1
        assert early["error"].startswith("halt_nan at fold 0 epoch 0")
        assert len(_records(in_tmp / "pop" / "member1")) == 1
    else:
        assert early["status"] == "failed" and early["overall"] is None
        assert "injected failure" in early["error"]
        assert f"[seed 1] {early['error'].split(':')[0]}: injected failure" in err  # traceback
    assert population["spread"]["test_sharpe"]["n"] == 2


def test_a_failing_population_step_fails_every_member(in_tmp, capsys, monkeypatch):
    class Failing(Population):
        def step(self, batches):
            if self.member(0).step_count == 3:
                raise FloatingPointError("injected population failure")
            return super().step(batches)
    rc, out, err = lockstep([*TINY, "--seeds", "0-2", "--out", "pop"], capsys, monkeypatch, Failing)
    assert rc == 1, err
    population = strict_loads((in_tmp / "pop" / "population.json").read_text())
    assert [m["status"] for m in population["members"]] == ["failed"] * 3
    assert {m["error"] for m in population["members"]} == {
        "PopulationStepError: the population step failed: FloatingPointError: injected "
        "population failure"}
    assert population["spread"] == {}  # over the completed members: none


def test_a_population_that_cannot_be_built_fails_every_member(in_tmp, capsys, monkeypatch):
    """(Also: the population is built for n-step transitions where the run has them, as
    ``loop.run`` builds a single trainer.)"""
    asked = []

    def factory(config, seeds, **kwargs):
        asked.append((seeds, kwargs))
        raise RuntimeError("no device")
    rc, out, err = lockstep([*TINY, "--n-step", "2", "--seeds", "3,4", "--out", "pop"], capsys,
                            monkeypatch, factory)
    assert rc == 1 and "RuntimeError: no device" in err
    assert asked == [([3, 4], {"n_step": 2})]
    population = strict_loads((in_tmp / "pop" / "population.json").read_text())
    assert [(m["seed"], m["status"], m["error"]) for m in population["members"]] == [
        (s, "failed", "the population was not built: RuntimeError: no device") for s in (3, 4)]


def test_a_signal_stops_every_member(in_tmp, capsys, monkeypatch):
    """SIGINT once member 1 has recorded its first epoch (sent from its thread; the handler
    runs in the main thread): every member has finished its first epoch's steps (lockstep), so
    each records that epoch and stops before its second: population.json partial."""
    handled = threading.Event()
    real_handle = train_cli.StopRequest.handle

    def handle(self, signum, frame):
        real_handle(self, signum, frame)
        handled.set()
    monkeypatch.setattr(train_cli.StopRequest, "handle", handle)
    real_append = train_cli.jsonio.append_jsonl

    def append_then_signal(path, obj):
        real_append(path, obj)
        if os.path.basename(os.path.dirname(path)) == "member1":
            os.kill(os.getpid(), signal.SIGINT)
            assert handled.wait(10), "the main thread did not handle the signal"
    monkeypatch.setattr(train_cli.jsonio, "append_jsonl", append_then_signal)
    rc, out, err = lockstep([*TINY, "--seeds", "0-2", "--out", "pop"], capsys, monkeypatch)
    assert rc == 128 + signal.SIGINT, err
    assert "Traceback" not in err
    population = strict_loads((in_tmp / "pop" / "population.json").read_text())
    assert population["status"] == "partial" and population["stopped_by"] == "SIGINT"
    assert population["not_run"] == []  # in lockstep every member started
    for member in population["members"]:
        assert member["status"] == "interrupted" and member["stopped_by"] == "SIGINT"
        assert member["exit_status"] == 128 + signal.SIGINT
        member_dir = in_tmp / "pop" / member["dir"]
        assert len(_records(member_dir)) == 1 and _summary(member_dir)["status"] == "interrupted"
    assert population["spread"] == {} and "partial" in out  # no member completed


def test_backend_fast_trains_in_lockstep(in_tmp, capsys, monkeypatch):
    """``--backend fast`` takes the lockstep path on ``fast_population`` (here the reference
    twin: this machine has no GPU); ``--backend reference`` keeps one after the other."""
    made = []

    def twin(config, seeds, **kwargs):
        made.append(Population(config, seeds, **kwargs))
        return made[-1]
    monkeypatch.setattr(population_cli, "fast_population", twin)
    monkeypatch.setattr(train_cli, "_check_backend", lambda name: None)
    pop_args = [*TINY, "--epochs", "1", "--steps-per-epoch", "2", "--seeds", "4,5"]
    rc, out, err = foxhunt(["train", *pop_args, "--backend", "fast", "--out", "fast"], capsys)
    assert rc == 0, err
    assert len(made) == 1 and made[0].seeds == [4, 5] and "trained in lockstep" in out
    assert [made[0].member(i).step_count for i in range(2)] == [2, 2]
    rc, out, err = foxhunt(["train", *pop_args, "--out", "ref"], capsys)
    assert rc == 0, err
    assert len(made) == 1 and "trained one after the other" in out


class HostCpuTrainer(CpuTrainer):
    """A single fast trainer on the CPU executor that the loop collects on the host (its
    ``backend_name`` is not "fast") and evaluates by its own device walk, as it does a
    population member."""

    backend_name = "cpu-host"

    def device_segments(self, bars, feats, segments):
        return device_segments(self, bars, feats, segments)


def test_cpu_population_in_lockstep_equals_its_single_trainers(in_tmp, capsys, monkeypatch):
    """``CpuPopulation`` (the fast population on the CPU executor) in lockstep: each member
    bit for bit the run of a single fast trainer of its seed (``CpuTrainer``, on the same host
    collector and evaluation), trained one after the other."""
    argv = [*TINY, "--epochs", "1", "--steps-per-epoch", "3", "--seeds", "0-1"]
    rc, _, err = lockstep([*argv, "--out", "lockstep"], capsys, monkeypatch, CpuPopulation)
    assert rc == 0, err
    monkeypatch.undo()  # the one-after-another path again, on single CPU-executor trainers
    monkeypatch.chdir(in_tmp)
    real_run = train_cli.run

    def run_on_cpu_trainer(config, bars, settings, **kwargs):
        return real_run(config, bars, settings, **{**kwargs, "backend": HostCpuTrainer})
    monkeypatch.setattr(train_cli, "run", run_on_cpu_trainer)
    rc, _, err = foxhunt(["train", *argv, "--out", "single"], capsys)
    assert rc == 0, err
    for member in ("member0", "member1"):
        assert_same_member(in_tmp / "lockstep" / member, in_tmp / "single" / member)
