"""Tensor parallelism for the Engine: every rank runs the same deterministic scheduler in lockstep.

Under transformers' tensor parallelism (a model loaded with ``DistributedConfig(tp_size=N)``,
under ``torchrun``) every rank must run the same forward with the same inputs. Requests enter on
rank 0; before each step rank 0 broadcasts what changed since the last one (requests added, with
the seed of every sampled one; requests aborted; shutdown) over a CPU (gloo) group, the other
ranks apply it, and all take the same step. The scheduler depends on nothing per-process (no
clocks, set orders, hashes of str, free memory), so the plans agree; ``check=True`` compares
every step's plan across ranks and raises ``RankDivergenceError`` if they ever differ.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..errors import FlexpageError


class RankDivergenceError(FlexpageError, RuntimeError):
    """Tensor-parallel ranks planned different steps (a bug: their forwards would not match)."""


class RankSync:
    """Rank 0's commands, broadcast once per step to the ranks of ``group``."""

    def __init__(self, group: dist.ProcessGroup | None = None, check: bool = False) -> None:
        self.group = group if group is not None else dist.new_group(backend="gloo")  # collective: every rank
        self.source = dist.get_global_rank(self.group, 0)
        self.leader = dist.get_rank() == self.source
        self.check = check
        self._outbox: list[tuple] = []

    @classmethod
    def for_model(cls, model: Any, group: dist.ProcessGroup | None, check: bool) -> RankSync | None:
        """A sync for a tensor-parallel model (``model.tp_size > 1``), else None."""
        if (getattr(model, "tp_size", None) or 1) <= 1:
            return None
        return cls(group, check)

    def send(self, command: tuple) -> None:
        """Queue a command (rank 0 only) for the next ``exchange``."""
        self._outbox.append(command)

    def exchange(self) -> list[tuple]:
        """Rank 0's commands since the last exchange, on every rank (a collective call)."""
        box = [self._outbox if self.leader else None]
        dist.broadcast_object_list(box, src=self.source, group=self.group)
        self._outbox = []
        return box[0]

    def compare(self, plan: tuple) -> None:
        """With ``check``: raise ``RankDivergenceError`` unless every rank planned ``plan``."""
        if not self.check:
            return
        plans: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(plans, plan, group=self.group)
        if any(p != plans[0] for p in plans):
            raise RankDivergenceError(f"ranks planned different steps: {plans}")
