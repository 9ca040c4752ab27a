"""What the Engine counts as it steps: forwards, tokens, pages, speculation, and recent history."""

from __future__ import annotations

import time
from collections import deque

from ..core.cache import CacheStats
from .model_runner import StepResult
from .requests import StepOutput, StepSummary
from .sequence import Batch

HISTORY_STEPS = 10_000  # steps ``Engine.history`` keeps, the latest: a server steps for days


class Counters:
    """Running totals since the last reset; ``Engine.stats()`` reads them into ``EngineStats``."""

    def __init__(self, prefix_hits: int, compiled_steps: int = 0) -> None:
        self.steps = self.attention_calls = self.peak_pages = 0
        self.prefill_tokens = self.generated = self.finished = 0
        self.drafted = self.accepted = self.verifications = 0
        self.utilisation_sum = self.seconds = self.host_seconds = 0.0
        self.shapes: set[tuple[str, int]] = set()
        self.prefix_hits_at_reset, self.compiled_steps_at_reset = prefix_hits, compiled_steps
        self.history: deque[StepSummary] = deque(maxlen=HISTORY_STEPS)

    def step(self, batch: Batch, forward: StepResult, records: list[StepOutput], cache: CacheStats,
             shapes: list[tuple[str, int]], start: float) -> None:
        """One step (begun at ``perf_counter()`` ``start``): its work, its forward and speculation,
        the records it produced, the pool after it and its compiled region shapes."""
        now = time.perf_counter()
        produced = sum(r.token is not None for r in records)
        self.finished += sum(r.finish_reason is not None for r in records)
        prefill = sum(n for _, n in batch.chunks)
        self.steps += 1
        self.attention_calls += (forward.decode_len > 0) + (forward.chunk_len > 0)
        self.shapes.update(shapes)
        self.peak_pages = max(self.peak_pages, cache.pages_used)
        self.utilisation_sum += cache.utilisation
        self.prefill_tokens += prefill
        self.generated += produced
        self.host_seconds += now - start - forward.seconds
        self.verifications += forward.verifications
        self.drafted += forward.drafted
        self.accepted += forward.accepted
        self.history.append(StepSummary(now, len(batch.decode) + len(batch.verify), prefill, cache.pages_used,
                                        cache.utilisation, forward.verifications, forward.drafted, forward.accepted))
