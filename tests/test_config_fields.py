"""No ``DQNConfig`` field is accepted and ignored (SPEC 4; issue 18): each field, changed from
a config with every second-wave source on, changes one reference step taken from the same
state and batch, or its layout (so the step's tensors), or it is metadata by design, listed
in ``METADATA`` with the reason and shown to leave the step's state unchanged."""

import dataclasses

import numpy as np
import pytest

from foxhunt.reference.backend import READBACK_FIELDS, state_spec
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.layout import ParamLayout
from foxhunt.reference.trainer import Trainer

#: The walk's starting point: the tiny network with every second-wave source on, inside the
#: MSE warm-up (epoch 1 of 4).
BASE = DQNConfig.preset("tiny", readback_interval=1, lambda_iqn=1.0, ens_weight=0.5,
                        aux_next_bar_weight=0.1, aux_regime_weight=0.1, c51_warmup_epochs=4)
EPOCH = 1

#: field -> a changed value chosen so that its mechanism acts within one step (a bound small
#: enough to bind, a diagnostic threshold low enough to fire, ...).
CHANGED = {
    "batch_size": 16, "state_dim": 20, "shared_h1": 24, "shared_h2": 24, "value_h": 12,
    "adv_h": 12, "num_atoms": 9, "v_min": -5.0, "v_max": 5.0, "branches": (3, 3),
    "gamma": 0.5, "max_grad_norm": 1e-3, "budgets": (0.99991, 1e-5, 4e-5, 4e-5), "sigma_max": 0.01,
    "lr": 1e-2, "beta1": 0.5, "beta2": 0.5, "adam_eps": 1e-2, "weight_decay": 0.5, "tau": 0.5,
    "cql_alpha": 0.3, "precision": "f32",
    "target_q_clip_mult": 1e-3,       # Mech 1: binds the targets the MSE warm-up and IQN use
    "adam_m_diag_mult": 1e-12,        # Mech 5 thresholds: the diagnostic flags fire
    "adam_v_diag_mult": 1e-30,
    "weight_diag_mult": 1e-6,
    "grad_clip_anchor_mult": 1e-6,    # Mech 6: the anchored safety clip binds
    "grad_slow_ema_alpha": 0.5,       # Mech 6: the slow EMA's ISV slot moves faster
    "weight_clamp_mult": 1e-4,        # Mech 9: the post-Adam clamp binds
    "h2_clamp_mult": 1e-3,            # Mech 10: the h2 clamp binds
    "h2_diag_mult": 1e-6,             # slot 49 fires
    "aux_guard_mult": 1e-12,          # the auxiliary trunk guard binds
    "lambda_iqn": 0.3, "ens_weight": 0.2, "c51_warmup_epochs": 2, "iqn_quantiles": 3,
    "iqn_embed": 5, "ens_heads": 4, "aux_next_bar_weight": 0.5, "aux_regime_weight": 0.5,
    "aux_hidden": 7, "n_regimes": 4,
    # Issue 19's switches: each turns on producers whose ISV slots the step then writes.
    "adaptive_signals": True, "q_stats": True, "gamma_schedule": True,
    "cql_alpha_ramp": True,           # ISV 48 ramps toward cql_alpha (1 - ISV[41]) (41 = 0.5)
    "adaptive_epsilon_tau": True,     # ISV 41/42 written; Polyak reads 42 (0 in the state)
    "adaptive_atoms": True,           # the live support of ISV 23-30 (its PREREQUISITES on)
}

#: field -> the fields its changed value needs (a one-line error otherwise): the step with the
#: changed value is compared with the step of ``BASE`` with these alone.
PREREQUISITES = {
    "adaptive_atoms": {"q_stats": True, "c51_warmup_epochs": 0},
}
#: field -> ISV slots set in the shared state before both steps: the support slots away from
#: their cold start (which is the fixed support itself).
STATE_ISV = {
    "adaptive_atoms": {"V_CENTER_DIR": 0.5, "V_HALF_DIR": 3.0, "V_HALF_ORD": 20.0},
}

