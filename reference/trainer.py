"""The reference `Trainer`: SPEC 4 on the CPU, step by step, with every safety mechanism.

One ``step(batch)``, in order:

1. ``loss_and_grads``: three forward passes (Mech 10 clamps ``h2`` to
   ``h2_clamp_mult * max(ISV[H_S2_RMS_EMA], 1)``, its NaN check runs *before* the clamp), C51 and
   CQL losses (Mech 1 clips the scalar target Q), backward of each into its own buffer.
   Second-wave sources whose weight is > 0 (``step.loss_and_grads``): the MSE warm-up blend,
   the auxiliary heads (into the C51 gradient), the IQN head and the ensemble diversity (own
   scratch buffers).
2. Budget pipeline: ``grad = clip(grad_c51, 0.70 mgn)``; ``grad += clipped(grad_cql, 0.15 mgn)``
   (guarded, clipped SAXPY); then ``grad[0:trunk_end] += lambda_iqn * clipped(iqn, 0.10 mgn)``
   and ``grad[0:value_end] += ens_weight * clipped(ens, 0.05 mgn)`` (``budgets``).
3. Adam over ``[0, main_adam_end)`` (the core and the aux heads): global safety clip at Mech 6's
   anchored bound ``min(mgn, 100 * max(slow_ema, 1))`` (the slow EMA, alpha 0.001, is updated
   after the clip and persists across folds), per-element isfinite guard, bias correction,
   Mech 9 weight clamp ``100 * max(ISV[Q_ABS_REF], 1)``. With IQN on, the IQN head's own Adam
   over ``layout.iqn_range`` (same hyperparameters, clamp and ``adam_t``; its gradient clipped
   at ``max_grad_norm`` by its own norm). The ensemble priors are never updated.
4. Spectral norm on every trained weight matrix (one batched power iteration; core, aux, IQN).
5. BF16 mirror of the params; Polyak target update and its mirror.
6. ISV producers (Q_ABS_REF from the taken-action Q, H_S2_RMS_EMA from h2; AUX_LABEL_SCALE_EMA,
   with the next-bar head on, as ``loss_and_grads`` updated it from the batch's returns); the fused sentinel check
   (Mech 5 thresholds relative to ``max(ISV[Q_ABS_REF], 1)``); deferred readback.

``set_epoch(epoch)`` writes ISV ``EPOCH_IDX`` (the MSE warm-up's clock); the loop calls it at
each epoch start.

The step's own bookkeeping is the fast step's kernels' reference twins (``kernels.step``):
``step_bounds`` (the ISV-driven bounds, the thresholds, Adam's counter) and ``step_scalars``
(the total norm, the safety-clip factor, the readback block, the slow EMA).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import isv as isv_mod
from . import isv_step, sentinels
from .backend import (READBACK_FIELDS, DeferredReadback, StepScalars, TrainerBackend, check_epoch,
                      validate_state_dict)
from .batch import Batch
from .budgets import budget_pipeline, second_wave_budgets
from .config import DQNConfig
from .kernels import dense, optim, safety, spectral
from .kernels import isv as isv_kernels
from .kernels import step as step_kernels
from .layout import ParamLayout, init_params
from .network import forward, forward_weights, q_values
from .step import check_batch_kind, check_n_step, loss_and_grads, step_supports

#: The Mech 6 slow grad-norm EMA lives in this ISV slot (CrossFold: kept at fold boundaries).
SLOW_EMA = "GRAD_NORM_SLOW_EMA"

#: Rate of the Q_ABS_REF and H_S2_RMS_EMA producers.
ISV_PRODUCER_ALPHA = 0.01


class Trainer(TrainerBackend):
    """Reference (NumPy, CPU) trainer; see the module docstring for the step."""

    backend_name = "reference"

    def __init__(self, config: DQNConfig, seed: int = 0, n_step: int = 1):
        self.config = config
        self.seed = int(seed)
        #: Built for n-step transitions (issue 22): its batches carry ``discount`` (and 1-step
        #: ones must not), as ``fast.Trainer(n_step=)``'s.
        self.n_step_on = check_n_step(config, n_step)
        self.layout = ParamLayout(config)
        self.params = init_params(self.layout, seed)
        self.target = self.params.copy()
        self.adam_m = self.layout.zeros()
        self.adam_v = self.layout.zeros()
        self.adam_t = 0
        self.sn_u: list[np.ndarray] = []
        self.sn_v: list[np.ndarray] = []
        for i, w in enumerate(self.layout.weight_matrices):
            u, v = spectral.init_spectral_vectors(w.shape, seed * 1000 + i)
            self.sn_u.append(u)
            self.sn_v.append(v)
        # The per-branch gamma and CQL alpha slots describe this config (the step reads the
        # config); their cold starts are the config's, so a fold reset keeps them.
        self.isv = isv_mod.bus_for(config)
        self._eps_schedule = np.array(isv_step.EPS_SCHEDULE_COLD, np.float32)  # the loop's
        self._flags = np.zeros(sentinels.NUM_SENTINEL_SLOTS, np.int32)
        self._thresholds = sentinels.threshold_table(config)
        self.step_count = 0
        self._refresh_mirrors()
        self._readback = DeferredReadback(config.readback_interval, len(self._flags))
        self._current: StepScalars | None = None
        self._td_errors: np.ndarray | None = None

    # ------------------------------------------------------------------ helpers
    def _refresh_mirrors(self) -> None:
        self.params_bf16 = dense.f32_to_bf16(self.params)
        self.target_bf16 = dense.f32_to_bf16(self.target)

    def _bound(self, mult: float, slot: str) -> np.float32:
        return np.float32(safety.isv_bound(np.float32(mult), self.isv.get(slot)))

    @property
    def flags(self) -> np.ndarray:
        return self._flags

    def _inline_check(self, slot: str, buffer: np.ndarray) -> None:
        i = sentinels.index(slot)
        self._flags[i] = safety.nan_check(buffer, self._flags[i])

    # ------------------------------------------------------------------ the step
    def step(self, batch: Batch) -> StepScalars:
        c = self.config
        check_batch_kind(batch, self.n_step_on)
        isv_at_start = self.isv.to_array()
        slow = isv_mod.GRAD_NORM_SLOW_EMA_INDEX
        # The step's ISV-driven bounds (Mech 9's weight clamp, Mech 6's anchored safety clip, the
        # Mech 5 sentinel thresholds) and Adam's step counter, from the ISV at the start.
        bounds = step_kernels.step_bounds(
            isv_at_start, np.array([self.adam_t], np.int64), *self._thresholds,
            isv_mod.Q_ABS_REF_INDEX, slow, c.weight_clamp_mult, c.max_grad_norm,
            c.grad_clip_anchor_mult)
        q_abs_ref = np.float32(self.isv.get("Q_ABS_REF"))
        h2_bound = self._bound(c.h2_clamp_mult, "H_S2_RMS_EMA")
        # The gamma schedule's and the CQL-alpha ramp's consumers: from the ISV at the start.
        step_config = isv_step.step_config(c, isv_at_start)
        # loss_and_grads validates the batch (its only validation in the step), before any
        # state of this trainer changes.
        out = loss_and_grads(step_config, self.params, self.target, batch, q_abs_ref=q_abs_ref,
                             h2_bound=h2_bound, layout=self.layout, isv=isv_at_start,
                             step=self.step_count, seed=self.seed, gamma_ref=c.gammas[0])
        self.step_count += 1
        # Inline checks: Mech 10's h2 check sees the buffer before the clamp sanitises it;
        # d_h2 is snapshotted right after the main (C51) backward, after the auxiliary heads'
        # SAXPY into it, and after the IQN d h2 copy into it.
        self._inline_check("h2", out["online"].h2_pre_clamp)
        self._inline_check("d_h2_post_main", out["trace_c51"]["d_h2"])
        if out["aux"] is not None:
            self._inline_check("d_h2_post_aux", out["trace_c51"]["d_h2_post_aux"])
        if out["iqn"] is not None:
            self._inline_check("d_h2_post_iqn", out["iqn"].d_h2_guarded)

        # Budget pipeline (SPEC 4 step 5); then the step scalars: the total norm (one partial,
        # the whole buffer), Adam's Mech 6 safety-clip factor, the readback block and the slow
        # EMA; then Adam with that clip and Mech 9's weight clamp.
        grad, norms = budget_pipeline(c, out["grad_c51"], out["grad_cql"])
        grad, wave = second_wave_budgets(
            c, self.layout, grad,
            iqn_trunk=None if out["iqn"] is None else out["iqn"].trunk_grad_clean,
            ens_trunk=None if out["ens"] is None else out["ens"].trunk_grad_clean)
        # The loss scalars and means (not step_kernels.loss_scalars: its means add in the
        # kernel's block order, NumPy's mean pairwise; the bits differ).
        readback = np.zeros(len(READBACK_FIELDS), np.float32)
        for name, value in (("c51_loss", out["c51_loss"]), ("cql_loss", out["cql_loss"]),
                            ("mean_q", np.mean(out["q_taken"])),
                            ("mean_target_q", np.mean(out["target_q"])),
                            *self._second_wave_scalars(out, wave)):
            readback[step_kernels.READBACK_INDEX[name]] = value
        end = step_kernels.step_scalars(
            np.array([optim.grad_norm_sq(grad)]), norms.c51_sq, norms.cql_sq, bounds.clip_bound[0],
            isv_at_start, readback, c.budget("c51"), c.budget("cql"), slow, c.grad_slow_ema_alpha)
        # The post-clip norms of the budget pipeline: an overflowed component reads 0 there,
        # where the kernel's product gives inf * 0 = NaN.
        for name, value in (("c51_norm_post", norms.c51_post), ("cql_norm_post", norms.cql_post)):
            end.readback[step_kernels.READBACK_INDEX[name]] = value
        self.adam_t = int(bounds.adam_t[0])
        self._adam(slice(0, self.layout.main_adam_end), grad, end.safety_scale,
                   bounds.weight_clamp[0])
        if out["iqn"] is not None:  # the IQN head's own Adam: its gradient, its own norm clip
            r = slice(*self.layout.iqn_range)
            head = out["iqn"].head_grad[r]
            self._adam(r, head, optim.clip_scale(optim.grad_norm_sq(head), c.max_grad_norm),
                       bounds.weight_clamp[0])
        self.isv.set(SLOW_EMA, end.isv[slow])

        # Spectral norm on every weight matrix (one batched launch in the fast path).
        views = self.layout.views(self.params)
        ws = [views[t.name] for t in self.layout.weight_matrices]
        ws, self.sn_u, self.sn_v, _ = spectral.batched_spectral_norm(ws, self.sn_u, self.sn_v, np.float32(c.sigma_max))
        for t, w in zip(self.layout.weight_matrices, ws):
            views[t.name][...] = w

        # Mirrors and the Polyak target update.
        self.target = optim.polyak_update(self.target, self.params,
                                          isv_step.step_tau(c, isv_at_start))
        self._refresh_mirrors()

        # ISV producers.
        vec = self.isv.to_array()
        vec = isv_kernels.isv_q_abs_ref_update(vec, out["q_taken"], np.float32(ISV_PRODUCER_ALPHA))
        vec = isv_kernels.isv_h2_rms_update(vec, out["online"].h2, np.float32(ISV_PRODUCER_ALPHA))
        if c.aux_next_bar_on:  # ISV 117, updated by loss_and_grads before the head read it
            vec[isv_mod.AUX_LABEL_SCALE_EMA_INDEX] = out["isv"][isv_mod.AUX_LABEL_SCALE_EMA_INDEX]
        if isv_step.adaptive_on(c):  # issue 19's switched producers (reference.isv_step)
            rb = step_kernels.READBACK_INDEX
            vec = isv_step.run_producers(
                c, vec, q_taken=out["q_taken"].T, q_s=out["q_s"], td=out["td_errors"],
                r=batch.r, p_next=out["p_next"], z=out["support"].z,
                grad_norm=end.readback[rb["grad_norm"]], loss=end.readback[rb["loss"]],
                eps_schedule=self._eps_schedule)
        self.isv.from_array(vec)

        self._fused_checks(self._sentinel_buffers(batch, out, grad), bounds.thresholds)
        self._td_errors = out["td_errors"]
        self._current = StepScalars.from_readback(self.step_count, end.readback, self._flags)
        return self._readback.after_step(self.step_count, lambda: self._current)

    def _adam(self, r: slice, grad: np.ndarray, grad_scale, weight_clamp) -> None:
        """One Adam (``optim.adam_update``) over the elements ``r`` of params / m / v with the
        config's hyperparameters and the shared ``adam_t``; ``grad`` holds at least ``r``'s
        elements (the first ones are used)."""
        c = self.config
        n = r.stop - r.start
        self.params[r], self.adam_m[r], self.adam_v[r] = optim.adam_update(
            self.params[r], grad[:n], self.adam_m[r], self.adam_v[r], step=self.adam_t,
            lr=np.float32(c.lr), beta1=np.float32(c.beta1), beta2=np.float32(c.beta2),
            eps=np.float32(c.adam_eps), weight_decay=np.float32(c.weight_decay),
            grad_scale=grad_scale, weight_clamp=weight_clamp)

    @staticmethod
    def _second_wave_scalars(out: dict, wave) -> list[tuple[str, float]]:
        """The second-wave readback entries of the sources that are on (the rest stay 0)."""
        values = []
        if out["iqn"] is not None:
            values += [("iqn_loss", out["iqn"].loss), ("iqn_norm_pre", wave.iqn_pre),
                       ("iqn_norm_post", wave.iqn_post)]
        if out["ens"] is not None:
            values += [("ens_loss", out["ens"].loss), ("ens_norm_pre", wave.ens_pre),
                       ("ens_norm_post", wave.ens_post)]
        if out["aux"] is not None:
            values += [("aux_next_bar_loss", out["aux"].loss_nb),
                       ("aux_regime_loss", out["aux"].loss_rg)]
        if out["mse"] is not None:
            values += [("mse_loss", out["mse"].loss), ("mse_weight", out["mse"].w)]
        return values

    def set_epoch(self, epoch: int) -> None:
        self.isv.set("EPOCH_IDX", check_epoch(epoch))

    def set_loop_signals(self, *, total_epochs: int | None = None,
                         sharpe_ema: float | None = None, epsilon=None) -> None:
        """The loop's ISV slots: ``TOTAL_EPOCHS`` (40, the schedules' horizon; at the start of
        a run) and ``SHARPE_EMA`` (22, the adaptive EMA rate's input; at each epoch end);
        ``epsilon = (sched, cap)`` at each epoch start: the exploration schedule's value, the
        epoch's cold start of ``EPSILON_EFF`` (41), kept with its cap for
        ``epsilon_tau_update`` (``reference.isv_step``)."""
        if epsilon is not None:
            self._eps_schedule = isv_step.eps_schedule(epsilon)
            self.isv.set("EPSILON_EFF", self._eps_schedule[0])
        if total_epochs is not None:
            self.isv.set("TOTAL_EPOCHS", check_epoch(total_epochs))
        if sharpe_ema is not None:
            self.isv.set("SHARPE_EMA", sharpe_ema)

    def isv_value(self, name: str) -> float:
        """The current value of ISV slot ``name`` (a host read)."""
        return float(self.isv.get(name))

    def _sentinel_buffers(self, batch: Batch, out: dict, grad: np.ndarray) -> dict[str, np.ndarray]:
        """The buffer each fused (non-inline) sentinel slot watches, by slot name.

        Slots whose buffers this step does not have (the second-wave sources that are off)
        are absent and never fire.
        """
        lay = self.layout
        group = {g: np.concatenate([np.arange(t.offset, t.end) for t in lay.tensors if t.group == g])
                 for g in ("trunk", "value", "branch")}
        heads = np.concatenate([group["value"], group["branch"]])
        flat = lambda xs: np.concatenate([x.ravel() for x in xs])  # noqa: E731
        wave: dict[str, np.ndarray] = {}
        if out["mse"] is not None:
            wave["mse_loss"] = np.atleast_1d(out["mse"].loss)
        if out["aux"] is not None:
            if self.config.aux_next_bar_on:
                wave["aux_next_bar_d_h2"] = out["aux"].d_h2_nb
            if self.config.aux_regime_on:
                wave["aux_regime_d_h2"] = out["aux"].d_h2_rg
        if out["iqn"] is not None:
            r = slice(*lay.iqn_range)
            wave.update(iqn_trunk_grad=out["iqn"].trunk_grad, iqn_d_h2=out["iqn"].d_h2,
                        iqn_d_quantiles=out["iqn"].d_quantiles,
                        iqn_adam_m_max=self.adam_m[r], iqn_adam_v_max=self.adam_v[r],
                        iqn_weight_max=self.params[r])
        if out["ens"] is not None:
            wave.update(ens_d_logits=out["ens"].d_logits, ens_trunk_grad=out["ens"].trunk_grad)
        return wave | {
            "states": batch.s, "next_states": batch.s2, "rewards": batch.r,
            "importance_weights": batch.isw,
            "online_value_logits": out["online"].v, "online_adv_logits": flat(out["online"].adv),
            "online_next_logits": flat(out["online_next"].logits),
            "target_next_logits": flat(out["target_next"].logits),
            "h1": out["online"].h1,
            "current_logp": flat(out["logp"]), "projected_dist": flat(out["m"]),
            "td_errors": out["td_errors"],
            "c51_loss": np.atleast_1d(out["c51_loss"]), "cql_loss": np.atleast_1d(out["cql_loss"]),
            "d_value_logits": out["trace_c51"]["d_value_logits"],
            "d_adv_logits": out["trace_c51"]["d_adv_logits"],
            "cql_d_value_logits": out["trace_cql"]["d_value_logits"],
            "cql_d_adv_logits": out["trace_cql"]["d_adv_logits"],
            "grad_c51": out["grad_c51"], "grad_cql": out["grad_cql"], "grad_buf": grad,
            "params": self.params, "target_params": self.target,
            "trunk_adam_m_max": self.adam_m[group["trunk"]],
            "value_adam_m_max": self.adam_m[group["value"]],
            "branch_adam_m_max": self.adam_m[group["branch"]],
            "trunk_adam_v_max": self.adam_v[group["trunk"]],
            "value_adam_v_max": self.adam_v[group["value"]],
            "branch_adam_v_max": self.adam_v[group["branch"]],
            "trunk_weight_max": self.params[group["trunk"]],
            "heads_weight_max": self.params[heads],
            "target_q_post_clip": out["target_q"],
            # The step's per-branch live support (Mech 2), or the fixed one (one row).
            "atom_span_max": out["support"].z if self.config.adaptive_atoms
            else out["support"].z[0],
            "h2_max_abs": out["online"].h2,
        }

    def _fused_checks(self, buffers: dict[str, np.ndarray], thresholds: np.ndarray) -> None:
        """Every per-step, non-inline sentinel slot in one fused check (one launch in the fast
        path); ``thresholds`` (``[NUM_SENTINEL_SLOTS]``) from the ISV at the start of the step."""
        slots = [s for s in sentinels.SENTINELS if not s.inline and s.name in buffers]
        idx = np.array([s.index for s in slots])
        self._flags[idx] = safety.nan_check_fused([buffers[s.name] for s in slots], self._flags[idx],
                                                  thresholds[idx])

    # ------------------------------------------------------------------ readback
    def end_epoch(self) -> StepScalars:
        return self._readback.end_epoch(self.step_count, lambda: self._current)

    # ------------------------------------------------------------------ folds and evaluation
    def fold_boundary(self) -> None:
        """Mech 3 hard target sync, Mech 4 Adam reset, ISV fold reset, sentinel flags reset."""
        self.target = optim.hard_sync(self.target, self.params)
        self.adam_m = self.layout.zeros()
        self.adam_v = self.layout.zeros()
        self.adam_t = 0
        self.isv.fold_reset()
        self._flags[:] = 0
        self._refresh_mirrors()
        # The Mech 6 slow EMA is deliberately kept (the seeds' Mech 8 revert).

    def last_td_errors(self) -> np.ndarray:
        if self._td_errors is None:
            raise RuntimeError("last_td_errors(): no step has run yet")
        return self._td_errors.copy()

    def q_values(self, states: np.ndarray) -> list[np.ndarray]:
        return self.frozen_q_values(weights=False)(states)

    def frozen_q_values(self, *, weights: bool = True) -> Callable[[np.ndarray], list[np.ndarray]]:
        """``TrainerBackend.frozen_q_values``: the Mech 10 bound, the supports and
        (``weights``) the rounded weight matrices of the parameters and the ISV as they are now,
        formed once (about a quarter of a one-state ``q_values`` call, bf16); the same values
        as ``q_values`` while neither changes (a step, a load, a write into ``params``)."""
        config, layout, params = self.config, self.layout, self.params
        h2_bound = self._bound(config.h2_clamp_mult, "H_S2_RMS_EMA")
        z = step_supports(config, self.isv.to_array()).z
        w = forward_weights(config, layout, params) if weights else None

        def run(states: np.ndarray) -> list[np.ndarray]:
            states = np.ascontiguousarray(states, dtype=np.float32)
            act = forward(config, layout, params, states, h2_bound=h2_bound, weights=w)
            return q_values(config, act, z)

        return run

    # ------------------------------------------------------------------ state exchange
    def state_dict(self) -> dict[str, np.ndarray]:
        state = {
            "params": self.params, "target": self.target,
            "adam_m": self.adam_m, "adam_v": self.adam_v,
            "adam_t": np.array([self.adam_t], np.int64),
            "isv": self.isv.to_array(), "flags": self._flags,
            "step": np.array([self.step_count], np.int64),
        }
        for t, u, v in zip(self.layout.weight_matrices, self.sn_u, self.sn_v):
            state[f"sn_u.{t.name}"] = u
            state[f"sn_v.{t.name}"] = v
        if self.config.iqn_on:
            state["seed"] = np.array([self.seed], np.int64)
        return {k: np.array(v, copy=True) for k, v in state.items()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        validate_state_dict(self.config, state)  # everything checked before anything is loaded
        self.params = state["params"].copy()
        self.target = state["target"].copy()
        self.adam_m = state["adam_m"].copy()
        self.adam_v = state["adam_v"].copy()
        self.adam_t = int(state["adam_t"][0])
        self.isv.from_array(state["isv"].copy())
        self._flags = state["flags"].copy()
        self.step_count = int(state["step"][0])
        if self.config.iqn_on:
            self.seed = int(state["seed"][0])
        self.sn_u = [state[f"sn_u.{t.name}"].copy() for t in self.layout.weight_matrices]
        self.sn_v = [state[f"sn_v.{t.name}"].copy() for t in self.layout.weight_matrices]
        self._refresh_mirrors()
        self._current = None
        self._td_errors = None
        self._readback.reset()
