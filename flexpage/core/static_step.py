"""Static decode steps: a wrapped model's decode-only steps as one compiled graph per decode bucket.

A step of ``n`` sequences decoding runs in the bucket of ``StepShape.decode_len(n)`` rows (the rows past
the real ones are padding: they write to the sink page and see nothing). Each bucket has its step
inputs in tensors built once and rewritten in place every step (``StaticDecode``: token ids,
positions, slots, rows, the mask's block metadata), and one graph compiled ahead of time over them
(``compile.StaticCompiled``, saved: a later process loads it in about a second). Inside the graph
the linear layers call oneDNN on their packed weights or the few-row kernel, and attention the C
decode kernel (``flexpage::paged_decode``, its keys found through the page table) or else the eager
kernels, all as opaque ops: inductor's own were slower on the CPU, and with them the compiled step
measured faster than the eager one at every bucket (``flexpage bench steps``). On a CUDA device each
bucket's compiled step is recorded once as a CUDA graph and replayed (``step_graph``). The Engine's
runner and ``wrap(compile_decode=True)`` both step through ``StaticSteps``: one mechanism.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .attention import head_group
from .cache import PagedKVCache
from .compile import compile_static
from .host import host_tensor
from .linear import FewRowLinears
from .masks import PackedBlockMask, StaticDecodeMask
from .pages import PackedPlan, PageTable
from .policy import device_policy
from .step_graph import Step, step_recorder
from .step_shape import StepShape

log = logging.getLogger(__name__)
Variants = set[tuple[int | None, float | None]]  # the layers' (sliding window, soft-cap) attention variants


def compiles_by_default(model: PreTrainedModel, device: torch.device) -> bool:
    """Whether ``compile_decode=None`` compiles ``model``'s decode steps: where the device policy
    measured compiled steps faster, for a model alone in its process (not split by a device map
    or tensor parallelism)."""
    alone = not getattr(model, "hf_device_map", None) and (getattr(model, "tp_size", None) or 1) == 1
    return alone and device_policy(device).compile_decode


@dataclass(frozen=True)
class StaticDecode:
    """One compiled decode bucket's step inputs, tensors that every step of the bucket rewrites in
    place: the token ids, the plan (positions, slots, rows; ``PageTable.static_plan``) and the mask
    (decode rows and block metadata; ``StaticDecodeMask``). The compiled forward reads only these."""

    input_ids: torch.Tensor  # [1, decode_len]
    plan: PackedPlan
    mask: StaticDecodeMask
    key: tuple  # the bucket's graph's key (``StaticCompiled.keyed``)

    @classmethod
    def build(cls, page_table: PageTable, decode_len: int, variants: Variants, group: int, key: tuple,
              flex: bool = True) -> "StaticDecode":
        """The bucket's tensors; ``flex``: its mask holds FlexAttention's metadata (``StaticDecodeMask.over``)."""
        plan = page_table.static_plan(decode_len)
        input_ids = torch.zeros(1, decode_len, dtype=torch.int64, device=page_table.device)
        return cls(input_ids, plan, StaticDecodeMask.over(page_table, plan, variants, group, flex), key)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a step writes in place and the compiled forward reads."""
        plans = [self.plan] if self.plan.window_plan is None else [self.plan, self.plan.window_plan]
        return [self.input_ids, *(t for plan in plans for t in (plan.slots, plan.tok_rows, plan.tok_pos,
                                                               plan.position_ids)), *self.mask.tensors()]


def _decode_forward(model: PreTrainedModel, inputs: dict) -> torch.Tensor:
    """A compiled decode step: the logits of every fed position (``inputs`` are the forward's
    keyword arguments: token ids, positions, the step's prepared mask, the cache)."""
    return model(**inputs).logits


# Where a graph can't be compiled ahead of time (older torch, or aot_compile fails): dynamo, as
# before, with inductor's freezing (the weights folded into the graph as constants).
_compiled_decode_forward = compile_static(_decode_forward, fallback=torch.compile(
    _decode_forward, dynamic=False, fullgraph=False, options={"freezing": True}))