#: field -> (a valid changed value, why it does not change the step).
METADATA = {
    "readback_interval": (7, "when the step's scalars are read back (SPEC 9's deferred "
                             "readback), not what the step computes: tests/test_readback.py"),
    "atom_growth_mult": (50.0, "Mech 2 bounds the atoms, and the support is fixed: the bound "
                               "is checked once, at construction (max(|v_min|, |v_max|) <= "
                               "atom_growth_mult, tests/test_config.py)"),
}


def test_the_walk_covers_every_field():
    fields = {f.name for f in dataclasses.fields(DQNConfig)}
    assert set(CHANGED) | set(METADATA) == fields
    assert not set(CHANGED) & set(METADATA)


def _start() -> tuple[dict, Batch]:
    """The shared state (after one warm-up step, so Adam and the ISV are not at their cold
    starts) and the batch of the compared step."""
    trainer = Trainer(BASE, seed=3)
    trainer.set_epoch(EPOCH)
    trainer.set_loop_signals(epsilon=(0.5, 1.0))  # ISV 41, the ramp's exploration share
    rng = np.random.default_rng(3)
    trainer.step(Batch.random(BASE, rng))
    return trainer.state_dict(), Batch.random(BASE, rng)


STATE, BATCH = _start()


def _step(config: DQNConfig, batch: Batch, isv: dict | None = None) -> tuple[dict, tuple]:
    """One step of ``config`` from ``STATE`` (its ISV slots ``isv`` set first): the state's bits
    after it and the read scalars."""
    trainer = Trainer(config, seed=3)
    trainer.load_state_dict({k: v.copy() for k, v in STATE.items()})
    for name, value in (isv or {}).items():
        trainer.isv.set(name, value)
    scalars = trainer.step(batch)
    values = tuple(getattr(scalars, f) for f in READBACK_FIELDS)
    return {k: v.tobytes() for k, v in trainer.state_dict().items()}, (values, scalars.flags,
                                                                       scalars.fresh)


def _same_state_shape(a: DQNConfig, b: DQNConfig) -> bool:
    return ParamLayout(a).canonical() == ParamLayout(b).canonical() and \
        state_spec(a) == state_spec(b)


BASE_RESULT = _step(BASE, BATCH)


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_changing_a_field_changes_the_step(field):
    base = BASE.replace(**PREREQUISITES.get(field, {}))
    isv = STATE_ISV.get(field)
    base_result = BASE_RESULT if base == BASE and not isv else _step(base, BATCH, isv)
    config = base.replace(**{field: CHANGED[field]})
    assert getattr(config, field) != getattr(base, field)
    if not _same_state_shape(base, config):
        # The field shapes the parameters: the step has other tensors. It still trains.
        assert ParamLayout(config).canonical() != ParamLayout(BASE).canonical()
        trainer = Trainer(config, seed=3)
        trainer.set_epoch(EPOCH)
        out = trainer.step(Batch.random(config, np.random.default_rng(0)))
        assert out.all_finite()
        return
    batch = BATCH
    if field == "batch_size":  # the same samples, fewer of them
        batch = Batch(*(None if x is None else x[:config.batch_size]
                        for x in dataclasses.astuple(BATCH)))
    state, scalars = _step(config, batch, isv)
    assert (state, scalars[:2]) != (base_result[0], base_result[1][:2]), \
        f"{field}={CHANGED[field]!r} changed nothing in the step"


@pytest.mark.parametrize("field", sorted(METADATA))
def test_metadata_fields_leave_the_step_unchanged(field):
    value, _why = METADATA[field]
    config = BASE.replace(**{field: value})
    assert _same_state_shape(BASE, config)
    state, (values, flags, fresh) = _step(config, BATCH)
    assert state == BASE_RESULT[0] and flags == BASE_RESULT[1][1]
    if field == "readback_interval":  # what it does change: whether this step was read
        assert fresh != BASE_RESULT[1][2]
    else:
        assert values == BASE_RESULT[1][0]
