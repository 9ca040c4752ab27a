"""The paged core: KV pages and the attention over them, with no notion of requests.

``pages`` allocates pages and keeps the page table, ``cache`` holds the per-layer pools behind
transformers' ``Cache`` contract (on huge pages from ``memory``), ``mods`` and ``masks`` build
BlockMasks from page tables and remap any mod to pages, ``attention`` makes the compiled attention
calls, ``step_shape`` sizes a packed step's regions and ``static_step`` compiles decode steps per
bucket, ``policy`` decides every CPU-versus-accelerator choice once per device kind, ``compile``
keeps kernels compiled ahead of time, ``linear`` the measured CPU matmuls and ``host`` small host
helpers. It imports nothing from the layers above it (``hf``, ``engine``, ``serve``, ``bench``),
only ``flexpage.errors``.
"""
