"""The reference `Trainer`: determinism, learning, NaN injection, fold boundary, and a run of
the production (`seed`) preset from outside the repository.

Expected sentinel sets follow from SPEC 4-6 and the kernels' NaN contracts (each case says
why); the trainer's own buffers are never used to derive them.
"""

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest

from foxhunt.reference import isv as isv_mod
from foxhunt.reference import sentinels
from foxhunt.reference import trainer as trainer_mod
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import dense
from foxhunt.reference.trainer import Trainer


def fired(trainer: Trainer) -> set[str]:
    return set(sentinels.flagged_names(trainer.flags))


def assert_state_bitwise_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), f"state[{k!r}] differs"


def learnable_batches(config: DQNConfig, n: int = 4, seed: int = 7) -> list[Batch]:
    """A fixed replay set: rewards a deterministic function of state and action.

    ``r = sign(s_0) * (3 if a_0 == 1 else -1) + a_1``, 75% terminal (so most targets are the
    reward itself), unit importance weights.
    """
    rng = np.random.default_rng(seed)
    B, SD = config.batch_size, config.state_dim
    out = []
    for _ in range(n):
        s = rng.standard_normal((B, SD)).astype(np.float32)
        a = np.stack([rng.integers(0, k, B) for k in config.branches], axis=1).astype(np.int32)
        r = (np.where(s[:, 0] > 0, 1.0, -1.0) * np.where(a[:, 0] == 1, 3.0, -1.0) + a[:, 1])
        out.append(Batch(s=s, a=a, r=r.astype(np.float32),
                         s2=rng.standard_normal((B, SD)).astype(np.float32),
                         done=(rng.random(B) < 0.75).astype(np.float32),
                         isw=np.ones(B, np.float32)).validate(config))
    return out


# ------------------------------------------------------------------ 200 steps on `tiny`
def test_200_steps_deterministic_learning_and_no_sentinel():
    config = DQNConfig.preset("tiny", readback_interval=1, lr=1e-3)
    batches = learnable_batches(config)
    a, b = Trainer(config, seed=11), Trainer(config, seed=11)
    losses, c51_losses = [], []
    for i in range(200):
        sa = a.step(batches[i % len(batches)])
        sb = b.step(batches[i % len(batches)])
        assert sa == sb, f"step {i + 1}: scalars differ"
        assert sa.fresh and sa.read_at == i + 1
        losses.append(sa.loss)
        c51_losses.append(sa.c51_loss)

    assert_state_bitwise_equal(a.state_dict(), b.state_dict())
    assert a.params_bf16.tobytes() == b.params_bf16.tobytes()
    assert a.target_bf16.tobytes() == b.target_bf16.tobytes()

    assert all(math.isfinite(x) for x in losses)
    first, last = np.mean(losses[:20]), np.mean(losses[-20:])
    assert last < 0.8 * first, (first, last)
    assert np.mean(c51_losses[-20:]) < 0.8 * np.mean(c51_losses[:20])
    assert not a.flags.any(), sentinels.format_flags(a.flags)
    assert not any(sa.flags)


def test_different_seed_differs():
    """Control for the determinism test: the comparison can see a difference."""
    config = DQNConfig.preset("tiny", readback_interval=1)
    batch = learnable_batches(config, n=1)[0]
    a, b = Trainer(config, seed=1), Trainer(config, seed=2)
    assert a.step(batch).loss != b.step(batch).loss
    assert a.params.tobytes() != b.params.tobytes()


def test_step_rejects_an_invalid_batch_by_field():
    config = DQNConfig.preset("tiny")
    trainer = Trainer(config)
    batch = Batch.random(config, np.random.default_rng(0))
    bad = dataclasses.replace(batch, r=batch.r[:-1])
    with pytest.raises(ValueError, match=r"batch\.r"):
        trainer.step(bad)
    assert trainer.step_count == 0


# ------------------------------------------------------------------ NaN injection
def warm_trainer(seed: int = 1, steps: int = 3) -> tuple[Trainer, np.random.Generator]:
    config = DQNConfig.preset("tiny", readback_interval=1)
    trainer = Trainer(config, seed=seed)
    rng = np.random.default_rng(seed + 100)
    for _ in range(steps):
        trainer.step(Batch.random(config, rng))
    assert not trainer.flags.any()
    return trainer, rng