def _model_key(model: PreTrainedModel, cache: PagedKVCache) -> str:
    """What a compiled decode forward specialises on besides its bucket: the model's class,
    config and weights' shapes (not their values: the graph reads them at each call), and the
    pools' and page table's shapes. A later process with the same gets the saved graphs."""
    tensors = itertools.chain(model.named_parameters(), model.named_buffers(),
                              ((f"pool{i}", layer.keys) for i, layer in enumerate(cache.layers)),
                              ((name, value) for name, value in sorted(vars(cache.page_table).items())
                               if isinstance(value, torch.Tensor)))
    shapes = [(name, tuple(t.shape), str(t.dtype), t.device.type) for name, t in tensors]
    text = "|".join(map(str, (type(model).__module__, type(model).__qualname__, model.config.to_json_string(),
                              getattr(model.config, "_attn_implementation", None), cache.page_size, shapes)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class StaticSteps:
    """The compiled static decode steps of ``model`` (wrapped) over ``cache``, one per bucket in
    ``buckets``. A bucket runs compiled once the layers' attention variants are known (``learn``:
    the mask of an eager step of two or more rows names them); until then its steps run eagerly.
    ``linears`` (``wrap``'s ``FewRowLinears``) are measured first: a traced forward bakes in the
    kernel each layer takes, and the saved graphs are keyed by those choices."""

    def __init__(self, model: PreTrainedModel, cache: PagedKVCache, cache_argument: str,
                 linears: FewRowLinears | None, buckets: set[int], shape: StepShape) -> None:
        self.model, self.cache, self.cache_argument, self.linears = model, cache, cache_argument, linears
        self.buckets, self.shape = set(buckets), shape
        if self.buckets and linears is not None:
            linears.measure(max(self.buckets))
        self.key = _model_key(model, cache) if self.buckets else None
        # a static step's attention runs eagerly inside it (``static_decode_attention``): grouped heads too
        self.group = head_group(cache.page_table.device, model.config.num_attention_heads, cache.num_kv_heads)
        # or reads the page table itself (``paged_decode``): then its masks need no FlexAttention metadata
        self.native = shape.native_decode
        self.variants: Variants = set()
        self.static: dict[int, StaticDecode] = {}  # each bucket's persistent step inputs
        self.forwards: dict[int, Step] = {}  # each bucket's compiled forward over those inputs
        # recorded and replayed (CUDA graphs) where the device does so: each bucket's replay
        self.recorder = step_recorder(cache.page_table.device) if self.buckets else None
        self.replays: dict[int, Step] = {}
        self.recorded = 0  # buckets recorded
        self.steps = 0  # compiled steps run

    def bucket(self, count: int) -> int:
        """The bucket of a decode step of ``count`` sequences (``StepShape.decode_len``)."""
        return self.shape.decode_len(count)

    def ready(self, decode_len: int) -> bool:
        """Whether a decode-only step of ``decode_len`` rows runs compiled."""
        return decode_len in self.buckets and bool(self.variants)

    def learn(self, mask: PackedBlockMask) -> None:
        """Take the attention variants the layers asked of an eager decode-only step's mask (two or
        more rows: a lone row is attended by SDPA and names none)."""
        plan = mask.plan
        if self.buckets and not self.variants and plan.decode_len > 1 and not plan.chunks:
            self.variants = mask.decode_variants()

    def learn_alone(self) -> None:
        """Learn the variants (``learn``) and the window of a model whose every layer is windowed
        (``PagedKVCache.learn_window``) from one eager decode step of a scratch row, padded to two
        rows so that FlexAttention, not SDPA, attends it; the pool is left as it was. For a cache no
        engine steps (``wrap``): call it between generate calls, not inside one."""
        if not self.buckets or self.variants:
            return
        row = self.cache.add_sequence()
        try:
            plan = self.cache.begin_packed_step([row], [], 2, 0, 1, pad_decode=True)
            mask = PackedBlockMask.for_step(self.cache.page_table, plan)
            with torch.inference_mode():
                self.model(input_ids=torch.zeros(1, 2, dtype=torch.int64, device=plan.position_ids.device),
                           position_ids=plan.position_ids, attention_mask=mask, use_cache=True, logits_to_keep=1,
                           **{self.cache_argument: self.cache})
            self.learn(mask)
            self.cache.learn_window(mask)  # every layer windowed: rows give back pages even if no step runs eager
        finally:
            self.cache.free_sequence(row)
            self.cache.step = None

    def run(self, rows: list[int], ids: list[int], decode_len: int) -> tuple[torch.Tensor, float]:
        """A decode-only step of the sequences in page-table ``rows`` (their slots reserved), fed
        ``ids``: its inputs written into the bucket's tensors, then the compiled forward over them.
        Returns every row's logits (the padding rows' too) and the seconds the model took."""
        static = self.static.get(decode_len)
        if static is None:
            # the bucket's graph: besides the model's key it specialises on the bucket, the variants, the
            # linear kernels it bakes in (measured before it was built) and whether its attention is the C++ op,
            # so its key is taken once
            kernels = self.linears.traced_kernels(decode_len) if self.linears is not None else ()
            key = (self.key, decode_len, self.group, tuple(sorted(self.variants, key=repr)), kernels, self.native)
            static = self.static[decode_len] = StaticDecode.build(self.cache.page_table, decode_len, self.variants,
                                                                  self.group, key, flex=not self.native)
            inputs = dict(input_ids=static.input_ids, position_ids=static.plan.position_ids,
                          attention_mask=static.mask, use_cache=True, logits_to_keep=0,
                          **{self.cache_argument: self.cache})
            self.forwards[decode_len] = functools.partial(_compiled_decode_forward.keyed, static.key, self.model,
                                                          inputs)
        self.cache.begin_packed_step(rows, [], decode_len, 0, 1, pad_decode=True, into=static.plan, reserved=True)
        static.input_ids.view(-1).copy_(host_tensor(ids + [0] * (decode_len - len(ids)), static.input_ids.device))
        static.mask.refresh(rows)
        start = time.perf_counter()
        logits = self._step(decode_len)[0]
        self.steps += 1
        return logits, time.perf_counter() - start

    def _step(self, decode_len: int) -> torch.Tensor:
        """The bucket's compiled forward over its tensors as they are now: replayed where the
        device records steps (``step_graph``; recorded on the bucket's first step, or run as it is
        where recording fails), else called."""
        if self.recorder is None:
            return self.forwards[decode_len]()
        replay = self.replays.get(decode_len)
        if replay is None:
            try:
                replay = self.recorder.record(self.forwards[decode_len])
                self.recorded += 1
            except Exception as error:  # noqa: BLE001 - an op a graph cannot hold: the bucket runs unrecorded
                log.warning("flexpage: decode bucket %d runs without a recorded graph (%s: %s)", decode_len,
                            type(error).__name__, error)
                replay = self.forwards[decode_len]
            self.replays[decode_len] = replay
        return replay()
