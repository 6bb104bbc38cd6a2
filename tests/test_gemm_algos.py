"""The cuBLASLt algorithm store (``fast.gemm_algos``) and ``PlanCache`` with a store, on the host
(fake plans stand in for cuBLASLt; the real check runs on the GPU in test_fast_gpu)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from foxhunt.fast import gemm_algos
from foxhunt.fast.gemm import GemmPlanError, PlanCache
from foxhunt.fast.gemm_algos import AlgoStore, fingerprint

H200 = SimpleNamespace(name="NVIDIA H200", compute_capability=(9, 0), multiprocessor_count=132)


class FakePlan:
    """A plan whose algorithm is 8 bytes; ``reject`` holds the algorithms a check refuses."""

    asked = 0
    reject: set = set()

    def __init__(self, m, n, k, heuristic=None, verify=False, **kw):
        self.args = (m, n, k, kw)
        self.verified = verify
        if heuristic is None:
            FakePlan.asked += 1
            heuristic = np.array([FakePlan.asked], np.int64)
        elif isinstance(heuristic, bytes):
            if verify and heuristic in FakePlan.reject:
                raise GemmPlanError("rejected by the check")
            heuristic = np.frombuffer(heuristic, np.int64)
        self.heuristic = np.array(heuristic, np.int64)


def test_answers_survive_the_process_in_one_file(tmp_path):
    store = AlgoStore.for_device(H200, 130000, root=tmp_path)
    key = PlanCache.key(4, 6, 8, precision="bf16")
    assert store.get(key) is None and len(store) == 0
    store.put(key, b"\x01\x02")
    again = AlgoStore.for_device(H200, 130000, root=tmp_path)
    assert again.get(key) == b"\x01\x02" and len(again) == 1
    assert again.get(PlanCache.key(4, 6, 8)) is None  # another precision: another GEMM
    path = tmp_path / gemm_algos.SUBDIR / f"{fingerprint(130000, H200)}.json"
    payload = json.loads(path.read_text())
    assert payload["format"] == gemm_algos.FORMAT and list(payload["algos"].values()) == ["0102"]
    again.forget(key)
    assert AlgoStore(path).get(key) is None


def test_the_fingerprint_separates_library_versions_and_devices():
    other = SimpleNamespace(**{**vars(H200), "multiprocessor_count": 114})
    prints = {fingerprint(130000, H200), fingerprint(130100, H200), fingerprint(130000, other),
              fingerprint(130000, SimpleNamespace(**{**vars(H200), "name": "NVIDIA H100"}))}
    assert len(prints) == 4


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": "other", "algos": {}}),
                                  json.dumps({"format": gemm_algos.FORMAT, "file": "x.json",
                                              "algos": {"k": "00"}}),
                                  json.dumps({"format": gemm_algos.FORMAT, "file": "s.json",
                                              "algos": {"k": "not hex"}})])
def test_an_unreadable_or_foreign_file_counts_as_empty_and_is_rewritten(tmp_path, text):
    path = tmp_path / "s.json"
    path.write_text(text)
    store = AlgoStore(path)
    assert len(store) == 0
    store.put(("k",), b"\x07")
    assert AlgoStore(path).get(("k",)) == b"\x07"


def test_a_failed_write_warns_and_keeps_the_answer(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = AlgoStore(blocker / "sub" / "s.json")  # its folder cannot be made
    with pytest.warns(UserWarning, match="could not write the cuBLASLt algorithm cache"):
        store.put(("k",), b"\x01")
    assert store.get(("k",)) == b"\x01"


def test_the_cache_root_follows_foxhunt_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FOXHUNT_CACHE_DIR", str(tmp_path))
    store = AlgoStore.for_device(H200, 1)
    assert store.path.parent == tmp_path / gemm_algos.SUBDIR


def test_plan_cache_takes_checked_stored_algorithms_and_asks_for_the_rest(tmp_path):
    path = tmp_path / "s.json"
    first = PlanCache(FakePlan, store=AlgoStore(path))
    a = first(4, 6, 8)
    b = first(16, 6, 8, precision="bf16")
    assert first.queries == 2 and first.loaded == 0 and not a.verified
    # A new process: both GEMMs from the store, each checked, no question asked.
    second = PlanCache(FakePlan, store=AlgoStore(path))
    c = second(4, 6, 8)
    d = second(16, 6, 8, precision="bf16")
    assert second.queries == 0 and second.loaded == 2 and c.verified and d.verified
    assert c.heuristic.tobytes() == a.heuristic.tobytes()
    assert d.heuristic.tobytes() == b.heuristic.tobytes()
    e = second(4, 6, 8)  # the same GEMM again: the in-process answer, not checked again
    assert not e.verified and second.loaded == 2
    # A stored algorithm the check rejects is forgotten, asked again and replaced.
    FakePlan.reject = {a.heuristic.tobytes()}
    try:
        third = PlanCache(FakePlan, store=AlgoStore(path))
        f = third(4, 6, 8)
    finally:
        FakePlan.reject = set()
    assert third.queries == 1 and third.loaded == 0
    assert f.heuristic.tobytes() != a.heuristic.tobytes()
    assert AlgoStore(path).get(PlanCache.key(4, 6, 8)) == f.heuristic.tobytes()