def poisoned(batch: Batch, field: str, value: float, index: int = 5) -> Batch:
    arr = getattr(batch, field).copy()
    arr.flat[index] = value
    return dataclasses.replace(batch, **{field: arr})


GRADS = {"grad_c51", "grad_cql", "grad_buf"}
C51_BACKWARD = {"d_value_logits", "d_adv_logits", "d_h2_post_main", "grad_c51", "grad_buf"}

BATCH_CASES = {
    # s[b] NaN: h1 and h2 (before the Mech 10 clamp) of row b are NaN; the clamp makes h2 0,
    # so every head output and loss is finite. Backward: d h2 is zeroed where the clamp acted,
    # but the weight gradients of the trunk take 0 * NaN products (w_s1: dh1^T s, w_s2:
    # dh2^T h1), so both raw gradients and their sum hold NaN, which Adam skips.
    ("s", np.nan): {"states", "h1", "h2"} | GRADS,
    ("s", np.inf): {"states", "h1", "h2"} | GRADS,
    # r[b] NaN: the projection propagates NaN (m[b] NaN, c51_project's contract), so the C51
    # loss, td_errors[b], the C51 logit gradients and everything downstream of the C51
    # backward; Mech 1's comparison clip keeps the NaN target visible. CQL does not use r.
    ("r", np.nan): {"rewards", "projected_dist", "td_errors", "c51_loss",
                    "target_q_post_clip"} | C51_BACKWARD,
    # r[b] = +Inf: the projection clips it to v_max (a finite row) and Mech 1 clips the scalar
    # target to 100 * max(Q_ABS_REF, 1), which is above the 95x diagnostic threshold of slot 46.
    ("r", np.inf): {"rewards", "target_q_post_clip"},
    # isw[b] NaN: it scales the C51 loss and the C51 logit gradient of row b only (td_errors
    # are the unweighted per-sample losses; CQL is unweighted). A host batch never carries one
    # (Batch.validate refuses it: test_an_invalid_batch_leaves_the_trainer_unchanged); the
    # case bypasses validation because slot 23 guards weights that reach the step otherwise.
    ("isw", np.nan): {"importance_weights", "c51_loss"} | C51_BACKWARD,
}


@pytest.mark.parametrize("field, value", list(BATCH_CASES), ids=lambda x: str(x))
def test_batch_injection_fires_the_right_slots(field, value, monkeypatch):
    trainer, rng = warm_trainer()
    if field == "isw":  # see BATCH_CASES: Batch.validate would refuse it
        monkeypatch.setattr(Batch, "validate", lambda self, config: self)
    batch = poisoned(Batch.random(trainer.config, rng), field, value)
    with np.errstate(all="ignore"):
        out = trainer.step(batch)
    assert fired(trainer) == BATCH_CASES[field, value]
    assert np.isfinite(trainer.params).all() and np.isfinite(trainer.target).all()
    assert np.isfinite(trainer.isv.to_array()[[isv_mod.Q_ABS_REF_INDEX, isv_mod.H_S2_RMS_EMA_INDEX]]).all()
    loss_nonfinite = "c51_loss" in BATCH_CASES[field, value]
    assert math.isnan(out.loss) == loss_nonfinite
    assert out.all_finite() != loss_nonfinite
    # Flags are sticky; the next clean step trains normally on finite parameters.
    out = trainer.step(Batch.random(trainer.config, rng))
    assert fired(trainer) == BATCH_CASES[field, value]
    assert math.isfinite(out.loss) and np.isfinite(trainer.params).all()


def test_next_state_injection_stops_at_the_h2_clamp():
    """s2[b] NaN reaches h1/h2 of the online(s2) and target(s2) passes only; after the Mech 10
    clamp everything is finite, so no slot after the trunk may fire. (Whether h1/h2 of those
    passes are watched is a property of the slot table; see the report.)"""
    trainer, rng = warm_trainer()
    batch = poisoned(Batch.random(trainer.config, rng), "s2", np.nan)
    with np.errstate(all="ignore"):
        out = trainer.step(batch)
    assert "next_states" in fired(trainer)
    assert fired(trainer) <= {"next_states", "h1", "h2"}
    assert out.all_finite()
    assert np.isfinite(trainer.params).all() and np.isfinite(trainer.target).all()


