"""GEMM planning on the host: the per-process plan cache and the lone cuBLASLt binding import."""

import sys

import pytest

from foxhunt.fast.gemm import GemmPlanError, GemmSpec, PlanCache, import_without_package_init


class FakePlan:
    """A plan whose "algorithm" is the id of the request that asked for it."""
    asked = 0

    def __init__(self, m, n, k, heuristic=None, **kw):
        self.args = (m, n, k, kw)
        if heuristic is None:
            FakePlan.asked += 1
            heuristic = ("algo", FakePlan.asked)
        self.heuristic = heuristic


def _counting(make):
    calls = []

    def planner(m, n, k, **kw):
        calls.append((m, n, k, kw))
        return make(m, n, k, **kw)
    return planner, calls


def test_equal_requests_reuse_the_algorithm_in_plans_of_their_own():
    planner, calls = _counting(FakePlan)
    cache = PlanCache(planner)
    a = cache(256, 512, 128, trans_b=True, precision="bf16", epilogue="relu_bias", min_alignment=256,
              workspace_limit=0)
    # The same GEMM with the defaults spelled out (dense strides, alpha 1, beta 0): a new plan
    # (its own descriptors and workspace) with the first one's algorithm, no second query.
    b = cache(256, 512, 128, trans_a=False, trans_b=True, precision="bf16", epilogue="relu_bias",
              lda=128, ldb=128, ldc=512, alpha=1.0, beta=0.0, min_alignment=256, workspace_limit=0)
    assert b is not a and b.heuristic == a.heuristic and cache.queries == 1
    assert calls[1][3]["heuristic"] == a.heuristic and "heuristic" not in calls[0][3]
    base = {"trans_b": True, "precision": "bf16", "epilogue": "relu_bias", "min_alignment": 256,
            "workspace_limit": 0}
    others = [cache(256, 512, 128, **{**base, **change})
              for change in ({"beta": 1.0}, {"precision": "tf32"}, {"epilogue": "bias"},
                             {"trans_b": False}, {"ldc": 640}, {"min_alignment": 16},
                             {"workspace_limit": 1 << 20}, {"sm_count_target": 33})]
    assert len({p.heuristic for p in [a, *others]}) == 9 and cache.queries == 9
    assert cache.requests == 10 and len(cache.plans) == 10
    assert others[1].args[3]["precision"] == "tf32"  # each plan made from its own request


def test_a_refusal_is_remembered_and_raised_again():
    def refuse(m, n, k, **kw):
        raise GemmPlanError(f"no algorithm for m={m}")
    planner, calls = _counting(refuse)
    cache = PlanCache(planner)
    for _ in range(3):
        with pytest.raises(GemmPlanError, match="no algorithm for m=8"):
            cache(8, 8, 8, epilogue="drelu_bgrad")
    assert len(calls) == 1 and cache.plans == [] and cache.queries == 1


def test_the_key_is_the_validated_spec():
    key = PlanCache.key(4, 6, 8, trans_a=True, epilogue="bgradb")
    assert key == (GemmSpec(4, 6, 8, trans_a=True, epilogue="bgradb"), 256, 32 << 20, 0)
    assert PlanCache.key(4, 6, 8, sm_count_target=33)[3] == 33
    with pytest.raises(ValueError, match="precision"):
        PlanCache.key(4, 6, 8, precision="f16")


def test_the_seed_step_asks_the_heuristic_once_per_distinct_gemm(monkeypatch):
    """The CPU executor builds the same plan as the GPU engine; through the cache, every
    record's plan has the spec it asked for, and the repeats are served from the cache."""
    from foxhunt.fast import cpu_executor
    from foxhunt.fast.records import Gemm
    from foxhunt.reference.config import DQNConfig

    caches = []
    real = cpu_executor.cpu_planner

    def cached(*args, **kw):
        caches.append(PlanCache(real(*args, **kw)))
        return caches[0]
    monkeypatch.setattr(cpu_executor, "cpu_planner", cached)
    engine = cpu_executor.CpuEngine(DQNConfig.preset("seed"))
    [cache] = caches
    graphs = [*engine.plans["upload"], engine.plans["graph1"], engine.plans["graph2"]]
    records = [it for ops in graphs for it in ops.nodes() if isinstance(it, Gemm)]
    assert cache.requests == len(engine.program.plans) >= len(records) > 0
    # Every record has a plan of its own (no shared descriptors or workspace), of its spec.
    assert len({id(it.plan) for it in records}) == len(records)
    assert len(cache.plans) == cache.requests
    # The heuristic was asked once per distinct request.
    distinct = {PlanCache.key(p.spec.m, p.spec.n, p.spec.k, **_kw(p)) for p in cache.plans}
    assert cache.queries == len(distinct) < cache.requests


def _kw(plan) -> dict:
    s = plan.spec
    return {"trans_a": s.trans_a, "trans_b": s.trans_b, "precision": s.precision,
            "epilogue": s.epilogue, "lda": s.lda, "ldb": s.ldb, "ldc": s.ldc, "alpha": s.alpha,
            "beta": s.beta, "min_alignment": plan.min_alignment,
            "workspace_limit": plan.workspace_limit, "batch": plan.batch,
            "batch_stride": plan.batch_stride}


