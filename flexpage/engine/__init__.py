"""The engine: many requests over one paged pool, built on the paged core and ``flexpage.hf``.

``engine`` holds the public ``Engine``, a loop over three boxes: the ``scheduler`` (which sequences
run, through the ``block_manager``'s pages), the ``model_runner`` (one packed forward, then
``penalties`` and ``sampling``) and the Engine's own bookkeeping (``sequence``, ``requests``,
``counters``); ``speculative`` proposes drafts and ``parallel`` keeps tensor-parallel ranks in step.
"""

from .engine import Engine

__all__ = ["Engine"]