def test_trunk_param_injection_is_caught_and_repaired():
    """w_s1[i, j] = NaN: h1[:, i] and therefore every h2 element (before the clamp) are NaN;
    the clamp zeroes h2, so the heads are finite. The trunk's d h2 is then all zero, the NaN
    weight's gradient is exactly 0, Adam updates it and Mech 9's clamp_finite writes 0."""
    trainer, rng = warm_trainer()
    spec = trainer.layout["w_s1"]
    k = spec.offset + 3 * spec.shape[1] + 4
    trainer.params[k] = np.nan
    with np.errstate(all="ignore"):
        out = trainer.step(Batch.random(trainer.config, rng))
    assert {"h1", "h2"} <= fired(trainer)
    assert fired(trainer) == {"h1", "h2"} | GRADS
    assert np.isfinite(trainer.params).all() and np.isfinite(trainer.target).all()
    assert trainer.params[k] == 0.0
    assert out.all_finite()


def test_head_param_injection_fires_by_name_and_forces_a_fresh_read():
    """w_v2[i, j] = NaN: value logits column i is NaN for every row, so every branch's logits,
    log-probabilities, both losses and both raw gradients are NaN. The slots after the
    optimiser fire too (see the report: the NaN weight's own gradient is NaN, so Adam skips it
    and Mech 9 never sees it)."""
    config = DQNConfig.preset("tiny", readback_interval=100)
    trainer = Trainer(config, seed=1)
    rng = np.random.default_rng(5)
    for _ in range(99):
        trainer.step(Batch.random(config, rng))
    trainer.params[trainer.layout["w_v2"].offset + 7] = np.nan
    with np.errstate(all="ignore"):
        out = trainer.step(Batch.random(config, rng))
    expected = {"online_value_logits", "online_next_logits", "current_logp", "td_errors",
                "c51_loss", "cql_loss", "d_value_logits", "cql_d_value_logits",
                "grad_c51", "grad_cql", "grad_buf"}
    assert expected <= fired(trainer), sentinels.format_flags(trainer.flags)
    assert "params" in fired(trainer)
    assert out.fresh and out.read_at == 100 and math.isnan(out.loss)
    with np.errstate(all="ignore"):
        nxt = trainer.step(Batch.random(config, rng))
    assert nxt.fresh and nxt.read_at == 101


def _patch_grads(monkeypatch, edit):
    """Make the trainer's ``loss_and_grads`` return raw gradients edited by ``edit(out)``."""
    real = trainer_mod.loss_and_grads

    def patched(*args, **kwargs):
        out = real(*args, **kwargs)
        out["grad_c51"] = out["grad_c51"].copy()
        out["grad_cql"] = out["grad_cql"].copy()
        edit(out)
        return out

    monkeypatch.setattr(trainer_mod, "loss_and_grads", patched)


def _set(key, index, value):
    def edit(out):
        out[key][index] = value
    return edit


def _both(*edits):
    def edit(out):
        for e in edits:
            e(out)
    return edit


def test_nonfinite_cql_gradient_is_skipped_exactly(monkeypatch):
    """+Inf in the CQL buffer: its norm skips it and the guarded SAXPY skips it, so the step
    equals, bit for bit, a step whose CQL gradient has 0 there; only slot grad_cql fires."""
    trainer, rng = warm_trainer()
    twin, _ = warm_trainer()
    batch = Batch.random(trainer.config, rng)
    k = trainer.layout["w_v1"].offset + 5
    with monkeypatch.context() as m:
        _patch_grads(m, _set("grad_cql", k, np.inf))
        out = trainer.step(batch)
    with monkeypatch.context() as m:
        _patch_grads(m, _set("grad_cql", k, 0.0))
        ref = twin.step(batch)
    assert fired(trainer) == {"grad_cql"}
    assert not twin.flags.any()
    assert dataclasses.replace(out, flags=ref.flags) == ref
    state, ref_state = trainer.state_dict(), twin.state_dict()
    state["flags"] = ref_state["flags"]
    assert_state_bitwise_equal(state, ref_state)