def test_import_without_package_init_skips_the_parents_code(tmp_path, monkeypatch):
    pkg = tmp_path / "fatpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('the package __init__ ran')\n")
    (pkg / "sub" / "__init__.py").write_text("raise RuntimeError('the subpackage __init__ ran')\n")
    (pkg / "sub" / "helper.py").write_text("VALUE = 7\n")
    (pkg / "sub" / "leaf.py").write_text("from fatpkg.sub.helper import VALUE\nDOUBLE = 2 * VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [k for k in sys.modules if k.startswith("fatpkg")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        leaf = import_without_package_init("fatpkg.sub.leaf")
        assert leaf.DOUBLE == 14
        assert import_without_package_init("fatpkg.sub.leaf") is leaf  # loaded: as it is
        # The placeholders are gone: importing the package now runs its real __init__.
        assert "fatpkg" not in sys.modules and "fatpkg.sub" not in sys.modules
        assert sys.modules["fatpkg.sub.leaf"] is leaf
        with pytest.raises(RuntimeError, match="the package __init__ ran"):
            import fatpkg  # noqa: F401
        with pytest.raises(ModuleNotFoundError):
            import_without_package_init("fatpkg.nothing_here.leaf")
    finally:
        for name in [k for k in sys.modules if k.startswith("fatpkg")]:
            del sys.modules[name]


def _step_program(sm_count: int, sm_shares=None, **overrides):
    """A ``StepProgram`` of the seed preset built as ``CpuEngine`` builds it, with ``sm_count``
    (and ``sm_shares``), and its graph 1 (so every GEMM of the step is planned)."""
    from foxhunt.fast.cpu_executor import CPU_ARCH, HostArena, Memory, cpu_planner
    from foxhunt.fast.graph1_plan import graph1_ops
    from foxhunt.fast.step_layout import StepLayout
    from foxhunt.fast.step_program import StepProgram, step_constants
    from foxhunt.reference.config import DQNConfig, source_overrides

    lay = StepLayout(DQNConfig.preset("seed", **{**source_overrides("all"), **overrides}))
    constants = step_constants(lay, Memory([(lay, HostArena(lay.specs))], {}).address)
    prog = StepProgram(lay, planner=cpu_planner(), constants=constants, host_nbytes={},
                       arch=CPU_ARCH, sm_count=sm_count, sm_shares=sm_shares)
    graph1_ops(prog)
    return prog


def _role(spec) -> str:
    """A step GEMM's role from its operands' layout: the forward's layers multiply by W^T, the
    weight gradients reduce over the rows (A transposed), the input gradients by W itself."""
    return "weight_grad" if spec.trans_a else "forward" if spec.trans_b else "input_grad"


@pytest.mark.parametrize("precision", ["bf16", "tf32", "f32"])
def test_the_step_plans_each_gemm_for_its_roles_share_of_the_sms(precision):
    """A single trainer's plan: ``sm_count // share`` (0 for a share of 1) by the GEMM's role
    and the precision (``GEMM_SM_SHARES``), 0 without an SM count; a population's (its
    ``MEMBER_PROGRAM_OPTIONS``): every GEMM at ``sm_count // GEMM_SM_SHARE``. Only the
    long-reduction weight gradients (``k >= LONG_K_RATIO * max(m, n)``, transposed A) take a
    workspace under the ``"none"`` policy."""
    from foxhunt.fast.gemm import DEFAULT_WORKSPACE_LIMIT
    from foxhunt.fast.population_plan import MEMBER_PROGRAM_OPTIONS
    from foxhunt.fast.step_program import GEMM_ROLES, GEMM_SM_SHARE, GEMM_SM_SHARES, LONG_K_RATIO

    prog = _step_program(132, precision=precision)
    shares = GEMM_SM_SHARES[precision]
    by_role = {}
    for p in prog.plans:
        by_role.setdefault(_role(p.spec), set()).add(p.sm_count_target)
    assert set(by_role) == set(GEMM_ROLES)
    assert by_role == {r: {0 if shares[r] == 1 else 132 // shares[r]} for r in GEMM_ROLES}
    assert {p.sm_count_target for p in _step_program(0, precision=precision).plans} == {0}
    pop = _step_program(132, MEMBER_PROGRAM_OPTIONS["sm_shares"], precision=precision)
    assert {p.sm_count_target for p in pop.plans} == {132 // GEMM_SM_SHARE}
    long_k = [p for p in prog.plans
              if p.spec.trans_a and p.spec.k >= LONG_K_RATIO * max(p.spec.m, p.spec.n)]
    assert long_k, "the IQN head's weight gradients reduce over B * N rows"
    assert {p.workspace_limit for p in long_k} == {DEFAULT_WORKSPACE_LIMIT}
    assert {p.workspace_limit for p in prog.plans if p not in long_k} == {0}


@pytest.mark.parametrize("bad", [{"forward": 4, "input_grad": 1},
                                 {"forward": 0, "input_grad": 1, "weight_grad": 4},
                                 {"forward": 2.0, "input_grad": 1, "weight_grad": 4},
                                 {"forward": True, "input_grad": 1, "weight_grad": 4},
                                 {"forward": 4, "input_grad": 1, "weight_grad": 4, "other": 2}])
def test_bad_sm_shares_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"sm_shares: .* expected an int >= 1 for each of "
                                         r"forward, input_grad, weight_grad"):
        _step_program(132, bad, precision="bf16")


def test_a_bad_sm_count_target_is_refused_by_name():
    from foxhunt.fast.cpu_executor import CpuGemm

    for bad in (-1, 2.5, True, "33"):
        with pytest.raises(ValueError, match=r"sm_count_target: .* expected an int >= 0"):
            CpuGemm(8, 8, 8, sm_count_target=bad)
