"""ContextLimits: which requests still have room for k draft tokens (coordinator.context_window)."""
from __future__ import annotations

import pytest

from coordinator.context_window import ContextLimits


def test_room_for_k_drafts_in_both_windows() -> None:
    limits = ContextLimits(verifier_max_model_len=100, drafter_max_model_len=50)
    assert limits.can_speculate(46, 4)          # draft KV ends at 49, target KV at 50
    assert limits.can_speculate(47, 4)          # draft KV 50 = its window
    assert not limits.can_speculate(48, 4)      # draft KV would hold 51
    assert limits.fits_drafter(50) and not limits.fits_drafter(51)
    same = ContextLimits(verifier_max_model_len=64, drafter_max_model_len=64)
    assert same.can_speculate(60, 4) and not same.can_speculate(61, 4)  # target KV 64 vs 65


def test_unknown_limits_allow_everything_and_negative_ones_are_refused() -> None:
    assert ContextLimits().can_speculate(10**6, 8) and ContextLimits().fits_drafter(10**6)
    with pytest.raises(ValueError, match="drafter_max_model_len"):
        ContextLimits(drafter_max_model_len=-1)