def test_nonfinite_c51_gradient_skips_only_that_element(monkeypatch):
    """NaN in the C51 buffer at a bias element k: it stays NaN in grad_buf (a multiply by the
    clip scale, then the SAXPY keeps a non-finite y), Adam's guard skips element k (param, m, v
    kept bit for bit). Everything else equals a step with 0 at k in both raw buffers."""
    trainer, rng = warm_trainer()
    twin, _ = warm_trainer()
    batch = Batch.random(trainer.config, rng)
    k = trainer.layout["b_s1"].offset + 2  # a bias: spectral norm leaves it alone
    before = trainer.state_dict()
    with monkeypatch.context() as m:
        _patch_grads(m, _set("grad_c51", k, np.nan))
        out = trainer.step(batch)
    with monkeypatch.context() as m:
        _patch_grads(m, _both(_set("grad_c51", k, 0.0), _set("grad_cql", k, 0.0)))
        ref = twin.step(batch)
    assert fired(trainer) == {"grad_c51", "grad_buf"}
    assert math.isfinite(out.loss) and out.all_finite()
    for name in ("c51_norm_pre", "c51_norm_post", "grad_norm"):
        assert getattr(out, name) == getattr(ref, name), name
    for key in ("params", "adam_m", "adam_v"):
        got, want = trainer.state_dict()[key], twin.state_dict()[key]
        assert got[k].tobytes() == before[key][k].tobytes(), key
        assert before[key][k] != want[k], key  # the twin did update element k
        mask = np.arange(got.size) != k
        assert got[mask].tobytes() == want[mask].tobytes(), key
    assert np.isfinite(trainer.params).all() and np.isfinite(trainer.target).all()


def test_nonfinite_gradients_in_both_buffers(monkeypatch):
    trainer, rng = warm_trainer()
    with monkeypatch.context() as m:
        _patch_grads(m, _both(_set("grad_c51", 0, np.nan), _set("grad_c51", 40, -np.inf),
                              _set("grad_cql", 1, np.inf), _set("grad_cql", 40, np.nan)))
        trainer.step(Batch.random(trainer.config, rng))
    assert fired(trainer) == GRADS
    assert np.isfinite(trainer.params).all() and np.isfinite(trainer.target).all()


# ------------------------------------------------------------------ fold boundary
def test_fold_boundary():
    trainer, rng = warm_trainer(steps=6)
    with np.errstate(all="ignore"):
        trainer.step(poisoned(Batch.random(trainer.config, rng), "r", np.nan))
    trainer.isv.set("LOSS_EMA", 5.0)
    trainer.isv.set("GRAD_SCALE_LIMIT", 8.0)  # SoftReset(500), cold start 0
    assert trainer.flags.any() and trainer.adam_t == 7
    assert trainer.target.tobytes() != trainer.params.tobytes()
    assert trainer.adam_m.any() and trainer.adam_v.any()
    isv_before = trainer.isv.to_array()
    params_before = trainer.params.copy()
    slow_ema = trainer.isv.get("GRAD_NORM_SLOW_EMA")
    assert slow_ema > 0
    for name, cold in (("Q_ABS_REF", 0.0), ("H_S2_RMS_EMA", 1.0)):
        assert trainer.isv.get(name) != np.float32(cold), name  # the producers moved them

    trainer.fold_boundary()

    assert trainer.params.tobytes() == params_before.tobytes()
    assert trainer.target.tobytes() == trainer.params.tobytes()
    assert trainer.target_bf16.tobytes() == dense.f32_to_bf16(trainer.params).tobytes()
    assert trainer.params_bf16.tobytes() == trainer.target_bf16.tobytes()
    assert not trainer.adam_m.any() and not trainer.adam_v.any() and trainer.adam_t == 0
    assert trainer.adam_m.dtype == trainer.adam_v.dtype == np.float32
    assert not trainer.flags.any()
    after = trainer.isv.to_array()
    for s in isv_mod.REGISTRY:
        if s.reset.kind == "FoldReset":
            assert after[s.index] == np.float32(s.cold_start), s.name
        elif s.reset.kind in ("CrossFold", "SchemaContract"):
            assert after[s.index].tobytes() == isv_before[s.index].tobytes(), s.name
    assert trainer.isv.get("GRAD_SCALE_LIMIT") == np.float32(4.0)  # one half-life
    assert trainer.isv.get("GRAD_NORM_SLOW_EMA").tobytes() == slow_ema.tobytes()
    assert trainer.isv.read_fingerprint() == isv_mod.LAYOUT_FINGERPRINT

    out = trainer.step(Batch.random(trainer.config, rng))
    assert trainer.adam_t == 1 and math.isfinite(out.loss) and not trainer.flags.any()


