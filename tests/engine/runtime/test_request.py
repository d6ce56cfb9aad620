"""Snapshot semantics of the design: shallow batch copy, idempotent copy_for_forward without the
penalizer, shallow spec_info, Req objects by identity; in-place filter does not reach a snapshot."""

import pytest
import torch

from engine.errors import ConfigError
from engine.runtime import inject
from engine.runtime.config import EngineConfig
from engine.runtime.request import snapshot_for_forward
from engine.trace.digest import batch_digest
from spec.errors import InternalError
from tests.batch_fixtures import make_batch


def test_snapshot_is_isolated_from_in_place_filter():
    live = make_batch()
    before = batch_digest(live)
    snap = snapshot_for_forward(live)
    live.filter([1])
    assert [r.rid for r in live.reqs] == ["r1"] and live.sampling_info.logit_bias.shape[0] == 1
    assert [r.rid for r in snap.reqs] == ["r0", "r1", "r2"]
    assert snap.sampling_info.logit_bias.shape[0] == 3 and snap.spec_info.draft == [0, 1, 2]
    assert batch_digest(snap) == before


def test_reqs_kept_by_identity_and_copy_is_shallow():
    live = make_batch()
    snap = snapshot_for_forward(live)
    assert all(a is b for a, b in zip(live.reqs, snap.reqs))
    c = snap.copy()
    assert c.reqs is snap.reqs and c is not snap


def test_copy_for_forward_is_idempotent_and_drops_penalizer():
    info = make_batch().sampling_info
    info.penalizer.accumulated += 0.5
    once = info.copy_for_forward()
    twice = once.copy_for_forward()
    assert once.penalizer is None and twice.penalizer is None
    assert torch.equal(once.logit_bias, twice.logit_bias)
    assert torch.equal(once.logit_bias, info.logit_bias + 0.5)
    assert once.logit_bias.data_ptr() != info.logit_bias.data_ptr() != twice.logit_bias.data_ptr()


def test_mutants_change_these_semantics():
    twice = frozenset({"non-idempotent-copy-for-forward"})
    once = make_batch().sampling_info.copy_for_forward(twice)
    assert not torch.equal(once.copy_for_forward(twice).logit_bias, once.logit_bias)
    live = make_batch()
    assert snapshot_for_forward(live, frozenset({"live-batch"})) is live
    assert snapshot_for_forward(live) is not live  # the switch is the run's, not the process's


def test_a_mutant_name_is_checked():
    with pytest.raises(ConfigError, match="--inject: unknown mutant"):
        EngineConfig(inject=frozenset({"live-btach"}))
    with pytest.raises(InternalError, match="no mutant named 'live-btach'"):
        inject.on(frozenset(), "live-btach")
