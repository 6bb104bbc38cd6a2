"""The fast step's plan builder: GEMM plans and the pieces every graph is made of, as records.

``StepProgram(layout, *, planner, constants, host_nbytes, arch, gemm_workspace, seed, sm_count,
fuse_trunk)``
makes the launch records (``foxhunt.fast.records``) of the step; the graphs are written in
``graph1_plan``, ``graph2_plan`` (with the upload graph) and ``eval_plan``. Records name
buffers of ``layout`` (and, while an evaluation forward is built, of its ``EvalLayout``); the
GPU engine turns them into graph nodes, the CPU executor into reference-kernel calls.

GEMM precisions follow ``foxhunt.reference.network``: ``f32`` runs every GEMM in f32, ``tf32``
every GEMM in TF32 on the f32 activations and weights (cuBLASLt's ``COMPUTE_32F_FAST_TF32``);
``bf16`` runs the forward GEMMs on BF16 operands (weights from the BF16 mirror, activations
converted by ``f32_to_bf16`` / the clamp's BF16 output) with f32 accumulation, and the backward
GEMMs in TF32 on the f32 activations and f32 master weights. Bias adds and ReLUs of the forward
are cuBLASLt epilogues (RELU_BIAS / BIAS); the backward masks a ReLU layer's input gradient by
its forward output and sums its bias gradient after a plain GEMM (``h <= 0 ? 0 : dy``, the
reference's ``relu_mask``: a NaN output passes its gradient): in one ``relu_mask_bias_grad``,
or, on the loss backward's chains (the heads' hidden layers, the trunk's h1), ``relu_mask``
with the ``bias_grad_reduce`` of its output beside the next GEMM (``input_grad``'s ``then``). Not
cuBLASLt's RELU_AUX_BIAS + DRELU_BGRAD pair: DRELU_BGRAD masks by the forward's bitmask, and
the bf16 RELU_AUX_BIAS plans of the step's forward GEMMs leave a NaN output's bit clear (so a
NaN row's gradient became 0; measured on the H200, cuBLAS 13.0, session 21: the ``gemm`` module
docstring), and cuBLASLt offers DRELU_BGRAD for these TF32 / f32 backward GEMMs only with a
workspace. Without the bitmask the step is faster too (H200, session 21, one device call,
pytest-benchmark medians, two rounds: core bf16 128.7 / 128.9 -> 124.9 / 125.6 us, f32
153.1 / 153.4 -> 147.8 / 147.8 us; every second-wave source bf16 183.1 / 184.8 -> 179.8 /
179.6 us, f32 217.3 / 217.4 -> 206.1 / 205.1 us). The output layers' bias gradients
are ``bias_grad_reduce`` beside a plain weight-gradient GEMM, not cuBLASLt's BGRADB epilogue:
measured on the H200 (seed preset, bf16, the step graph replayed, two rounds), the step with
every second-wave source took 196.8 / 199.0 us with BGRADB and 192.1 / 195.1 us without, the
core step 128.0 / 129.6 against 126.1 / 128.2 us (a BGRADB GEMM of these shapes took about 7 us
alone, the plain GEMM about 3). Populations took this path first: their batched BGRADB GEMM of
256x256x256 took 23.8 us for 16 members, and leaving it out took the N = 16 population step
from 1288.7 to 1240.0 us.

GEMM workspace (``gemm_workspace``): ``"none"`` plans every GEMM without a workspace where
cuBLASLt has an algorithm for it (no memset or split-K reduction nodes in the graphs; measured
on the H200, seed preset: bf16 219 us vs 251 us per step with the default limit); where it has
none, the default limit. ``"default"`` plans every GEMM with cuBLASLt's default limit (other
algorithms, split-K among them: the long-run tool's "F32 with another summation order").
Under either, a weight gradient with a long reduction (``LONG_K_RATIO``) may take a workspace.

SMs per GEMM (``sm_count``, the device's multiprocessor count; 0: unknown): a GEMM is planned
for ``sm_count // share`` SMs (cuBLASLt's ``SM_COUNT_TARGET``), its share given by its role
(forward, input gradient, weight gradient) and the precision (:data:`GEMM_SM_SHARES`; a
population's every GEMM at :data:`GEMM_SM_SHARE` of its plan's count). The graphs run many GEMMs
at once on parallel branches, and a GEMM planned for the whole device spreads over more SMs than
it gets there: measured on the H200 (``benches/critical_path.py --measure``, bf16, session 13),
graph 1 of the core step took 118.8 us with every GEMM planned for 132 SMs, 113.2 for 66, 106.9
for 33 and 105.8 for 16; with every second-wave source, 186.6, 180.7, 169.3 and 168.1 us. The
GEMMs on the loss's chain with little beside them are the exception (the table's comment).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import numpy as np

from foxhunt.fast import support_plan
from foxhunt.fast.binder import Binder
from foxhunt.fast.gemm import RELU_EPILOGUE_KEEPS_NAN
from foxhunt.fast.records import Buf, Ops
from foxhunt.fast.sentinel_plan import desc_entries, desc_lengths_split
from foxhunt.fast.step_layout import (
    DESC_LENGTH_KEYS,
    NORM_SEGMENT,
    OPERAND_ALIGN,
    EvalLayout,
    StepLayout,
    blocks,
)
from foxhunt.reference import isv as isv_mod
from foxhunt.reference import sentinels
from foxhunt.reference.backend import BACKWARD_GEMM_MODE, FORWARD_GEMM_MODE
from foxhunt.reference.config import PRECISIONS

#: ``gemm_workspace`` values (module docstring).
GEMM_WORKSPACES = ("none", "default")
#: A population's GEMMs are planned for this fraction of the SMs its plan's ``sm_count`` gives
#: (module docstring; ``population_plan.MEMBER_PROGRAM_OPTIONS``).
GEMM_SM_SHARE = 4
#: The roles of the step's cuBLASLt GEMMs (``StepProgram._gemm``'s ``role``): the forward's
#: layers, the backward's input gradients, its weight gradients.
GEMM_ROLES = ("forward", "input_grad", "weight_grad")
#: A single trainer's SM share per forward precision and GEMM role: the GEMM is planned for
#: ``sm_count // share`` SMs, 1 meaning the whole device (SM_COUNT_TARGET unset). The forward's
#: layers and the C51 loss's input gradients are graph 1's critical chain with little beside
#: them. Measured on the H200 (session 39; seed preset, one trainer per variant in one process,
#: step graph replays, us): the input gradients on the whole device took bf16 97.5 -> 96.5,
#: every second-wave source 152.9 -> 151.7, tf32 118.9 -> 117.8, f32 129.4 -> 130.7; the
#: forward's layers there took tf32 118.9 -> 115.5 but bf16 97.5 -> 107.2 (half the device:
#: 101.2); both there, f32 129.4 -> 127.6. The bench of this table against the uniform quarter
#: (tf32 and every second-wave source faster, core bf16 and f32 unchanged): the README's
#: "cuBLASLt's SM target by GEMM role".
GEMM_SM_SHARES = {
    "bf16": MappingProxyType({"forward": 4, "input_grad": 1, "weight_grad": 4}),
    "tf32": MappingProxyType({"forward": 1, "input_grad": 4, "weight_grad": 4}),
    "f32": MappingProxyType({"forward": 1, "input_grad": 1, "weight_grad": 4}),
}
#: Every role at :data:`GEMM_SM_SHARE` (a population's plans).
UNIFORM_SM_SHARES = MappingProxyType(dict.fromkeys(GEMM_ROLES, GEMM_SM_SHARE))
#: A weight-gradient GEMM whose reduction length ``k`` is at least this many times its larger
#: output dimension may use a cuBLASLt workspace even under ``gemm_workspace="none"``.
LONG_K_RATIO = 4
#: The precisions whose training passes end their heads in ONE launch of
#: ``fast.kernels.trunk.HOD_KERNELS[precision]`` (:attr:`StepProgram.outputs_fused`): bf16
#: (``heads_out_dueling_bf16``). ``heads_out_dueling_f32`` (add ``"f32"``) is not the default:
#: its first version took 19.9 us a launch and the core f32 step 154.7 us against 133.3 us with
#: the nodes (H200, session 40); the second (W2 loaded in chunks) 153.4 us against 133.0 us
#: (session 42; the README's "The f32 heads' outputs in one launch" and "Weight and bias
#: gradients in one launch"); the third (session 43, b662b6a) stages the hidden values and both
#: heads' W2 in shared memory (opted in: sm_80, sm_90 and newer at the seed shapes): 143.7 us
#: against 138.7 (H100); the fourth (7ebfb37: 32 warps of one tile) 144.0 us against 139.1
#: (H100, session 44; the README's "The f32 heads' outputs from shared memory" and "Issue 26's
#: tables on the H200"). Never tf32: its forward GEMMs round their operands to TF32, which the
#: f32 kernel's exact products do not.
FUSE_HEAD_OUTPUTS = frozenset({"bf16"})
#: Whether the C51 trunk takes the auxiliary heads' ``d h2`` in ONE launch of
#: ``h2_grad_sum_aux_mask`` instead of six (``h2_grad_sum_mask`` of the heads' parts on the trunk
#: and beside it for slot 33, the two auxiliary heads' ``clamp_finite`` and ``saxpy``, the
#: ``saxpy`` into the trunk's sum and ``h2_grad_sum_mask`` of it). Measured on the H200 with
#: :data:`FUSE_GUARD_MASK` (session 42, ``benches/step_spread.py --switch``, the bf16 step with
#: every second-wave source, two instances each, ``Trainer.step``): 156.4 us off, 155.0 us on.
FUSE_AUX_TRUNK_GRAD = True
#: Whether the IQN and ensemble trunks take their guarded ``d h2`` and its masks in ONE launch of
#: ``h2_guard_mask`` instead of two (``clamp_finite`` with the guard's bound, ``h2_grad_sum_mask``
#: of the one part it wrote). On with :data:`FUSE_AUX_TRUNK_GRAD` (its measurement).
FUSE_GUARD_MASK = True
#: The backward precisions whose loss passes take the heads' hidden gradients into the trunk in ONE
#: launch of ``heads_dh2_tf32`` (every head's part of ``d h2``, their sum and the trunk's masks:
#: :attr:`StepProgram.dh2_fused`) instead of a GEMM per head and ``h2_grad_sum_mask``; ``"tf32"``
#: (the bf16 and tf32 steps' backward) switches it on. Off: no version was faster than the four
#: part GEMMs side by side and the sum (H100, session 45, ``benches/step_spread.py --switch
#: FUSE_HEADS_DH2``, ``Trainer.step`` us, on / off): the third (a thread-block cluster a 64 x 64
#: tile) core bf16 106.5 / 105.5, core tf32 119.6 / 119.5, every second-wave source 154.8 /
#: 154.5, its node 8.1 us on graph 1's chain where the part GEMM and the sum took 3.8 + 1.5 us;
#: the README's "The heads' d h2 in one launch".
FUSE_HEADS_DH2 = frozenset()
#: Whether the step graph records the upload's event (``gpu_engine``'s ``graph1_done``: the next
#: step's batch upload waits on it) right after graph 1's last readers of the batch
#: (``dataflow.release_points``: in the seed step the input layer's weight gradients and the
#: loss's scalar kernels) instead of after the whole of graph 1, so the next upload overlaps the
#: end of graph 1 as well as graph 2. Where graph 2 reads the batch, after graph 1 either way.
EARLY_UPLOAD_RELEASE = True
#: Whether, with an injected second-wave source on (IQN, the ensemble), ``step_scalars`` and the
#: sources' norm launches run beside graph 2's Adam (``adam_update_norm`` sums the total norm's
#: partials itself), as in the core step, instead of ending graph 1 after the budget launch
#: with Adam reading ``safety_scale`` (``graph2_plan.scalars_beside_adam``). Measured (session 47,
#: ``benches/step_spread.py --switch``, the bf16 step with every second-wave source): H200 149.4
#: us on against 151.0 off; H100 150.3 / 150.9 / 150.5 against 151.7 / 152.5 / 152.0; f32 and
#: tf32 within 0.4 us (H100).
WAVE_SCALARS_BESIDE_ADAM = True
#: The step precisions whose graph 2 spectral norm, with more weight matrices than an sm_90 GPU
#: holds clusters of one block an SM (``fast.kernels.spectral.SPECTRAL_SPREAD_CLUSTERS``: 16
#: with every second-wave source), takes the shared memory of two blocks an SM
#: (``plan_step_spectral_norm(fit_clusters=True)``), so that every matrix's cluster runs at once,
#: instead of one block an SM with the last cluster waiting for another to finish. The same bits
#: either way. Measured on the H200 (session 47, ``benches/step_spread.py --switch``, the step
#: with every second-wave source, three instances a side, two calls): bf16 150.0 us with it
#: against 152.6 without; f32 196.4 / 196.5 against 195.5 / 195.8, tf32 179.7 / 178.8 against
#: 178.8 / 177.7, so not in those.
SPECTRAL_FIT_CLUSTERS = frozenset({"bf16"})
#: Whether the backward's GEMMs that ``fast.kernels.dense.gemm_tf32_fits`` run as ONE launch of
#: ``gemm_tf32`` (TF32 backward) or ``gemm_f32`` (f32), a ReLU layer's input gradient with its mask,
#: not a cuBLASLt GEMM (:meth:`StepProgram.bwd_gemm`).
BACKWARD_GEMM_KERNELS = True
#: The kernel of each backward precision.
BACKWARD_GEMM_KERNEL = {"tf32": "gemm_tf32", "f32": "gemm_f32"}
#: The precisions whose single trainer captures graph 1 and graph 2 as TWO graphs launched one
#: after the other (``gpu_engine.GpuEngine._capture``) instead of one step graph (a population's
#: stays one graph). None: measured slower in every precision (session 49, H100, ``Trainer.step``
#: us, one graph against split): core f32 140.03 / 141.91, tf32 116.75 / 124.90, bf16 101.88 /
#: 112.25, every second-wave source in f32 201.10 / 210.90.
SPLIT_STEP_GRAPH = frozenset()
#: The precisions whose single trainer's ONE step graph (a precision not in
#: :data:`SPLIT_STEP_GRAPH`) ranks its nodes' launch priorities over graph 1's nodes and graph 2's
#: apart (``fast.graphs.priority_ranks``' groups), as a split step graph's two graphs are ranked,
#: instead of over the whole step graph, where graph 2's chain lowers every rank of graph 1's.
#: None (session 49, H100, ``Trainer.step`` us, with graph 2 still launched early everywhere; as a
#: whole against apart): core f32 140.03 / 137.53, tf32 116.75 / 115.85, bf16 101.88 / 103.21,
#: every second-wave source in f32 199.97 / 199.06; :data:`GRAPH2_EARLY_LAUNCH` took more off.
#: With graph 2 launched plainly in f32 and tf32 (session 52, H100, ``benches/step_spread.py
#: --switch PRIORITY_BY_GRAPH``, four instances a side, whole against apart): core f32 132.46 /
#: 133.91, tf32 112.95 / 113.30, so still none.
PRIORITY_BY_GRAPH = frozenset()
#: The precisions whose single trainer launches graph 2's kernels early (programmatic dependent
#: launch, ``graph_lowering.EARLY_LAUNCH``: scheduled while their predecessors still run); in the
#: others each of graph 2's kernels starts after its predecessors end, and so does not take SMs
#: from graph 1's last nodes. Measured on an H100 (session 49, ``.dev/s49_boundary.py``: trainers
#: of each arm built interleaved in one process, ``Trainer.step`` us, the mean of the instances):
#: core f32 140.03 early against 135.23 not (four instances each), tf32 116.75 against 111.23,
#: bf16 101.88 against 106.04 (two each); again with this default (``step_spread.py --switch``):
#: core f32 138.49 against 131.20, tf32 116.15 against 112.08, every second-wave source in f32
#: 197.87 against 197.45.
GRAPH2_EARLY_LAUNCH = frozenset({"bf16"})
#: Backward precisions whose kernel takes only the masked GEMMs (a ReLU layer's input gradient on a
#: chain): measured on the H200 (session 33, seed preset, core f32 step, driver-event time), 136.2
#: us with cuBLASLt's GEMMs, 139.7 us with every one that fits as ``gemm_f32`` (the CUDA cores'
#: products are slower than cuBLASLt's beside the chain) and 131.0 us with the masked ones only.
MASKED_ONLY = frozenset({"f32"})
#: ``planner(m, n, k, *, trans_a, trans_b, precision, epilogue, beta, min_alignment,
#: workspace_limit)`` -> a plan with ``.spec``; raises ``GemmPlanError`` where it has none.
Planner = Callable[..., object]


def plan_switches() -> dict[str, object]:
    """The module's plan switches a bench may set for one arm (``benches/step_spread.py
    --switch``): name -> the value such an arm gives it, the other side of its default (the
    boolean switches flipped; ``FUSE_HEAD_OUTPUTS``: every precision with a heads' output kernel,
    ``fast.kernels.trunk.HOD_KERNELS``; ``FUSE_HEADS_DH2``: none if on, else the TF32 backward;
    ``SPECTRAL_FIT_CLUSTERS``: the other precisions).
    A trainer reads them while it builds its plans, so it keeps the plans of the values it was
    built with."""
    from foxhunt.fast.kernels.trunk import HOD_KERNELS

    return {"FUSE_HEAD_OUTPUTS": frozenset(HOD_KERNELS),
            "FUSE_AUX_TRUNK_GRAD": not FUSE_AUX_TRUNK_GRAD, "FUSE_GUARD_MASK": not FUSE_GUARD_MASK,
            "FUSE_HEADS_DH2": frozenset() if FUSE_HEADS_DH2 else frozenset({"tf32"}),
            "EARLY_UPLOAD_RELEASE": not EARLY_UPLOAD_RELEASE,
            "WAVE_SCALARS_BESIDE_ADAM": not WAVE_SCALARS_BESIDE_ADAM,
            "SPECTRAL_FIT_CLUSTERS": frozenset(PRECISIONS) - SPECTRAL_FIT_CLUSTERS,
            "SPLIT_STEP_GRAPH": frozenset(PRECISIONS) - SPLIT_STEP_GRAPH,
            "PRIORITY_BY_GRAPH": frozenset(PRECISIONS) - PRIORITY_BY_GRAPH,
            "GRAPH2_EARLY_LAUNCH": frozenset(PRECISIONS) - GRAPH2_EARLY_LAUNCH}


def sm_count_targets(sm_count: int, shares: Mapping[str, int]) -> dict[str, int]:
    """cuBLASLt's SM_COUNT_TARGET per GEMM role: ``sm_count // share`` (0, the whole device,
    where the share is 1 or the SM count is unknown, 0). ``shares`` maps every role of
    :data:`GEMM_ROLES` to an int >= 1."""
    if set(shares) != set(GEMM_ROLES) or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in shares.values()):
        raise ValueError(f"sm_shares: {dict(shares)!r} is not allowed; expected an int >= 1 for "
                         f"each of {', '.join(GEMM_ROLES)}")
    return {role: 0 if share == 1 else int(sm_count) // share for role, share in shares.items()}


def alignment(byte_offsets) -> int:
    """Largest power of two in [4, 256] dividing every byte offset from a 256-byte aligned
    buffer start (cuBLASLt's ``min_alignment``)."""
    align = 256
    while align > 4 and any(off % align for off in byte_offsets):
        align //= 2
    bad = [off for off in byte_offsets if off % align]
    if bad:
        raise ValueError(f"GEMM operands at byte offsets {bad} are not 4-byte aligned; cuBLASLt "
                         "plans need 4 (bf16 precision with an odd batch_size * state_dim?)")
    return align


class StepProgram:
    """Records of the fast step (module docstring). ``plans``: every GEMM plan made (the GPU
    engine closes them); ``fallbacks``: the stacked GEMMs the planner refused (each became a
    GEMM per batch)."""

    def __init__(self, layout: StepLayout, *, planner: Planner, constants: Mapping[str, np.ndarray],
                 host_nbytes: Mapping[str, int], arch: str, gemm_workspace: str = "none",
                 seed: int = 0, sm_count: int = 0, sm_shares: Mapping[str, int] | None = None,
                 fuse_trunk: bool = False, fuse_heads: bool = False,
                 stacked_backward: bool = False, heads_dh2: bool = True):
        from foxhunt.fast.gemm import DEFAULT_WORKSPACE_LIMIT

        if gemm_workspace not in GEMM_WORKSPACES:
            raise ValueError(f"gemm_workspace: {gemm_workspace!r} is not allowed; expected one of "
                             f"{', '.join(map(repr, GEMM_WORKSPACES))}")
        self.lay = layout
        self.config = layout.config
        #: The run's seed: the IQN quantile fractions' generator key (a launch argument).
        self.seed = int(seed)
        self.planner = planner
        self.arch = arch
        self.fuse_trunk = bool(fuse_trunk)
        self.fuse_heads = bool(fuse_heads)
        #: Whether graph 1 runs the C51 and CQL backward passes stacked (``backward``): an option
        #: of a single trainer, off by default (measured no faster on the H200: the README's
        #: "The C51 and CQL backward passes stacked"); never a population's (its GEMMs are
        #: already batched over the members, with one stride for every operand).
        self.stacked_backward = bool(stacked_backward)
        #: Whether the loss passes may take the heads' ``d h2`` in one ``heads_dh2_tf32``
        #: (:attr:`dh2_fused`); a population's members do not (their per-head GEMMs are batched
        #: over the members: ``population_plan.MEMBER_PROGRAM_OPTIONS``).
        self.heads_dh2 = bool(heads_dh2)
        if self.fuse_trunk and not self.trunk_fused:
            from foxhunt.fast.kernels._runtime import CLUSTER_SM90
            from foxhunt.fast.kernels.trunk import TRUNK_COLS_PER_PASS

            lay = layout
            raise ValueError(
                f"fused_trunk=True: the fused trunk forward runs precision 'bf16' on sm_90 and newer "
                f"with SD, H1, H2 multiples of 16 and H1, H2 <= {CLUSTER_SM90 * TRUNK_COLS_PER_PASS}"
                f"; got precision {self.config.precision!r}, {arch}, SD={lay.SD}, H1={lay.H1}, "
                f"H2={lay.H2}")
        if self.fuse_heads and not self.heads_fused:
            from foxhunt.fast.kernels._runtime import CLUSTER_SM90
            from foxhunt.fast.kernels.trunk import HEADS_COLS_PER_BLOCK

            lay = layout
            raise ValueError(
                f"fused_heads=True: the fused heads forward runs precision 'bf16' on sm_90 and newer "
                f"with H2 and every head's hidden width multiples of 16 and at most "
                f"{CLUSTER_SM90 * HEADS_COLS_PER_BLOCK} hidden and (each head's padded to 8) output "
                f"columns; got precision {self.config.precision!r}, {arch}, H2={lay.H2}, hidden "
                f"{lay.head_hidden}, outputs {lay.head_out}")
        self.gemm_workspace = gemm_workspace
        self.default_workspace = DEFAULT_WORKSPACE_LIMIT
        #: cuBLASLt's SM_COUNT_TARGET per GEMM role (:data:`GEMM_SM_SHARES`, the precision's
        #: unless ``sm_shares`` is given; 0: the whole device).
        self.sm_count_targets = sm_count_targets(
            sm_count, GEMM_SM_SHARES[layout.config.precision] if sm_shares is None else sm_shares)
        self.constants = constants
        self.binder = Binder(layout.region, constants=constants, host_nbytes=host_nbytes)
        self.plans: list = []
        self.fallbacks: list[str] = []
        self.fwd_mode = FORWARD_GEMM_MODE[self.config.precision]
        self.bwd_mode = BACKWARD_GEMM_MODE[self.config.precision]

    def ops(self) -> Ops:
        return Ops(self.binder)

    @property
    def trunk_fused(self) -> bool:
        """Whether the training passes run the trunk as the fused ``trunk_forward_bf16``: asked
        for (``fuse_trunk``), BF16, an architecture with thread-block clusters, and widths whose
        W slices the kernel keeps whole (``fast.kernels.trunk.trunk_fusable``)."""
        from foxhunt.fast.kernels.trunk import trunk_fusable

        lay = self.lay
        return self.fuse_trunk and lay.bf16 and trunk_fusable(lay.SD, lay.H1, lay.H2, self.arch)

    @property
    def outputs_fused(self) -> bool:
        """Whether a training pass ends its heads in ``heads_out_dueling_bf16`` (the hidden values'
        BF16 copy, every head's second layer and the dueling log-softmax in one launch) instead of
        ``f32_to_bf16``, a GEMM per head and ``dueling_log_softmax_q_branches``, or in f32 in
        ``heads_out_dueling_f32`` (the second layers and the dueling log-softmax) instead of a GEMM
        per head and ``dueling_log_softmax_q_branches``: the precision in
        :data:`FUSE_HEAD_OUTPUTS` and shapes the kernel takes (``fast.kernels.trunk.hod_fusable``)."""
        from foxhunt.fast.kernels.trunk import hod_fusable

        lay = self.lay
        precision = self.config.precision
        return (precision in FUSE_HEAD_OUTPUTS
                and hod_fusable(lay.head_hidden, lay.head_out, lay.branches, lay.NA, precision,
                                self.arch))

    @property
    def dh2_fused(self) -> bool:
        """Whether a loss pass's backward may take every head's part of ``d h2``, their sum and
        the trunk's masks in one ``heads_dh2_tf32`` (``backward`` then does where the pass is
        one loss's, not stacked, without the auxiliary heads' ``d h2``): allowed
        (``heads_dh2``), the backward precision in :data:`FUSE_HEADS_DH2` and shapes the kernel
        takes (``fast.kernels.trunk.heads_dh2_fits``)."""
        from foxhunt.fast.kernels.trunk import heads_dh2_fits

        return (self.heads_dh2 and self.bwd_mode in FUSE_HEADS_DH2
                and heads_dh2_fits(self.lay.head_hidden, self.arch))

    @property
    def aux_trunk_fused(self) -> bool:
        """Whether the C51 trunk takes the auxiliary heads' ``d h2`` in one launch of
        ``h2_grad_sum_aux_mask`` (:data:`FUSE_AUX_TRUNK_GRAD`, with an auxiliary head on)."""
        return FUSE_AUX_TRUNK_GRAD and self.config.aux_on

    @property
    def heads_fused(self) -> bool:
        """Whether the training passes run the heads' forward as the fused ``heads_forward_bf16``
        (``fast.kernels.trunk.heads_fusable``; as :attr:`trunk_fused`)."""
        from foxhunt.fast.kernels.trunk import heads_fusable

        lay = self.lay
        return (self.fuse_heads and lay.bf16
                and heads_fusable(lay.H2, lay.head_hidden, lay.head_out, self.arch))

    def eval_binder(self, evl: EvalLayout, host_nbytes: Mapping[str, int]) -> Binder:
        """A binder over the step buffers and ``evl``'s (names are disjoint)."""
        def region(buf: Buf):
            return evl.region(buf) if buf.name in evl else self.lay.region(buf)
        return Binder(region, constants=self.constants, host_nbytes=host_nbytes)

    # -- names
    def weight(self, name: str, which: int, *, bf16: bool) -> Buf:
        """Tensor ``name`` of params (which=0) or target (which=1), f32 or BF16."""
        return Buf("mirror2" if bf16 else "params2",
                   offset=which * self.lay.NP + self.lay.tensor_offset(name))

    def grad(self, grad: str, name: str) -> Buf:
        """Tensor ``name``'s gradient in buffer ``grad`` (layout-indexed, or one range of the
        layout: ``layout.grad_base``)."""
        return Buf(grad, offset=self.lay.tensor_offset(name) - self.lay.grad_base.get(grad, 0))

    # -- GEMMs
    # An operand is a ``Buf``, or in the stacked backward a pair ``(loss 0's, loss 1's)``: two
    # blocks of one buffer (``StepLayout._add_stacked``). A GEMM with a pair among its operands
    # is ONE launch of two batches: each pair strided by its blocks' distance, every other
    # operand (the shared weights and activations) by 0 (``gemm`` module
    # docstring, "Per-operand strides").
    def _batched(self, ops: Ops, **operands) -> tuple[dict, dict, dict]:
        """``(batch 0's buffers, batch 1's buffers of the pairs, the plan's batch arguments)``."""
        first, second, strides = {}, {}, {}
        for name, value in operands.items():
            if value is None:
                continue
            if isinstance(value, tuple):
                b0, b1 = value
                r0, r1 = (ops.binder.region(b, "GEMM operand") for b in value)
                assert r0.buffer == r1.buffer and r1.byte_start > r0.byte_start, (b0, b1)
                first[name], second[name] = b0, b1
                strides[name] = r1.byte_start - r0.byte_start
            else:
                first[name], strides[name] = value, 0
        batch = dict(batch=2, batch_stride=strides) if second else {}
        return first, second, batch

    def _plan(self, ops: Ops, m: int, n: int, k: int, *, operands, role: str, **kw):
        """A GEMM plan (the workspace policy: module docstring). A weight gradient
        (``trans_a``) whose reduction is long (``k >= LONG_K_RATIO * max(m, n)``) may take a
        workspace under either policy:
        cuBLASLt then splits the reduction (measured on the H200: the IQN head's 8x256x1280 and
        256x64x1280 gradients took 15.7 and 16.4 us without one)."""
        from foxhunt.fast.gemm import GemmPlanError

        bufs = [b for op in operands for b in (op if isinstance(op, tuple) else (op,))]
        align = alignment([ops.binder.region(b, "GEMM operand").byte_start for b in bufs])
        plan = None
        if self.gemm_workspace == "none" and not (k >= LONG_K_RATIO * max(m, n) and
                                                   kw.get("trans_a")):
            try:
                plan = self.planner(m, n, k, min_alignment=align, workspace_limit=0,
                                    sm_count_target=self.sm_count_targets[role], **kw)
            except GemmPlanError:
                pass  # no algorithm without a workspace: the default limit below
        if plan is None:
            plan = self.planner(m, n, k, min_alignment=align, workspace_limit=self.default_workspace,
                                sm_count_target=self.sm_count_targets[role], **kw)
        self.plans.append(plan)
        return plan

    def _gemm(self, ops: Ops, m: int, n: int, k: int, *, a, b, c, bias=None, **kw) -> None:
        """Plan and record ``c = op(a) @ op(b)`` (operands ``Buf``s or pairs, the comment above;
        ``role`` one of :data:`GEMM_ROLES`); a stacked GEMM the planner refuses becomes one GEMM
        per batch (noted in ``fallbacks``)."""
        from foxhunt.fast.gemm import GemmPlanError

        first, second, batch = self._batched(ops, a=a, b=b, c=c, bias=bias)
        operands = [x for x in (a, b, c, bias) if x is not None]
        try:
            plan = self._plan(ops, m, n, k, operands=operands, **kw, **batch)
        except GemmPlanError as exc:
            if not second:
                raise
            # No algorithm for the stacked GEMM: one GEMM per batch (the same values).
            self.fallbacks.append(f"stacked {m}x{n}x{k} {kw.get('epilogue')}: {exc}")
            for a_i, b_i, c_i, bias_i in self._each(a, b, c, bias):
                self._gemm(ops, m, n, k, a=a_i, b=b_i, c=c_i, bias=bias_i, **kw)
            return
        ops.gemm(plan, **first, second=second or None)

    @staticmethod
    def _each(*operands) -> list[tuple]:
        """Per batch, each operand's buffer (a pair's member, a shared ``Buf`` itself)."""
        n = max((len(op) for op in operands if isinstance(op, tuple)), default=1)
        return [tuple(op[i] if isinstance(op, tuple) else op for op in operands) for i in range(n)]

    def linear(self, ops: Ops, *, rows, n, k, x, w, c, bias, epilogue) -> None:
        """``c = epilogue(x [rows, k] @ W[n, k]^T + bias)`` in the forward precision. Where the
        precision's RELU_BIAS epilogue does not keep a NaN pre-activation NaN
        (``gemm.RELU_EPILOGUE_KEEPS_NAN``: the TF32 plans), the GEMM runs plain and
        ``add_bias_relu`` adds the bias and the ReLU in place after it (the reference's NaN
        contract: a NaN stays NaN for the sentinels)."""
        if epilogue == "relu_bias" and not RELU_EPILOGUE_KEEPS_NAN[self.fwd_mode]:
            self._gemm(ops, rows, n, k, a=x, b=w, c=c, bias=None, trans_b=True,
                       precision=self.fwd_mode, epilogue=None, role="forward")
            ops.kernel("add_bias_relu", self.kernels("dense").plan_add_bias_relu(rows, n),
                       y=c, b=bias, out=c, rows=rows, cols=n)
            return
        self._gemm(ops, rows, n, k, a=x, b=w, c=c, bias=bias, trans_b=True,
                   precision=self.fwd_mode, epilogue=epilogue, role="forward")

    def weight_grad(self, ops: Ops, *, dy, x, rows, n_out, n_in, dw, db=None) -> None:
        """``dW [n_out, n_in] = dy[rows, n_out]^T @ x[rows, n_in]`` and, with ``db``, ``db =
        colsum(dy)`` by ``bias_grad_reduce`` beside the GEMM (not the BGRADB epilogue: module
        docstring), in the backward precision (pairs: one GEMM, a ``bias_grad_reduce`` per
        batch)."""
        if db is None:
            self.bwd_gemm(ops, n_out, n_in, rows, a=dy, b=x, c=dw, trans_a=True)
            return
        # The bias gradients beside the plain GEMM (all read dy only).
        batches = self._each(dy, db)
        sides = [ops.branch() for _ in batches]
        for side, (dy_i, db_i) in zip(sides, batches):
            side.kernel("bias_grad_reduce", self.kernels("dense").plan_bias_grad_reduce(rows, n_out),
                        dy=dy_i, db=db_i, rows=rows, cols=n_out)
        main = ops.branch()
        self.bwd_gemm(main, n_out, n_in, rows, a=dy, b=x, c=dw, trans_a=True)
        ops.parallel(*sides, main)

    def bwd_kernel_fits(self, m: int, n: int, k: int, *operands, masked: bool = False) -> bool:
        """Whether the backward GEMM ``m x n x k`` on ``operands`` (``masked``: with a ReLU mask)
        runs as its precision's kernel (:data:`BACKWARD_GEMM_KERNEL`): :data:`BACKWARD_GEMM_KERNELS`,
        a masked GEMM where the precision is :data:`MASKED_ONLY`, no stacked pair among the
        operands and a shape the kernels are for (``fast.kernels.dense.gemm_tf32_fits``)."""
        from foxhunt.fast.kernels.dense import gemm_tf32_fits

        return (BACKWARD_GEMM_KERNELS and self.bwd_mode in BACKWARD_GEMM_KERNEL
                and (masked or self.bwd_mode not in MASKED_ONLY)
                and not any(isinstance(op, tuple) for op in operands) and gemm_tf32_fits(m, n, k))

    def bwd_gemm(self, ops: Ops, m: int, n: int, k: int, *, a, b, c, trans_a: bool = False,
                 h: Buf | None = None) -> None:
        """``c = op(a) @ b`` in the backward precision (operands as ``_gemm``'s), masked by ``h``
        (``relu_mask``'s ``h <= 0 ? 0 : c``) when given: ONE ``gemm_tf32`` / ``gemm_f32`` launch
        where :meth:`bwd_kernel_fits`, else a cuBLASLt GEMM (``h`` then needs the kernel: callers
        ask :meth:`bwd_kernel_fits` first)."""
        if not self.bwd_kernel_fits(m, n, k, a, b, c, masked=h is not None):
            if h is not None:
                raise ValueError(f"bwd_gemm: the masked GEMM {m}x{n}x{k} is not a gemm_tf32 shape")
            self._gemm(ops, m, n, k, a=a, b=b, c=c, trans_a=trans_a, precision=self.bwd_mode,
                       role="weight_grad" if trans_a else "input_grad")
            return
        dense = self.kernels("dense")
        tile_m, tile_n = dense.gemm_tf32_tile(m, n)
        ops.kernel(BACKWARD_GEMM_KERNEL[self.bwd_mode],
                   dense.plan_gemm_tf32(m, n, k, trans_a, arch=self.arch), a=a, b=b, c=c, h=h,
                   m=m, n=n, k=k, trans_a=int(trans_a), tile_m=tile_m, tile_n=tile_n)

    def input_grad(self, ops: Ops, *, dy, w, dx, rows, n_out, n_in, relu=None,
                   then: Callable[[Ops], None] | None = None) -> None:
        """``dx [rows, n_in] = dy [rows, n_out] @ W [n_out, n_in]``; with ``relu=(h, db,
        scratch)`` the result is masked by the forward ReLU's output (``h <= 0 ? 0 : dx``) and
        ``db = colsum(masked dx)``: a plain GEMM into ``scratch``, then ``relu_mask_bias_grad``
        (one per batch, side by side; why not DRELU_BGRAD: module docstring). With ``then`` (a
        function adding what follows to an ``Ops``) the mask and the bias sum are two kernels,
        ``relu_mask`` then ``bias_grad_reduce`` of its output (the same bits: the fused kernel's
        comment in cuda_src/dense.cu), and only the mask precedes ``then``'s records: the sums
        run beside them (a chain's next GEMM does not wait for a column sum); where
        :meth:`bwd_kernel_fits`, the GEMM and the mask are ONE ``gemm_tf32`` / ``gemm_f32``
        launch."""
        if relu is None:
            self.bwd_gemm(ops, rows, n_in, n_out, a=dy, b=w, c=dx)
            return
        h, db, scratch = relu
        dense = self.kernels("dense")
        batches = self._each(scratch, dx, db)
        if then is not None and self.bwd_kernel_fits(rows, n_in, n_out, dy, w, dx, masked=True):
            # The mask in the GEMM's epilogue: ONE launch writes dx (no scratch).
            self.bwd_gemm(ops, rows, n_in, n_out, a=dy, b=w, c=dx, h=h)
        else:
            self.bwd_gemm(ops, rows, n_in, n_out, a=dy, b=w, c=scratch)
            masks = [ops.branch() for _ in batches]
            for side, (scratch_i, dx_i, db_i) in zip(masks, batches):
                if then is None:
                    side.kernel("relu_mask_bias_grad", dense.plan_relu_mask_bias_grad(rows, n_in),
                                dy=scratch_i, h=h, dx=dx_i, db=db_i, rows=rows, cols=n_in)
                else:
                    side.kernel("relu_mask", dense.plan_relu_mask(rows * n_in), dy=scratch_i, h=h,
                                dx=dx_i, n=rows * n_in)
            if len(masks) > 1:
                ops.parallel(*masks)
            else:
                ops.extend(masks[0])
        if then is None:
            return
        sums = [ops.branch() for _ in batches]
        for side, (_, dx_i, db_i) in zip(sums, batches):
            side.kernel("bias_grad_reduce", dense.plan_bias_grad_reduce(rows, n_in), dy=dx_i,
                        db=db_i, rows=rows, cols=n_in)
        main = ops.branch()
        then(main)
        ops.parallel(*sums, main)

    # -- kernels used in several places
    @staticmethod
    def kernels(area: str):
        """``foxhunt.fast.kernels.<area>`` (the launch shapes ``plan_*``)."""
        import importlib

        return importlib.import_module(f"foxhunt.fast.kernels.{area}")

    def to_bf16(self, ops: Ops, src: Buf, dst: Buf, n: int) -> None:
        ops.kernel("f32_to_bf16", self.kernels("dense").plan_f32_to_bf16(n), x=src, out=dst, n=n)

    def norm(self, ops: Ops, src: str, which: str) -> None:
        """Phase 1 of ``grad_norm_sq(src)``: ``partials_<which>`` (fixed trees, no atomics);
        ``clip_saxpy_norm_partial`` sums them (phase 2) for the budget clip."""
        n = self.lay.NP
        ops.kernel("grad_norm_partial", self.kernels("optim").plan_grad_norm_partial(n, NORM_SEGMENT),
                   x=src, n=n, block_size=NORM_SEGMENT, partials=f"partials_{which}")

    def fused_check(self, ops: Ops, lens_key: str) -> None:
        """``nan_check_fused`` over the entries of ``desc_lengths_split()[lens_key]`` (no launch
        when that list is empty)."""
        lens = desc_lengths_split(self.lay.sentinel)[lens_key]
        if not any(lens):
            return
        ops.kernel("nan_check_fused", self.kernels("safety").plan_nan_check_fused(lens),
                   buffers="desc_ptrs", lengths=lens_key, thresholds="thresholds", flags="flags",
                   n_slots=self.lay.sentinel.n_desc)

    # -- forward
    def forward(self, ops: Ops, *, tag: str, rows: int, which: int, x: Buf, xb: Buf | None,
                logits: Buf, logp: Buf, q: Buf | None = None,
                extra: Ops | None = None, h2_event: str | None = None,
                fuse_trunk: bool = False, fuse_heads: bool = False,
                fuse_outputs: bool = False) -> None:
        """One forward pass of ``rows`` rows with params (``which=0``) or target (1): trunk,
        Mech 10 clamp (bound from ISV[H_S2_RMS_EMA] on the device), heads, then every branch's
        dueling combine, log-softmax into ``logits`` / ``logp`` (branch-packed from there) and,
        with ``q``, expected Q, in one launch. The heads' GEMMs run as parallel branches (first
        layers, then second layers); ``extra`` runs alongside the first layers. ``h2_event``:
        recorded once h2 (and its BF16 copy) is written, for chains that need only the trunk.
        ``fuse_trunk`` (the training step's passes): where :attr:`trunk_fused`, the trunk and its
        clamp are ONE ``trunk_forward_bf16`` launch (the same buffers written) instead of the
        GEMM, ``f32_to_bf16``, GEMM, ``clamp_finite_isv`` nodes; ``fuse_heads`` likewise: where
        :attr:`heads_fused`, the heads' first layers, ``f32_to_bf16`` and second layers are ONE
        ``heads_forward_bf16`` launch (alongside ``extra``); ``fuse_outputs`` (the training
        step's passes): where :attr:`outputs_fused` (and the heads are not fused), the heads'
        first layers are followed by ONE ``heads_out_dueling_bf16`` launch (the hidden values'
        BF16 copy, the second layers and the dueling log-softmax, the same buffers written; in
        f32 ``heads_out_dueling_f32``, without the copy)."""
        lay, c = self.lay, self.config
        bf16 = lay.bf16
        p32 = lambda name: self.weight(name, which, bf16=False)  # noqa: E731 - biases
        wfwd = lambda name: self.weight(name, which, bf16=bf16)  # noqa: E731 - GEMM weights
        h1, h2pre, h2 = Buf(f"h1{tag}"), Buf(f"h2pre{tag}"), Buf(f"h2{tag}")
        h2b = Buf(f"h2{tag}_bf16") if bf16 else None
        if fuse_trunk and self.trunk_fused:
            trunk = self.kernels("trunk")
            ops.kernel("trunk_forward_bf16",
                       trunk.plan_trunk_forward_bf16(rows, lay.SD, lay.H1, lay.H2, arch=self.arch),
                       xb=xb, w1=wfwd("w_s1"), b1=p32("b_s1"), w2=wfwd("w_s2"), b2=p32("b_s2"),
                       h1=h1, aux1=None, h1_bf16=Buf(f"h1{tag}_bf16"), h2pre=h2pre, aux2=None,
                       h2=h2, h2_bf16=h2b, rows=rows, sd=lay.SD, h1_width=lay.H1,
                       h2_width=lay.H2, isv="isv", index=isv_mod.H_S2_RMS_EMA_INDEX,
                       mult=np.float32(c.h2_clamp_mult))
        else:
            self.linear(ops, rows=rows, n=lay.H1, k=lay.SD, x=xb if bf16 else x, w=wfwd("w_s1"),
                        c=h1, bias=p32("b_s1"), epilogue="relu_bias")
            h1_in = h1
            if bf16:
                h1_in = Buf(f"h1{tag}_bf16")
                self.to_bf16(ops, h1, h1_in, rows * lay.H1)
            self.linear(ops, rows=rows, n=lay.H2, k=lay.H1, x=h1_in, w=wfwd("w_s2"), c=h2pre,
                        bias=p32("b_s2"), epilogue="relu_bias")
            n2 = rows * lay.H2
            ops.kernel("clamp_finite_isv", self.kernels("step").plan_clamp_finite_isv(n2),
                       x=h2pre, out=h2, out_bf16=h2b, n=n2, isv="isv",
                       index=isv_mod.H_S2_RMS_EMA_INDEX, mult=np.float32(c.h2_clamp_mult))
        if h2_event is not None:
            ops.record(h2_event)
        h2_in = h2b if bf16 else h2
        firsts = [] if extra is None else [extra]
        with_q = 1 if q is not None and not support_plan.live_q(c, q) else 0
        if fuse_outputs and self.outputs_fused and not (fuse_heads and self.heads_fused):
            self._heads_first_layers(ops, tag=tag, rows=rows, which=which, h2_in=h2_in,
                                     firsts=firsts)
            trunk = self.kernels("trunk")
            bf16_only = dict(mirror=Buf("mirror2", offset=which * lay.NP),
                             hid_bf16=Buf(f"hid{tag}_bf16")) if bf16 else {}
            ops.kernel(trunk.HOD_KERNELS[c.precision],
                       getattr(trunk, f"plan_{trunk.HOD_KERNELS[c.precision]}")(
                           rows, lay.head_hidden, lay.head_out, lay.branches, lay.NA,
                           arch=self.arch),
                       hid=Buf(f"hid{tag}"), params=Buf("params2", offset=which * lay.NP),
                       table="head_table", z="z", n_actions="n_actions",
                       action_offset="action_offset", v=Buf(f"v{tag}"), adv=Buf(f"adv{tag}"),
                       logits=logits, logp=logp, q=q if with_q else None, rows=rows,
                       n_heads=len(lay.heads), hid_align=OPERAND_ALIGN, num_atoms=lay.NA,
                       with_q=with_q, **bf16_only)
        else:
            self._heads_to_dueling(ops, tag=tag, rows=rows, which=which, h2_in=h2_in,
                                   firsts=firsts, fuse_heads=fuse_heads, logits=logits, logp=logp,
                                   q=q, with_q=with_q)
        if support_plan.live_q(c, q):  # adaptive_atoms: each branch's Q on its live support
            support_plan.forward_q(self, ops, tag=tag, rows=rows, logp=logp, q=q)

    def _heads_to_dueling(self, ops: Ops, *, tag: str, rows: int, which: int, h2_in: Buf,
                          firsts: list, fuse_heads: bool, logits: Buf, logp: Buf, q: Buf | None,
                          with_q: int) -> None:
        """The heads' forward as ``heads_forward_bf16`` (with ``fuse_heads`` where
        :attr:`heads_fused`) or as nodes, then ``dueling_log_softmax_q_branches``."""
        lay = self.lay
        if fuse_heads and self.heads_fused:
            fused = ops.branch() if firsts else ops
            fused.kernel("heads_forward_bf16",
                         self.kernels("trunk").plan_heads_forward_bf16(
                             rows, lay.H2, lay.head_hidden, lay.head_out, arch=self.arch),
                         h2b=h2_in, mirror=Buf("mirror2", offset=which * lay.NP),
                         params=Buf("params2", offset=which * lay.NP), table="head_table",
                         hid=Buf(f"hid{tag}"), hid_bf16=Buf(f"hid{tag}_bf16"), v=Buf(f"v{tag}"),
                         adv=Buf(f"adv{tag}"), rows=rows, h2_width=lay.H2, n_heads=len(lay.heads),
                         hid_align=OPERAND_ALIGN)
            if firsts:
                ops.parallel(*firsts, fused)
        else:
            self._heads_unfused(ops, tag=tag, rows=rows, which=which, h2_in=h2_in, firsts=firsts)
        ops.kernel("dueling_log_softmax_q_branches",
                   self.kernels("fused").plan_dueling_log_softmax_q_branches(rows, lay.branches, lay.NA),
                   v=f"v{tag}", adv=f"adv{tag}", z="z", n_actions="n_actions",
                   action_offset="action_offset", logits=logits, logp=logp, q=q, batch=rows,
                   num_atoms=lay.NA, with_q=with_q)

    def _heads_first_layers(self, ops: Ops, *, tag: str, rows: int, which: int, h2_in: Buf,
                            firsts: list) -> None:
        """Every head's first layer ``hid = relu(h2 @ W1^T + b1)`` as parallel branches, beside
        ``firsts``."""
        lay = self.lay
        for h in lay.heads:
            branch = ops.branch()
            self.linear(branch, rows=rows, n=h.hidden, k=lay.H2, x=h2_in,
                        w=self.weight(h.w1, which, bf16=lay.bf16), c=Buf(f"hid{tag}", h.key),
                        bias=self.weight(h.b1, which, bf16=False), epilogue="relu_bias")
            firsts.append(branch)
        ops.parallel(*firsts)

    def _heads_unfused(self, ops: Ops, *, tag: str, rows: int, which: int, h2_in: Buf,
                       firsts: list) -> None:
        """The heads' forward as nodes: every head's first layer (parallel branches, beside
        ``firsts``), the hidden values' BF16 copy, every head's second layer."""
        lay = self.lay
        bf16 = lay.bf16
        p32 = lambda name: self.weight(name, which, bf16=False)  # noqa: E731 - biases
        wfwd = lambda name: self.weight(name, which, bf16=bf16)  # noqa: E731 - GEMM weights
        self._heads_first_layers(ops, tag=tag, rows=rows, which=which, h2_in=h2_in, firsts=firsts)
        hid_in = {h.key: Buf(f"hid{tag}", h.key) for h in lay.heads}
        if bf16:
            hid_total = ops.binder.region(Buf(f"hid{tag}"), "hid").available
            self.to_bf16(ops, Buf(f"hid{tag}"), Buf(f"hid{tag}_bf16"), hid_total)
            offsets = {h.key: ops.binder.region(hid_in[h.key], "hid").start for h in lay.heads}
            hid_in = {key: Buf(f"hid{tag}_bf16", offset=off) for key, off in offsets.items()}
        seconds = []
        for d, h in enumerate(lay.heads):
            branch = ops.branch()
            out = Buf(f"v{tag}") if d == 0 else Buf(f"adv{tag}", d - 1)
            self.linear(branch, rows=rows, n=h.out, k=h.hidden, x=hid_in[h.key], w=wfwd(h.w2),
                        c=out, bias=p32(h.b2), epilogue="bias")
            seconds.append(branch)
        ops.parallel(*seconds)

    # -- backward of one loss
    def backward(self, ops: Ops, pres: Mapping[str, Ops], aux_dh2: Buf | None = None,
                 dueling_done: tuple[str, ...] = ()) -> None:
        """network.backward for the logit gradients in ``dlogits_<loss>``, into ``grad_<loss>``
        (every tensor written, padding untouched), for one loss or both (``pres``: each loss's
        records producing its ``dlogits_<loss>``); online(s) activations are rows 0..B.

        With both losses the backward is STACKED (SPEC 11): each GEMM is one launch of two
        batches, the losses' blocks of the stacked buffers (``StepLayout._add_stacked``) against
        the shared weights and activations; the per-loss kernels (the dueling backward, the bias
        and ``dh2`` sums, the checks) stay one launch per loss.

        Each loss's ``pre`` and one fused dueling backward (with the value gradient summed over
        the branches in the reference's order) run side by side; a loss in ``dueling_done`` has
        its ``dv_<loss>`` and ``dadv_<loss>`` written by its ``pre`` already
        (``c51_gather_project_dueling_branches``), so it gets no dueling backward. Then
        parallel branches: one per advantage head (its GEMMs), the value head, and the trunk
        (after every head's ``dh2`` part; the parts are summed in the reference's order:
        branches, then value). Each head computes its ``dh2`` part before its weight gradients,
        so those overlap the trunk; its hidden layer's bias sum runs beside them
        (``input_grad``'s ``then``).

        ``aux_dh2`` (the C51 pass with the auxiliary heads on: their weighted ``d h2``, ready at
        event ``aux_dh2``): after the heads' sum (and slot 33's check of it) the guarded
        ``dh2 += aux_dh2`` (``saxpy``, slot 34's check after it), then the masks of that sum;
        or all of it in one launch of ``h2_grad_sum_aux_mask`` (:attr:`aux_trunk_fused`)."""
        lay = self.lay
        B, NA, H2 = lay.B, lay.NA, lay.H2
        losses = tuple(pres)
        tag = "_".join(losses)
        fused = self.dh2_fused and len(losses) == 1 and aux_dh2 is None  # (stacked: 2 losses)
        P = lambda name: self.weight(name, 0, bf16=False)  # noqa: E731 - f32 master weights

        def each(stem: str, key=None):  # one loss's buffer, or the losses' pair
            bufs = tuple(Buf(f"{stem}_{loss}", key) for loss in losses)
            return bufs if len(bufs) > 1 else bufs[0]

        def grads(tensor: str):
            bufs = tuple(self.grad(f"grad_{loss}", tensor) for loss in losses)
            return bufs if len(bufs) > 1 else bufs[0]

        def head(branch: Ops, hi: int, dy) -> None:
            h = lay.heads[hi]
            hid = Buf("hido", h.key)
            dhid = each("dhid", h.key)

            def after_mask(rest: Ops) -> None:  # beside the hidden layer's bias sum
                if not fused:
                    self.input_grad(rest, dy=dhid, w=P(h.w1), dx=each("dh2p", h.key),
                                    rows=B, n_out=h.hidden, n_in=H2)
                rest.record(f"dh2p_{tag}_{h.key}")  # fused: dhid ready for heads_dh2_tf32
                self.weight_grad(rest, dy=dy, x=hid, rows=B, n_out=h.out, n_in=h.hidden,
                                 dw=grads(h.w2), db=grads(h.b2))
                self.weight_grad(rest, dy=dhid, x=Buf("h2o"), rows=B, n_out=h.hidden, n_in=H2,
                                 dw=grads(h.w1))

            self.input_grad(branch, dy=dy, w=P(h.w2), dx=dhid, rows=B, n_out=h.out, n_in=h.hidden,
                            relu=(hid, grads(h.b1), each("dpre", h.key)), then=after_mask)

        fronts = []
        for loss, pre in pres.items():
            front = ops.branch() if len(pres) > 1 else ops
            front.extend(pre)
            if loss not in dueling_done:
                front.kernel("dueling_combine_backward_sum_branches",
                             self.kernels("fused").plan_dueling_combine_backward_sum_branches(
                                 B, lay.branches, NA),
                             dlogits=f"dlogits_{loss}", n_actions="n_actions",
                             action_offset="action_offset", dv=f"dv_{loss}", dadv=f"dadv_{loss}",
                             batch=B, num_atoms=NA, n_branches=lay.nb)
            fronts.append(front)
        if len(fronts) > 1:
            ops.parallel(*fronts)
        chains = []
        for d in range(lay.nb):
            branch = ops.branch()
            head(branch, d + 1, each("dadv", d))
            chains.append(branch)
        value = ops.branch()
        head(value, 0, each("dv"))
        chains.append(value)
        trunk = ops.branch()
        for h in lay.heads:
            trunk.wait(f"dh2p_{tag}_{h.key}")
        sums, checks = [], []
        for loss in losses:
            sums.append(trunk.branch() if len(losses) > 1 else trunk)
            checks += self._dh2_sum(ops, sums[-1], chains, loss, tag,
                                    aux_dh2 if loss == "c51" else None, fused)
        if len(sums) > 1:
            trunk.parallel(*sums)
        self.trunk_backward(trunk, dh2m=each("dh2m"), grad=grads, dh1=each("dh1"),
                            scratch=each("dpre", "trunk"), beside=checks)
        chains.append(trunk)
        ops.parallel(*chains)

    def _dh2_sum(self, ops: Ops, trunk: Ops, chains: list, loss: str, tag: str,
                 aux_dh2: Buf | None, fused: bool = False) -> list[Ops]:
        """Loss ``loss``'s ``dh2`` from its heads' parts and its masks ``dh2m_<loss>`` on
        ``trunk`` (``fused``: the parts, the sum and the masks in one ``heads_dh2_tf32`` from the
        heads' hidden gradients ``dhid_<loss>``); its NaN checks (slots 33 and 34 of the C51
        pass; ``backward``'s docstring) as branches to run beside the trunk's GEMMs (returned),
        or a branch of ``chains``."""
        from foxhunt.reference.kernels.trunk import heads_dh2_order

        lay = self.lay
        B, H2 = lay.B, lay.H2
        parts = lay.packed[f"dh2p_{loss}"]
        order = [lay.heads[h].key for h in heads_dh2_order(len(lay.heads))]
        stride = blocks(B * H2, OPERAND_ALIGN) * OPERAND_ALIGN
        assert [parts.offsets[k] for k in order] == [i * stride for i in range(len(order))]
        safety, step, n2 = self.kernels("safety"), self.kernels("step"), B * H2
        parts_buf = Buf(f"dh2p_{loss}", order[0])
        if aux_dh2 is not None and self.aux_trunk_fused:
            # The heads' sum, the auxiliary heads' d h2 added and the masks in one launch once
            # both are ready; slot 33's and slot 34's checks (of its two sums) beside the
            # trunk's GEMMs.
            from foxhunt.fast.wave_layout import aux_heads

            heads = [Buf(f"aux_d_h2_{key}") for key, _ in aux_heads(self.config)]
            trunk.wait("aux_dh2")
            trunk.kernel("h2_grad_sum_aux_mask", step.plan_h2_grad_sum_aux_mask(n2),
                         parts=parts_buf, n_parts=len(order), part_stride=stride, aux_a=heads[0],
                         aux_b=heads[1] if len(heads) > 1 else None, h2="h2o", h2_pre="h2preo",
                         dh2_main=f"dh2_main_{loss}", dh2=f"dh2_{loss}", out=f"dh2m_{loss}",
                         n=n2)
            checks = []
            for x, slot in ((f"dh2_main_{loss}", "d_h2_post_main"),
                            (f"dh2_{loss}", "d_h2_post_aux")):
                check = ops.branch()
                check.kernel("nan_check", safety.plan_nan_check(n2), x=x, n=n2,
                             flag=Buf("flags", offset=sentinels.index(slot)))
                checks.append(check)
            return checks
        if fused:
            trunk_k = self.kernels("trunk")
            dhid = lay.packed[f"dhid_{loss}"]
            offsets = [dhid.offsets[h.key] for h in lay.heads]
            assert offsets == list(trunk_k.heads_packed_offsets(
                lay.head_hidden, lay.head_out, B, OPERAND_ALIGN)[0]), offsets
            trunk.kernel("heads_dh2_tf32",
                         trunk_k.plan_heads_dh2_tf32(B, H2, lay.head_hidden, arch=self.arch),
                         dhid=Buf(f"dhid_{loss}", lay.heads[0].key), params=Buf("params2"),
                         table="head_table", h2="h2o", h2_pre="h2preo", dh2_out=f"dh2_{loss}",
                         out=f"dh2m_{loss}", rows=B, h2_width=H2, n_heads=len(lay.heads),
                         hid_align=OPERAND_ALIGN)
        else:
            trunk.kernel("h2_grad_sum_mask", step.plan_h2_grad_sum_mask(n2), parts=parts_buf,
                         n_parts=len(order), part_stride=stride, h2="h2o", h2_pre="h2preo",
                         dh2_out=f"dh2_{loss}", out=f"dh2m_{loss}", n=n2)
        # Slot 33 (C51 pass): the trunk gradient right after the main backward; nothing writes
        # dh2 afterwards, so the check is a branch beside the trunk's GEMMs.
        checks = []
        if loss == "c51" and aux_dh2 is None:
            check = ops.branch()
            check.kernel("nan_check", safety.plan_nan_check(n2), x=f"dh2_{loss}", n=n2,
                         flag=Buf("flags", offset=sentinels.index("d_h2_post_main")))
            checks.append(check)
        if aux_dh2 is not None:
            # Slot 33 checks the heads' sum before the SAXPY adds to it: a second, identical
            # sum into its own buffer, beside the trunk (so the check is off the trunk's
            # chain); slot 34's checks the SAXPY's result beside the trunk's GEMMs, which take
            # the masks of the new sum.
            main = ops.branch()
            for h in lay.heads:
                main.wait(f"dh2p_{tag}_{h.key}")
            main.kernel("h2_grad_sum_mask", step.plan_h2_grad_sum_mask(n2), parts=parts_buf,
                        n_parts=len(order), part_stride=stride, h2="h2o", h2_pre="h2preo",
                        dh2_out=f"dh2_main_{loss}", out=f"dh2m_main_{loss}", n=n2)
            main.kernel("nan_check", safety.plan_nan_check(n2), x=f"dh2_main_{loss}", n=n2,
                        flag=Buf("flags", offset=sentinels.index("d_h2_post_main")))
            chains.append(main)
            trunk.wait("aux_dh2")
            trunk.kernel("saxpy", self.kernels("optim").plan_saxpy(n2), y=f"dh2_{loss}", x=aux_dh2,
                         n=n2, a=np.float32(1))
            check = ops.branch()
            check.kernel("nan_check", safety.plan_nan_check(n2), x=f"dh2_{loss}", n=n2,
                         flag=Buf("flags", offset=sentinels.index("d_h2_post_aux")))
            checks.append(check)
            trunk.kernel("h2_grad_sum_mask", step.plan_h2_grad_sum_mask(n2),
                         parts=f"dh2_{loss}", n_parts=1, part_stride=n2, h2="h2o", h2_pre="h2preo",
                         dh2_out=f"dh2s_{loss}", out=f"dh2m_{loss}", n=n2)
        return checks

    def trunk_backward(self, ops: Ops, *, dh2m, grad, dh1, scratch, beside=()) -> None:
        """The trunk's backward from the masked ``dh2m [B, SH2]`` (online(s) activations, f32
        master weights) into buffer ``grad`` (or the buffers ``grad(tensor)`` names): in parallel
        (with the ``beside`` branches), ``W_s2`` and ``b_s2``; and ``dh1`` through W_s2 and h1's
        ReLU (``scratch`` the unmasked product), then ``W_s1`` with ``b_s1``'s sum beside it
        (pairs: both losses' blocks, ``backward``)."""
        if isinstance(grad, str):
            buffer = grad
            grad = lambda tensor: self.grad(buffer, tensor)  # noqa: E731
        lay = self.lay
        B, H1, H2 = lay.B, lay.H1, lay.H2
        dw2 = ops.branch()
        self.weight_grad(dw2, dy=dh2m, x=Buf("h1o"), rows=B, n_out=H2, n_in=H1,
                         dw=grad("w_s2"), db=grad("b_s2"))
        rest = ops.branch()
        self.input_grad(rest, dy=dh2m, w=self.weight("w_s2", 0, bf16=False), dx=dh1, rows=B,
                        n_out=H2, n_in=H1, relu=(Buf("h1o"), grad("b_s1"), scratch),
                        then=lambda after: self.weight_grad(
                            after, dy=dh1, x=Buf("batch.x"), rows=B, n_out=H1, n_in=lay.SD,
                            dw=grad("w_s1")))
        ops.parallel(*beside, dw2, rest)


def step_constants(layout: StepLayout, address: Callable[[Buf], int]) -> dict[str, np.ndarray]:
    """Host values of the constant buffers (uploaded once, before the graphs are built);
    ``address(buf)`` is the arena address of a region (the sentinel and spectral descriptors
    hold pointers)."""
    from foxhunt.fast.kernels.spectral import spectral_descriptors
    from foxhunt.fast.kernels.trunk import heads_table
    from foxhunt.fast.isv_plan import isv_constants
    from foxhunt.fast.wave_layout import wave_constants
    from foxhunt.reference.step import support

    lay, c = layout, layout.config
    sp = lay.sentinel
    ptrs = np.zeros(sp.n_desc, np.uint64)
    mult = np.zeros(sp.n_desc, np.float32)
    index = np.full(sp.n_desc, -1, np.int32)
    power = np.ones(sp.n_desc, np.int32)
    for k, piece in desc_entries(sp):
        ptrs[k] = address(Buf(piece.buffer, piece.key, piece.offset))
        if piece.slot in sp.rules:
            mult[k], index[k], power[k] = sp.rules[piece.slot]
    mats = [(address(Buf("params2", offset=lay.tensor_offset(t.name))), address(Buf("sn_u", t.name)),
             address(Buf("sn_v", t.name)), t.shape[0], t.shape[1]) for t in lay.weights]
    lens = desc_lengths_split(sp)
    return {
        "z": support(c),
        "gamma": np.array(c.gammas, np.float32),
        "alpha": np.array([c.cql_alpha], np.float32),
        "scale": np.array([1.0 / (lay.B * lay.nb)], np.float32),
        "n_actions": np.array(lay.branches, np.int32),
        "action_offset": np.array(lay.action_offset, np.int32),
        "head_table": heads_table(lay.head_hidden, lay.head_out,
                                  [[lay.tensor_offset(n) for n in (h.w1, h.b1, h.w2, h.b2)]
                                   for h in lay.heads]),
        "thr_mult": mult, "thr_isv_index": index, "thr_power": power, "desc_ptrs": ptrs,
        **{key: np.array(lens[key], np.int64) for key in DESC_LENGTH_KEYS},
        "piece_slot": np.array([p.slot for p in sp.extras] or [0], np.int32),
        "spectral_desc": spectral_descriptors(mats).view(np.uint8).reshape(len(mats), 32),
        **wave_constants(lay),
        **isv_constants(lay),
    }


__all__ = ["FUSE_AUX_TRUNK_GRAD", "FUSE_GUARD_MASK", "FUSE_HEAD_OUTPUTS", "GEMM_ROLES",
           "GEMM_SM_SHARE",
           "GEMM_SM_SHARES", "GEMM_WORKSPACES",
           "LONG_K_RATIO", "UNIFORM_SM_SHARES", "StepProgram", "alignment", "plan_switches",
           "sm_count_targets",
           "step_constants"]
