"""The streams and the pooling rules of the calibration statistics (App. A.2.1), as one table.

A pooling rule says which streams' per-head moments enter a pooled covariance and how they are weighted:

- ``rows`` (default): add the raw sums of all Q and K heads, then centre once. Rows are weighted by
  count, so the Q:K weight ratio follows the head counts (3:1 for 9 Q heads and 3 KV heads).
- ``k_only``: the K stream alone (all KV heads).
- ``balanced``: equal stream weights on the first and uncentred second moments: average the
  per-stream normalised raw moments m1_s = Σx/n_s, m2_s = Σxxᵀ/n_s over s ∈ {Q, K}, then centre once:
  Σ = (m2_Q + m2_K)/2 - m̄ m̄ᵀ with m̄ = (m1_Q + m1_K)/2. (Stable form: (C_Q + C_K)/2 + δδᵀ/4, δ = μ_Q - μ_K.)
- ``per_head``: one covariance per KV head h (for φ_{h,k}): K head h's rows plus the rows of the Q
  heads of its GQA group, pooled like ``rows``; arrays of shape (L, H_kv, K).

:data:`POOLING` maps each :class:`PoolingRule` to its :class:`PoolSpec`; the pooling arithmetic of
:class:`rope_quant.calib.moments.PairMoments` reads nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from rope_quant.calib.errors import UnknownPoolingRuleError, UnknownStreamError

STREAMS = ("q", "k")


def check_stream(stream: Any) -> str:
    """``stream`` if it is 'q' or 'k', else UnknownStreamError."""
    if stream not in STREAMS:
        raise UnknownStreamError(f"unknown stream {stream!r}; expected 'q' or 'k'")
    return stream


class PoolingRule(StrEnum):
    """Names of the pooling rules (also the angle estimators' names)."""

    ROWS = "rows"
    K_ONLY = "k_only"
    BALANCED = "balanced"
    PER_HEAD = "per_head"


@dataclass(frozen=True)
class PoolSpec:
    """How a pooling rule combines the per-head moments.

    ``streams``: the streams whose rows enter. ``equal_stream_weights``: False pools every row with
    weight 1 (add the raw sums, centre once); True pools each stream alone and gives the streams equal
    weight (needs exactly two). ``per_kv_head``: keep one pool per KV head (its K head and the Q heads
    of its GQA group) instead of one per layer.
    """

    streams: tuple[str, ...]
    equal_stream_weights: bool = False
    per_kv_head: bool = False

    def __post_init__(self) -> None:
        for st in self.streams:
            check_stream(st)
        if not self.streams or (self.equal_stream_weights and len(self.streams) != 2):
            raise ValueError(f"a pooling rule needs streams (exactly two with equal weights), got {self.streams}")


POOLING: MappingProxyType[PoolingRule, PoolSpec] = MappingProxyType({
    PoolingRule.ROWS: PoolSpec(("q", "k")),
    PoolingRule.K_ONLY: PoolSpec(("k",)),
    PoolingRule.BALANCED: PoolSpec(("q", "k"), equal_stream_weights=True),
    PoolingRule.PER_HEAD: PoolSpec(("q", "k"), per_kv_head=True),
})
POOLING_RULES: tuple[str, ...] = tuple(rule.value for rule in POOLING)


def pool_spec(rule: Any) -> PoolSpec:
    """The table entry of ``rule`` (a :class:`PoolingRule` or its name), else UnknownPoolingRuleError."""
    if not isinstance(rule, str) or rule not in POOLING:
        raise UnknownPoolingRuleError(f"unknown pooling rule {rule!r}; expected one of {POOLING_RULES}")
    return POOLING[PoolingRule(rule)]
