"""The reference twin of every kernel the fast step launches, as the CPU executor calls it.

One ``Twin`` per launched kernel, under the kernel's name:

- ``extents``: for each pointer parameter, the shape of the region the kernel reads or writes,
  from the launch's scalar arguments (a parameter name stands for its value), its grid
  (``a.grid``) or a constant table it reads (``a.table(param, count)``). The plan builder
  checks every bound region against it (``foxhunt.fast.binder.Binder``); the executor shapes
  its NumPy views with it.
- ``run(a)``: calls the same-name reference kernel (``foxhunt.reference.kernels``) on copies
  of the input views (``a.<param>``; scalars likewise) and returns ``{param: new value}`` for
  every parameter it writes; the executor stores them. A kernel that reads through a pointer
  table (``nan_check_fused``, ``batched_spectral_norm``) reaches the pointed-to memory with
  ``a.at(address, count, dtype)``.
- ``nullable``: pointer parameters that may be null (the kernel then skips that output).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from foxhunt.reference.isv import H_S2_RMS_EMA_INDEX, ISV_LEN, Q_ABS_REF_INDEX
from foxhunt.reference.kernels import dense, optim, safety, spectral
from foxhunt.reference.kernels import distributional as dist
from foxhunt.reference.kernels import fused
from foxhunt.reference.kernels import isv as risv
from foxhunt.reference.kernels import step as rstep
from foxhunt.reference.kernels import trunk as rtrunk

F32, I32, I64, U16, U8, U64 = (np.dtype(t) for t in (np.float32, np.int32, np.int64, np.uint16,
                                                      np.uint8, np.uint64))
#: Bytes of one ``SpectralMatrix`` descriptor (``foxhunt.fast.kernels.spectral``).
SPECTRAL_MATRIX_BYTES = 32


class Args:
    """A launch's arguments as a twin sees them: scalars by name, pointer parameters as copies
    of their views (``None`` for a null pointer), ``grid``, ``table(param, count, dtype)`` (the
    first values a pointer parameter points at), ``view(param)`` (the writable view) and
    ``at(address, count, dtype)`` (memory a pointer table names)."""

    def __init__(self, scalars: Mapping, shape, *, table: Callable, views: Mapping | None = None,
                 at: Callable | None = None):
        self._scalars = scalars
        self._shape = shape
        self._table = table
        self._views = views or {}
        self._at = at
        self._copies: dict[str, np.ndarray] = {}

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._scalars:
            return self._scalars[name]
        if name in self._views:
            view = self._views[name]
            if view is None:
                return None
            if name not in self._copies:
                self._copies[name] = view.copy()
            return self._copies[name]
        raise AttributeError(f"no argument {name!r} (or it is not available when the plan is built)")

    @property
    def grid(self) -> tuple[int, int, int]:
        return self._shape.grid

    def table(self, name: str, count: int, dtype=I32) -> np.ndarray:
        return self._table(name, int(count), np.dtype(dtype))

    def view(self, name: str) -> np.ndarray:
        return self._views[name]

    def at(self, address: int, count: int, dtype) -> np.ndarray:
        return self._at(int(address), int(count), np.dtype(dtype))


@dataclass(frozen=True)
class Twin:
    name: str
    extents: Mapping[str, object]
    run: Callable[[Args], Mapping[str, np.ndarray]]
    nullable: frozenset


TWINS: dict[str, Twin] = {}


def twin(name: str, *, nullable=(), **extents):
    """Register ``run`` as the twin of kernel ``name`` with the given parameter extents."""
    def register(run):
        if name in TWINS:
            raise ImportError(f"twin {name!r} defined twice")
        TWINS[name] = Twin(name, MappingProxyType(extents), run, frozenset(nullable))
        return run
    return register


def shape_of(spec, a: Args) -> tuple[int, ...]:
    """An extent: an int, a parameter name, a callable of ``a``, or a tuple of those."""
    if callable(spec):
        spec = spec(a)
    if isinstance(spec, (int, str, np.integer)):
        spec = (spec,)
    return tuple(int(getattr(a, s)) if isinstance(s, str) else int(s(a)) if callable(s) else int(s)
                 for s in spec)


def branches(a: Args, count: int) -> tuple[int, ...]:
    """The branch table of a ``*_branches`` kernel: ``n_actions[:count]``, checked against
    ``action_offset`` (the packed layout's offsets)."""
    from foxhunt.fast.records import PlanError

    n = tuple(int(x) for x in a.table("n_actions", count))
    offsets = tuple(int(x) for x in a.table("action_offset", count))
    if not n or min(n) < 1:
        raise PlanError(f"n_actions {n}: a branch table holds action counts >= 1")
    if offsets != fused.branch_offsets(n):
        raise PlanError(f"action_offset {offsets} does not match n_actions {n}")
    return n


def _nb(a: Args) -> int:
    return a.grid[1]  # the *_branches kernels run branch d as blockIdx.y = d


def _packed_rows(a: Args, per_block: str = "batch") -> int:
    return getattr(a, per_block) * sum(branches(a, _nb(a)))


def _stacked(flat: np.ndarray, count: int, stride: int, n: int) -> np.ndarray:
    """``count`` parts of ``n`` elements, part k at ``k * stride`` of ``flat``: ``[count, n]``."""
    if not count:
        return np.zeros((0, n), flat.dtype)
    return np.stack([flat[k * stride:k * stride + n] for k in range(count)])


# --------------------------------------------------------------------------------------------
# dense
# --------------------------------------------------------------------------------------------


@twin("f32_to_bf16", x="n", out="n")
def _f32_to_bf16(a):
    return {"out": dense.f32_to_bf16(a.x)}


@twin("add_bias_relu", y=("rows", "cols"), b="cols", out=("rows", "cols"))
def _add_bias_relu(a):
    return {"out": dense.add_bias_relu(a.y, a.b)}


@twin("bias_grad_reduce", dy=("rows", "cols"), db="cols")
def _bias_grad_reduce(a):
    return {"db": dense.bias_grad_reduce(a.dy)}


@twin("relu_mask", dy="n", h="n", dx="n")
def _relu_mask(a):
    return {"dx": dense.relu_mask(a.dy[None, :], a.h[None, :])[0]}


def _backward_gemm_twin(name: str, reference):
    """The twins of ``gemm_tf32`` / ``gemm_f32`` (one launch contract)."""
    @twin(name, nullable=("h",), a=lambda a: (a.k, a.m) if a.trans_a else (a.m, a.k),
          b=("k", "n"), c=("m", "n"), h=("m", "n"))
    def run(a):
        from foxhunt.fast.kernels.dense import GEMM_TF32_TILES
        from foxhunt.fast.records import PlanError

        if a.trans_a not in (0, 1) or (a.tile_m, a.tile_n) not in GEMM_TF32_TILES:
            raise PlanError(f"{name}: trans_a={a.trans_a} (0 or 1), (tile_m, tile_n)=({a.tile_m}, "
                            f"{a.tile_n}) (one of {GEMM_TF32_TILES})")
        return {"c": reference(a.a, a.b, a.h, trans_a=bool(a.trans_a))}
    return run


_backward_gemm_twin("gemm_tf32", dense.gemm_tf32)
_backward_gemm_twin("gemm_f32", dense.gemm_f32)


@twin("relu_mask_bias_grad", dy=("rows", "cols"), h=("rows", "cols"), dx=("rows", "cols"), db="cols")
def _relu_mask_bias_grad(a):
    r = dense.relu_mask_bias_grad(a.dy, a.h)
    return {"dx": r.dx, "db": r.db}


def _aux_extent(width: str):
    return lambda a: (a.rows, rtrunk.aux_row_bytes(getattr(a, width)))


@twin("trunk_forward_bf16", nullable=("aux1", "aux2"), xb=("rows", "sd"), w1=("h1_width", "sd"),
      b1="h1_width", w2=("h2_width", "h1_width"), b2="h2_width", h1=("rows", "h1_width"),
      aux1=_aux_extent("h1_width"), h1_bf16=("rows", "h1_width"), h2pre=("rows", "h2_width"),
      aux2=_aux_extent("h2_width"), h2=("rows", "h2_width"), h2_bf16=("rows", "h2_width"),
      isv=ISV_LEN)
def _trunk_forward_bf16(a):
    with_aux = a.view("aux1") is not None
    if with_aux != (a.view("aux2") is not None):
        from foxhunt.fast.records import PlanError

        raise PlanError("trunk_forward_bf16: aux1 and aux2 are both bound or both null")
    r = rtrunk.trunk_forward_bf16(a.xb, a.w1, a.b1, a.w2, a.b2, a.isv, a.index, a.mult, with_aux)
    out = r._asdict()
    if not with_aux:
        del out["aux1"], out["aux2"]
    return out


def _heads(a: Args) -> np.ndarray:
    """``heads_forward_bf16``'s table ``[n_heads, HEADS_FIELDS]``: hidden, out, W1, b1, W2, b2 offsets."""
    return a.table("table", a.n_heads * rtrunk.HEADS_FIELDS).reshape(a.n_heads, rtrunk.HEADS_FIELDS)


def _heads_packed(a: Args):
    t = _heads(a)
    return rtrunk.heads_packed_offsets(t[:, 0], t[:, 1], a.rows, a.hid_align)


def _w2_b2_extent(a: Args) -> int:
    """Elements of the parameter set the table's W2 and b2 reach (``heads_out_dueling_bf16``
    reads no more)."""
    t = _heads(a)
    return int(max(np.max(t[:, 4] + t[:, 1] * t[:, 0]), np.max(t[:, 5] + t[:, 1])))


def _w1_extent(a: Args) -> int:
    """Elements of the parameter set the table's W1 blocks reach (``heads_dh2_tf32`` reads no
    more)."""
    t = _heads(a)
    return int(np.max(t[:, 2] + t[:, 0] * a.h2_width))


def _heads_param_extent(a: Args) -> int:
    """Elements of the parameter set the table reaches (its last tensor's end)."""
    t = _heads(a)
    return int(max(_w1_extent(a), np.max(t[:, 3] + t[:, 0]), _w2_b2_extent(a)))


def _heads_w2_b2(a: Args, t: np.ndarray, bf16: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The heads' ``w2 [OT, max(hidden)]`` (BF16 from the mirror, or float32 from the parameter
    set; a row's columns past its head's width zero) and ``b2 [OT]`` side by side, gathered by
    the table ``t``."""
    hidden, out = t[:, 0], t[:, 1]
    w2 = np.zeros((int(out.sum()), int(hidden.max())), U16 if bf16 else np.float32)
    source = a.mirror if bf16 else a.params
    o0 = 0
    for (width, o, _, _, w2o, _) in t:
        w2[o0:o0 + o, :width] = source[w2o:w2o + o * width].reshape(o, width)
        o0 += o
    return w2, np.concatenate([a.params[b2o:b2o + o] for _, o, _, _, _, b2o in t])


def _scatter_heads(a: Args, t: np.ndarray, r) -> dict:
    """A twin's side-by-side ``r.hid_bf16`` / ``r.out`` (and ``r.hid`` where it has one) in the
    packed buffers (``rtrunk.heads_packed_offsets``): ``{name: the whole buffer}``."""
    hid_off, _, adv_off, _ = _heads_packed(a)
    out = {"v": a.v, "adv": a.adv}
    if hasattr(r, "hid"):
        out["hid"] = a.hid
    if hasattr(r, "hid_bf16"):
        out["hid_bf16"] = a.hid_bf16
    h0 = o0 = 0
    for h, (width, o) in enumerate(zip(t[:, 0], t[:, 1])):
        span = slice(hid_off[h], hid_off[h] + a.rows * width)
        if "hid" in out:
            out["hid"][span] = r.hid[:, h0:h0 + width].ravel()
        if "hid_bf16" in out:
            out["hid_bf16"][span] = r.hid_bf16[:, h0:h0 + width].ravel()
        block = r.out[:, o0:o0 + o]
        if h == 0:
            out["v"][...] = block
        else:
            out["adv"][adv_off[h]:adv_off[h] + a.rows * o] = block.ravel()
        h0, o0 = h0 + width, o0 + o
    return out


@twin("heads_forward_bf16", h2b=("rows", "h2_width"), mirror=_heads_param_extent,
      params=_heads_param_extent, table=lambda a: a.n_heads * rtrunk.HEADS_FIELDS,
      hid=lambda a: max(_heads_packed(a)[1], 1), hid_bf16=lambda a: max(_heads_packed(a)[1], 1),
      v=lambda a: (a.rows, int(_heads(a)[0, 1])), adv=lambda a: max(_heads_packed(a)[3], 1))
def _heads_forward_bf16(a):
    """The reference twin on the heads gathered side by side from the parameter set, its
    outputs scattered into the packed buffers (``rtrunk.heads_packed_offsets``)."""
    t = _heads(a)
    hidden, out, h2 = t[:, 0], t[:, 1], a.h2_width
    w2, b2 = _heads_w2_b2(a, t)
    r = rtrunk.heads_forward_bf16(
        a.h2b, np.concatenate([a.mirror[w1o:w1o + w * h2].reshape(w, h2) for w, _, w1o, *_ in t]),
        np.concatenate([a.params[b1o:b1o + w] for w, _, _, b1o, _, _ in t]), w2, b2,
        hidden.astype(np.int32), out.astype(np.int32))
    return _scatter_heads(a, t, r)


def _hod_rows(a: Args) -> int:
    """Packed rows of the dueling outputs: ``rows * A_total`` (one head a branch after the value
    head)."""
    return a.rows * sum(branches(a, a.n_heads - 1))


_HOD_EXTENTS = dict(
    nullable=("q",), hid=lambda a: max(_heads_packed(a)[1], 1), params=_w2_b2_extent,
    table=lambda a: a.n_heads * rtrunk.HEADS_FIELDS, z="num_atoms",
    n_actions=lambda a: a.n_heads - 1, action_offset=lambda a: a.n_heads - 1,
    v=("rows", "num_atoms"), adv=lambda a: max(_heads_packed(a)[3], 1),
    logits=(_hod_rows, "num_atoms"), logp=(_hod_rows, "num_atoms"), q=_hod_rows)


def _heads_out_dueling(a, kernel: str):
    """The reference twin ``kernel`` on the packed hidden values and the heads' W2 / b2 gathered
    from the parameter set, its outputs scattered into the packed buffers
    (``rtrunk.heads_packed_offsets``)."""
    from foxhunt.fast.records import PlanError

    bf16 = kernel == "heads_out_dueling_bf16"
    if a.hid_align % 4:
        raise PlanError(f"{kernel}: hid_align={a.hid_align} is not a multiple of 4 "
                        "(the kernel's float4 loads)")
    t = _heads(a)
    if not bf16 and np.any(t[:, 4] % 4):
        raise PlanError(f"{kernel}: W2 offsets {t[:, 4].tolist()} are not multiples of 4 "
                        "(the kernel's float4 loads)")
    hidden, out = t[:, 0], t[:, 1]
    hid_off = _heads_packed(a)[0]
    w2, b2 = _heads_w2_b2(a, t, bf16)
    r = getattr(rtrunk, kernel)(
        np.concatenate([a.hid[hid_off[h]:hid_off[h] + a.rows * w].reshape(a.rows, w)
                        for h, w in enumerate(hidden)], axis=1), w2, b2, a.z,
        hidden.astype(np.int32), out.astype(np.int32),
        np.array(branches(a, a.n_heads - 1), np.int32), bool(a.with_q))
    result = {**_scatter_heads(a, t, r), "logits": r.logits, "logp": r.logp}
    if a.with_q and a.view("q") is not None:
        result["q"] = r.q
    return result


@twin("heads_out_dueling_bf16", mirror=_w2_b2_extent,
      hid_bf16=lambda a: max(_heads_packed(a)[1], 1), **_HOD_EXTENTS)
def _heads_out_dueling_bf16(a):
    return _heads_out_dueling(a, "heads_out_dueling_bf16")


@twin("heads_out_dueling_f32", **_HOD_EXTENTS)
def _heads_out_dueling_f32(a):
    return _heads_out_dueling(a, "heads_out_dueling_f32")


@twin("heads_dh2_tf32", dhid=lambda a: max(_heads_packed(a)[1], 1), params=_w1_extent,
      table=lambda a: a.n_heads * rtrunk.HEADS_FIELDS, h2=("rows", "h2_width"),
      h2_pre=("rows", "h2_width"), dh2_out=("rows", "h2_width"), out=("rows", "h2_width"))
def _heads_dh2_tf32(a):
    """The reference twin on the packed hidden gradients and the heads' W1 gathered from the
    parameter set (side by side)."""
    t = _heads(a)
    hid_off = _heads_packed(a)[0]
    hidden, h2 = t[:, 0], a.h2_width
    r = rtrunk.heads_dh2_tf32(
        np.concatenate([a.dhid[hid_off[h]:hid_off[h] + a.rows * w].reshape(a.rows, w)
                        for h, w in enumerate(hidden)], axis=1),
        np.concatenate([a.params[w1o:w1o + w * h2].reshape(w, h2) for w, _, w1o, *_ in t]),
        hidden.astype(np.int32), a.h2, a.h2_pre)
    return {"dh2_out": r.dh2, "out": r.out}


# --------------------------------------------------------------------------------------------
# distributional and fused
# --------------------------------------------------------------------------------------------

_ROWS_NA = (_packed_rows, "num_atoms")


@twin("dueling_log_softmax_q_branches", nullable=("q",), v=("batch", "num_atoms"), adv=_ROWS_NA,
      z="num_atoms", n_actions=_nb, action_offset=_nb, logits=_ROWS_NA, logp=_ROWS_NA,
      q=_packed_rows)
def _dueling_log_softmax_q_branches(a):
    r = fused.dueling_log_softmax_q_branches(a.v, a.adv, a.z, branches(a, _nb(a)), bool(a.with_q))
    out = {"logits": r.logits, "logp": r.logp}
    if a.with_q and a.view("q") is not None:
        out["q"] = r.q
    return out


def _sum_rows(a):
    return a.batch * sum(branches(a, a.n_branches))


@twin("dueling_combine_backward_sum_branches", dlogits=(_sum_rows, "num_atoms"),
      n_actions="n_branches", action_offset="n_branches", dv=("batch", "num_atoms"),
      dadv=(_sum_rows, "num_atoms"))
def _dueling_combine_backward_sum_branches(a):
    r = fused.dueling_combine_backward_sum_branches(a.dlogits, branches(a, a.n_branches))
    return {"dv": r.dv, "dadv": r.dadv}


def n_step_args(a) -> tuple:
    """A target kernel's n-step arguments as its reference twin takes them: ``(discount,
    gamma_ref)``, ``(None, None)`` with ``n_step_on = 0`` (the kernel reads neither)."""
    if a.n_step_on not in (0, 1):
        raise ValueError(f"n_step_on: {a.n_step_on!r}; allowed 0 or 1")
    if not a.n_step_on:
        return None, None
    if a.discount is None:
        raise ValueError("discount: a null pointer with n_step_on = 1")
    return a.discount, a.gamma_ref


def _require_spacing(a, kernel: str) -> None:
    """A projection kernel's ``dz`` must be its support's spacing (the reference derives it)."""
    if F32.type(a.dz) != dist.atom_spacing(a.v_min, a.v_max, a.num_atoms):
        raise ValueError(f"{kernel}: dz {a.dz} is not the support's spacing")


@twin("c51_project_grad", nullable=("discount",), p_next=("batch", "num_atoms"), r="batch",
      done="batch", gamma=1, z="num_atoms", logp=("batch", "num_actions", "num_atoms"),
      actions="batch", isw="batch", scale=1, discount="batch", m=("batch", "num_atoms"),
      dlogits=("batch", "num_actions", "num_atoms"))
def _c51_project_grad(a):
    _require_spacing(a, "c51_project_grad")
    r = dist.c51_project_grad(a.p_next, a.r, a.done, a.gamma[0], a.z, a.v_min, a.v_max, a.logp,
                              a.actions, a.isw, a.scale[0], *n_step_args(a))
    return {"m": r.m, "dlogits": r.dlogits}


@twin("c51_project_grad_live", nullable=("discount",), p_next=("batch", "num_atoms"), r="batch",
      done="batch", gamma=1, z="num_atoms", bounds=3, logp=("batch", "num_actions", "num_atoms"),
      actions="batch", isw="batch", scale=1, discount="batch", m=("batch", "num_atoms"),
      dlogits=("batch", "num_actions", "num_atoms"))
def _c51_project_grad_live(a):  # adaptive_atoms (foxhunt.fast.support_plan)
    r = dist.c51_project_grad_live(a.p_next, a.r, a.done, a.gamma[0], a.z, a.bounds, a.logp,
                                   a.actions, a.isw, a.scale[0], *n_step_args(a))
    return {"m": r.m, "dlogits": r.dlogits}


@twin("live_support_build", isv=ISV_LEN, members="n_branches", z=("n_branches", "num_atoms"),
      bounds=("n_branches", 3))
def _live_support_build(a):
    from foxhunt.fast.records import PlanError
    from foxhunt.reference import isv as reg
    from foxhunt.reference.kernels import live_support

    members = tuple(int(x) for x in a.members)
    slots = (a.q_abs_ref_slot, a.centre_base, a.half_base)
    if members != live_support.branch_members(a.n_branches) or slots != (
            Q_ABS_REF_INDEX, reg.V_CENTER_INDICES[0], reg.V_HALF_INDICES[0]):
        raise PlanError(f"live_support_build: members {members} / slots {slots} are not the "
                        "registry's (live_support.branch_members, Q_ABS_REF, V_CENTER, V_HALF)")
    return live_support.live_support_build(a.isv, a.n_branches, a.num_atoms,
                                           a.atom_growth_mult)._asdict()


@twin("expected_q", logp=("rows", "num_atoms"), z="num_atoms", q="rows")
def _expected_q(a):
    logp = a.logp.reshape(a.rows, 1, a.num_atoms)
    return {"q": dist.expected_q(logp, a.z).reshape(a.rows)}


@twin("cql_logit_grad", logp=("batch", "num_actions", "num_atoms"), actions="batch",
      z="num_atoms", alpha=1, scale=1, dlogits=("batch", "num_actions", "num_atoms"),
      terms="batch")
def _cql_logit_grad(a):
    r = dist.cql_logit_grad(a.logp, a.actions, a.z, a.alpha[0], a.scale[0])
    return {"dlogits": r.dlogits, "terms": r.terms}


def _block_logp(a):
    return (_packed_rows(a, "block_rows"), "num_atoms")


@twin("cql_logit_grad_branches", logp=_block_logp, actions=(_nb, "batch"), z="num_atoms", alpha=1,
      scale=1, n_actions=_nb, action_offset=_nb, dlogits=_ROWS_NA, terms=(_nb, "batch"))
def _cql_logit_grad_branches(a):
    r = fused.cql_logit_grad_branches(a.logp, a.actions, a.z, a.alpha[0], a.scale[0],
                                      branches(a, _nb(a)))
    return {"dlogits": r.dlogits, "terms": r.terms}


@twin("c51_loss_branches", logp=_block_logp, actions=(_nb, "batch"),
      m=(_nb, "batch", "num_atoms"), isw="batch", scale=1, n_actions=_nb, action_offset=_nb,
      ce=(_nb, "batch"), total=_nb)
def _c51_loss_branches(a):
    r = fused.c51_loss_branches(a.logp, a.actions, a.m, a.isw, a.scale[0], branches(a, _nb(a)))
    return {"ce": r.ce, "total": r.total}


# --------------------------------------------------------------------------------------------
# safety
# --------------------------------------------------------------------------------------------


@twin("nan_check", x="n", flag=1)
def _nan_check(a):
    return {"flag": np.array([safety.nan_check(a.x, a.flag[0])], I32)}


@twin("nan_check_fused", buffers="n_slots", lengths="n_slots", thresholds="n_slots", flags="n_slots")
def _nan_check_fused(a):
    bufs = [None if ptr == 0 else a.at(ptr, length, F32).copy()
            for ptr, length in zip(a.buffers, a.lengths)]
    return {"flags": safety.nan_check_fused(bufs, a.flags, a.thresholds)}


@twin("target_q_clip", q="n", out="n", q_abs_ref=1)
def _target_q_clip(a):
    return {"out": safety.target_q_clip(a.q, a.k1, a.q_abs_ref[0])}


# --------------------------------------------------------------------------------------------
# optim and spectral
# --------------------------------------------------------------------------------------------


@twin("grad_norm_partial", x="n", partials=lambda a: -(-a.n // a.block_size))
def _grad_norm_partial(a):
    return {"partials": optim.grad_norm_partial(a.x, a.block_size)}


@twin("clip_saxpy_norm_partial", base="n", inject="n", base_partials="count",
      inject_partials="count", out="n", partials=lambda a: -(-a.n // a.block_size),
      base_norm_sq_out=1, inject_norm_sq_out=1)
def _clip_saxpy_norm_partial(a):
    r = optim.clip_saxpy_norm_partial(a.base, a.inject, a.base_max_norm, a.base_partials, a.a,
                                      a.inject_max_norm, a.inject_partials, a.block_size)
    return {"out": r.out, "partials": r.partials, "base_norm_sq_out": [r.base_norm_sq],
            "inject_norm_sq_out": [r.inject_norm_sq]}


@twin("adam_update", param="n", grad="n", m="n", v="n", step=1, grad_scale=1, weight_clamp=1)
def _adam_update(a):
    r = optim.adam_update(a.param, a.grad, a.m, a.v, step=int(a.step[0]), lr=a.lr, beta1=a.beta1,
                          beta2=a.beta2, eps=a.eps, weight_decay=a.weight_decay,
                          grad_scale=a.grad_scale[0], weight_clamp=a.weight_clamp[0])
    return {"param": r.param, "m": r.m, "v": r.v}


@twin("adam_update_norm", param="n", grad="n", m="n", v="n", step=1,
      total_partials="n_partials", clip_bound=1, weight_clamp=1)
def _adam_update_norm(a):
    r = optim.adam_update_norm(a.param, a.grad, a.m, a.v, a.total_partials, a.clip_bound[0],
                               step=int(a.step[0]), lr=a.lr, beta1=a.beta1, beta2=a.beta2,
                               eps=a.eps, weight_decay=a.weight_decay,
                               weight_clamp=a.weight_clamp[0])
    return {"param": r.param, "m": r.m, "v": r.v}


@twin("polyak_update_mirror", target="n", online="n", online_bf16="n", target_bf16="n")
def _polyak_update_mirror(a):
    r = optim.polyak_update_mirror(a.target, a.online, a.tau)
    return {"target": r.target, "online_bf16": r.online_bf16, "target_bf16": r.target_bf16}


@twin("polyak_update_mirror_check", target="n", online="n", online_bf16="n", target_bf16="n",
      buffers="n_entries", lengths="n_entries", thresholds="n_entries", flags="n_entries")
def _polyak_update_mirror_check(a):
    entries = [_polyak_check_entry(a, int(ptr), int(length))
               for ptr, length in zip(a.buffers, a.lengths)]
    r = optim.polyak_update_mirror_check(a.target, a.online, a.tau, entries, a.flags,
                                         a.thresholds)
    return {"target": r.target, "online_bf16": r.online_bf16, "target_bf16": r.target_bf16,
            "flags": r.flags}


def _polyak_check_entry(a: Args, ptr: int, length: int) -> tuple[str, int, int] | None:
    """The reference's ``(source, offset, count)`` of a descriptor entry (address, length) of
    ``polyak_update_mirror_check``: None where the kernel skips it, else the source whose region
    holds it (the kernel reads nothing else: an entry outside both is a plan error)."""
    from foxhunt.fast.records import PlanError

    if ptr == 0 or length <= 0:
        return None
    where = a.at(ptr, length, F32).__array_interface__["data"][0]
    for source in optim.POLYAK_CHECK_SOURCES:
        view = a.view(source)
        offset, rest = divmod(where - view.__array_interface__["data"][0], F32.itemsize)
        if rest == 0 and 0 <= offset and offset + length <= view.size:
            return source, offset, length
    raise PlanError(f"polyak_update_mirror_check: entry at {ptr:#x} ({length} floats) lies in "
                    f"neither online nor target; the kernel checks only those")


@twin("batched_spectral_norm", mats=("count", SPECTRAL_MATRIX_BYTES), sigmas="count")
def _batched_spectral_norm(a):
    from foxhunt.fast.kernels.spectral import SPECTRAL_MATRIX_DTYPE

    if F32.type(a.eps) != spectral.SPECTRAL_EPS:
        raise ValueError(f"batched_spectral_norm: eps {a.eps} is not SPECTRAL_EPS")
    sigmas = np.zeros(a.count, np.float32)
    for k, d in enumerate(np.ascontiguousarray(a.mats).view(SPECTRAL_MATRIX_DTYPE).reshape(-1)):
        rows, cols = int(d["rows"]), int(d["cols"])
        w, u, v = a.at(d["w"], rows * cols, F32), a.at(d["u"], rows, F32), a.at(d["v"], cols, F32)
        r = spectral.spectral_norm(w.reshape(rows, cols).copy(), u.copy(), v.copy(), a.sigma_max)
        w[:], u[:], v[:] = r.w.ravel(), r.u, r.v
        sigmas[k] = r.sigma
    return {"sigmas": sigmas}


# --------------------------------------------------------------------------------------------
# ISV producers
# --------------------------------------------------------------------------------------------


def _isv_producer(update, slot: int, source: str):
    def run(a):
        if a.slot != slot:
            raise ValueError(f"{update.__name__}: slot {a.slot}; the reference writes slot {slot}")
        return {"isv": update(a.isv, getattr(a, source), a.alpha)}
    return run


twin("isv_q_abs_ref_update", isv=ISV_LEN, q="n")(
    _isv_producer(risv.isv_q_abs_ref_update, Q_ABS_REF_INDEX, "q"))
twin("isv_h2_rms_update", isv=ISV_LEN, h2="n")(
    _isv_producer(risv.isv_h2_rms_update, H_S2_RMS_EMA_INDEX, "h2"))


# --------------------------------------------------------------------------------------------
# The step's own kernels (reference/kernels/step.py)
# --------------------------------------------------------------------------------------------


@twin("step_bounds", isv=ISV_LEN, adam_t=1, weight_clamp=1, clip_bound=1,
      thr_mult="n_thresholds", thr_isv_index="n_thresholds", thr_power="n_thresholds",
      thresholds="n_thresholds")
def _step_bounds(a):
    r = rstep.step_bounds(a.isv, a.adam_t, a.thr_mult, a.thr_isv_index, a.thr_power,
                          a.q_abs_ref_index, a.slow_ema_index, a.weight_clamp_mult,
                          a.max_grad_norm, a.anchor_mult)
    return r._asdict()


@twin("clamp_finite_isv", nullable=("out_bf16",), x="n", out="n", out_bf16="n", isv=ISV_LEN)
def _clamp_finite_isv(a):
    with_bf16 = a.view("out_bf16") is not None
    r = rstep.clamp_finite_isv(a.x, a.isv, a.index, a.mult, with_bf16)
    return {"out": r.out, "out_bf16": r.out_bf16} if with_bf16 else {"out": r.out}


def _gather_branches(a):
    return branches(a, a.n_branches)


@twin("double_dqn_gather_branches",
      logp_target=lambda a: (a.batch * sum(_gather_branches(a)), a.num_atoms),
      a_star=("n_branches", "batch"), q_online=lambda a: a.q_rows * sum(_gather_branches(a)),
      actions=("n_branches", "batch"), n_actions="n_branches", action_offset="n_branches",
      p_next=("n_branches", "batch", "num_atoms"), q_taken=("n_branches", "batch"))
def _double_dqn_gather_branches(a):
    return rstep.double_dqn_gather_branches(a.logp_target, a.q_online, a.actions,
                                            _gather_branches(a), a.batch)._asdict()


@twin("c51_gather_project_dueling_branches", nullable=("discount",),
      logp_target=lambda a: (a.batch * sum(_gather_branches(a)), a.num_atoms),
      q_online=lambda a: a.q_rows * sum(_gather_branches(a)), actions=("n_branches", "batch"),
      n_actions="n_branches", action_offset="n_branches",
      logp=lambda a: (a.q_rows * sum(_gather_branches(a)), a.num_atoms), r="batch",
      done="batch", gamma="n_branches", z="num_atoms", isw="batch", scale=1, discount="batch",
      a_star=("n_branches", "batch"), p_next=("n_branches", "batch", "num_atoms"),
      q_taken=("n_branches", "batch"), m=("n_branches", "batch", "num_atoms"),
      dlogits=(_sum_rows, "num_atoms"), dv=("batch", "num_atoms"),
      dadv=(_sum_rows, "num_atoms"))
def _c51_gather_project_dueling_branches(a):
    _require_spacing(a, "c51_gather_project_dueling_branches")
    return rstep.c51_gather_project_dueling_branches(
        a.logp_target, a.q_online, a.actions, a.logp, a.r, a.done, a.gamma, a.z, a.v_min,
        a.v_max, a.isw, a.scale[0], _gather_branches(a), a.batch, *n_step_args(a))._asdict()


@twin("scalar_target_q_branches", nullable=("discount",),
      p_next=("n_branches", "batch", "num_atoms"), z="num_atoms", r="batch", done="batch",
      gamma="n_branches", discount="batch", target_q=("n_branches", "batch"))
def _scalar_target_q_branches(a):
    return {"target_q": rstep.scalar_target_q_branches(a.p_next, a.z, a.r, a.done, a.gamma,
                                                       *n_step_args(a))}


@twin("branch_mean", parts=lambda a: (a.n_branches - 1) * a.part_stride + a.n, out="n")
def _branch_mean(a):
    return {"out": rstep.branch_mean(_stacked(a.parts, a.n_branches, a.part_stride, a.n), a.divisor)}


@twin("h2_grad_sum_mask", parts=lambda a: (a.n_parts - 1) * a.part_stride + a.n, h2="n", h2_pre="n",
      dh2_out="n", out="n")
def _h2_grad_sum_mask(a):
    r = rstep.h2_grad_sum_mask(_stacked(a.parts, a.n_parts, a.part_stride, a.n), a.h2, a.h2_pre)
    return {"dh2_out": r.dh2, "out": r.out}


@twin("h2_grad_sum_aux_mask", nullable=("aux_b",),
      parts=lambda a: (a.n_parts - 1) * a.part_stride + a.n, aux_a="n", aux_b="n", h2="n",
      h2_pre="n", dh2_main="n", dh2="n", out="n")
def _h2_grad_sum_aux_mask(a):
    aux = np.stack([a.aux_a] if a.aux_b is None else [a.aux_a, a.aux_b])
    r = rstep.h2_grad_sum_aux_mask(_stacked(a.parts, a.n_parts, a.part_stride, a.n), aux, a.h2,
                                   a.h2_pre)
    return r._asdict()


def signal_bound(a: Args) -> np.float32:
    """The bound ``clamp_finite`` and ``h2_guard_mask`` form on the device from their
    ``multiplier`` and ``signal`` pointer: ``multiplier * fmaxf(*signal, 1)`` (``safety.
    isv_bound``'s value; +Inf is a bound too: no clamp, non-finite values to 0)."""
    f32 = np.float32
    with np.errstate(over="ignore"):
        return f32(f32(a.multiplier) * np.fmax(f32(a.signal[0]), f32(1)))


@twin("h2_guard_mask", x="n", h2="n", h2_pre="n", dh2_out="n", out="n", signal=1)
def _h2_guard_mask(a):
    r = rstep.h2_guard_mask(a.x, signal_bound(a), a.h2, a.h2_pre)
    return {"dh2_out": r.dh2, "out": r.out}


_READBACK = len(rstep.READBACK_FIELDS)


@twin("loss_scalars", c51_total="n_branches", terms=("n_branches", "batch"),
      q_taken=("n_branches", "batch"), target_q=("n_branches", "batch"), readback=_READBACK)
def _loss_scalars(a):
    r = rstep.loss_scalars(a.c51_total, a.terms, a.q_taken, a.target_q, a.alpha)
    readback = a.readback
    for name, value in r._asdict().items():
        readback[rstep.READBACK_INDEX[name]] = value
    return {"readback": readback}


@twin("step_scalars", total_partials="n_partials", total_sq=1, c51_sq=1, cql_sq=1,
      clip_bound=1, isv=ISV_LEN, safety_scale=1, readback=_READBACK)
def _step_scalars(a):
    r = rstep.step_scalars(a.total_partials, a.c51_sq[0], a.cql_sq[0], a.clip_bound[0], a.isv,
                           a.readback, a.budget_c51, a.budget_cql, a.slow_ema_index, a.slow_alpha)
    return {"total_sq": [r.total_sq], "safety_scale": [r.safety_scale], "readback": r.readback,
            "isv": r.isv}


@twin("merge_piece_flags", flags=lambda a: a.n_slots + a.n_pieces, piece_slot="n_pieces")
def _merge_piece_flags(a):
    return {"flags": rstep.merge_piece_flags(a.flags, a.piece_slot, a.n_slots)}


# The second-wave sources' twins register themselves here (a module of their own: size).
from foxhunt.fast import cpu_wave_kernels  # noqa: E402,F401
from foxhunt.fast import cpu_isv_kernels  # noqa: E402,F401 (issue 19's producers)

__all__ = ["Args", "TWINS", "Twin", "branches", "shape_of", "twin"]