# ------------------------------------------------------------------ from outside the repo
SEED_RUN = """
import math
import numpy as np
import foxhunt.reference.trainer as tm
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.trainer import Trainer
cfg = DQNConfig.preset('seed')
trainer = Trainer(cfg)
rng = np.random.default_rng(0)
print('module', tm.__file__)
for _ in range(20):
    trainer.step(Batch.random(cfg, rng))
    s = trainer.end_epoch()
    print('norms', s.step, int(s.fresh), s.c51_norm_pre, s.c51_norm_post, s.cql_norm_pre,
          s.cql_norm_post, s.grad_norm, s.loss)
"""


def test_seed_preset_20_steps_from_outside_the_repo(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SEED_RUN], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    module = [ln.split(maxsplit=1)[1] for ln in lines if ln.startswith("module ")]
    assert len(module) == 1 and not module[0].startswith(str(tmp_path))
    rows = [ln.split()[1:] for ln in lines if ln.startswith("norms ")]
    assert len(rows) == 20
    config = DQNConfig.preset("seed")
    for k, row in enumerate(rows, start=1):
        step, fresh, *numbers = row
        assert int(step) == k and fresh == "1"
        c51_pre, c51_post, cql_pre, cql_post, grad_norm, loss = map(float, numbers)
        assert all(math.isfinite(x) for x in (c51_pre, c51_post, cql_pre, cql_post, grad_norm, loss))
        assert 0 < c51_post <= min(c51_pre, config.budget("c51")) * (1 + 1e-6)
        assert 0 < cql_post <= min(cql_pre, config.budget("cql")) * (1 + 1e-6)
        assert 0 < grad_norm <= (c51_post + cql_post) * (1 + 1e-6)
        assert loss > 0


# ------------------------------------------------------------------ issue 17: contract details
def test_last_td_errors_before_any_step_raises_the_documented_error():
    config = DQNConfig.preset("tiny")
    trainer = Trainer(config, seed=2)
    with pytest.raises(RuntimeError, match=r"last_td_errors\(\): no step has run yet"):
        trainer.last_td_errors()
    trainer.step(Batch.random(config, np.random.default_rng(2)))
    assert trainer.last_td_errors().shape == (config.batch_size,)
    trainer.load_state_dict(trainer.state_dict())  # a loaded state has no last step
    with pytest.raises(RuntimeError, match="no step has run yet"):
        trainer.last_td_errors()


def test_the_batch_is_validated_once_per_step(monkeypatch):
    config = DQNConfig.preset("tiny")
    trainer = Trainer(config, seed=3)
    batch = Batch.random(config, np.random.default_rng(3))
    calls = []
    validate = Batch.validate

    def counted(self, cfg):
        calls.append(self)
        return validate(self, cfg)

    monkeypatch.setattr(Batch, "validate", counted)
    trainer.step(batch)
    trainer.step(batch)
    assert len(calls) == 2


@pytest.mark.parametrize("field, value, match", [
    ("done", 0.5, r"batch\.done\[5\]=.*allowed values are 0 and 1"),
    ("isw", np.nan, r"batch\.isw\[5\]=nan")], ids=["done", "isw"])
def test_an_invalid_batch_leaves_the_trainer_unchanged(field, value, match):
    config = DQNConfig.preset("tiny")
    trainer = Trainer(config, seed=5)
    before = trainer.state_dict()
    bad = poisoned(Batch.random(config, np.random.default_rng(5)), field, value)
    with pytest.raises(ValueError, match=match):
        trainer.step(bad)
    after = trainer.state_dict()
    assert trainer.step_count == 0
    assert all(np.array_equal(after[k], before[k]) for k in before)


def test_load_state_dict_checks_everything_before_loading_anything():
    config = DQNConfig.preset("tiny")
    trainer = Trainer(config, seed=0)
    before = trainer.state_dict()
    other = Trainer(config, seed=1).state_dict()
    foreign = dict(other, isv=other["isv"].copy())
    foreign["isv"].view(np.uint32)[isv_mod.FINGERPRINT_LO_INDEX] ^= 1  # another registry's vector
    with pytest.raises(isv_mod.FingerprintMismatch):
        trainer.load_state_dict(foreign)
    assert all(np.array_equal(trainer.state_dict()[k], before[k]) for k in before)  # nothing loaded
    for change, match in (
        ({"adam_t": other["adam_t"].astype(np.int32)}, r"state\['adam_t'\]: shape \(1,\) dtype int32"),
        ({"params": other["params"][:-1]}, r"state\['params'\]: shape"),
        ({"step": 3}, r"state\['step'\]: expected a numpy array, got int"),
    ):
        with pytest.raises(ValueError, match=match):
            trainer.load_state_dict({**other, **change})
    with pytest.raises(ValueError, match=r"state mismatch: missing \['step'\], unexpected \['extra'\]"):
        trainer.load_state_dict({**{k: v for k, v in other.items() if k != "step"}, "extra": other["step"]})
    assert all(np.array_equal(trainer.state_dict()[k], before[k]) for k in before)


def test_the_backend_interface_imports_no_trainer():
    """backend.py names the trainers by module path; importing it loads neither (no import cycle)."""
    code = ("import sys, foxhunt.reference.backend as b; "
            "print(sorted(m for m in sys.modules if m.endswith('.trainer') or m.startswith('foxhunt.fast')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    from foxhunt.reference.backend import get_backend

    assert get_backend("reference") is Trainer
    with pytest.raises(ValueError, match="backend='gpu': allowed values are 'reference' and 'fast'"):
        get_backend("gpu")


def test_get_backend_passes_a_trainer_factory_through():
    """longrun_seeds' F32-alt variant hands the loop ``partial(fast.Trainer, gemm_workspace=...)``."""
    import functools

    from foxhunt.reference.backend import get_backend

    factory = functools.partial(Trainer, seed=3)
    assert get_backend(factory) is factory
    trainer = get_backend(factory)(DQNConfig.preset("tiny"))
    reference = Trainer(DQNConfig.preset("tiny"), seed=3)
    assert all(np.array_equal(v, reference.state_dict()[k]) for k, v in trainer.state_dict().items())


@pytest.mark.parametrize("precision", ["bf16", "f32", "tf32"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["shared-support", "adaptive-atoms"])
def test_frozen_q_values_are_q_values_until_the_next_step(precision, adaptive):
    """``frozen_q_values()`` (an evaluation walk's one-state calls, its weights rounded once)
    gives ``q_values``' bits, state by state and for the batch; after a step (which a walk does
    not make: the frozen function is then stale) a new frozen function follows the step."""
    on = {"adaptive_atoms": True, "q_stats": True} if adaptive else {}
    config = DQNConfig.preset("tiny", precision=precision, **on)
    rng = np.random.default_rng(3)
    t = Trainer(config, seed=2)
    for _ in range(3):
        t.step(Batch.random(config, rng))
    states = rng.standard_normal((5, config.state_dim)).astype(np.float32)
    frozen = t.frozen_q_values()
    before = t.q_values(states)
    for k in range(len(states)):
        got = frozen(states[k:k + 1])
        want = t.q_values(states[k:k + 1])
        assert len(got) == len(config.branches)
        for g, w in zip(got, want):
            assert g.dtype == np.float32 and np.array_equal(g.view(np.uint32), w.view(np.uint32))
    for b, f in zip(before, frozen(states)):
        assert np.array_equal(f.view(np.uint32), b.view(np.uint32))
    t.step(Batch.random(config, rng))
    after = t.q_values(states)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))  # the step moved them
    for a, f in zip(after, t.frozen_q_values()(states)):
        assert np.array_equal(f.view(np.uint32), a.view(np.uint32))
