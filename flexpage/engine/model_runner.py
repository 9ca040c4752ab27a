"""ModelRunner: one scheduled batch through the model, and the next token of each sequence.

It turns a ``Batch`` (its slots reserved when it was scheduled) into the step's inputs (token ids,
positions, the packed plan and its ``PackedBlockMask``), runs one forward, and picks the next
tokens: penalties and bias, what a request's grammar allows, greedy or sampled (each sequence
with its own generator), logprobs, a request whose pick fails failing alone. It owns the step
shapes: attention's region sizes are bucketed (powers of two), so a few compiled attention graphs
serve every mix of lengths, all compiled by ``warmup()``; an eager step's linear layers see each
decode token once (17 decode tokens are 17 rows, not a bucket of 32). A step of decode and
verification only runs as the static step of its compiled bucket (``core.static_step``), a
speculating sequence's fed tokens as decode rows of one page-table row.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..core.cache import PagedKVCache
from ..core.host import cdiv, host_tensor
from ..core.linear import FewRowLinears
from ..core.masks import PackedBlockMask
from ..core.pages import PackedPlan
from ..core.static_step import StaticSteps, compiles_by_default
from ..core.step_shape import CHUNK_BLOCK, MIN_CHUNK_REGION, StepShape
from ..errors import OutOfPagesError, StepFailedError
from .block_manager import BlockManager
from .penalties import adjust_logits
from .requests import TokenLogprobs
from .sampling import Sampler, greedy_tokens
from .sequence import Batch, Pick, Sequence
from .structured import Constraint, GrammarError, allowed_tokens, greedy_allowed, mask_disallowed

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What a step's forward and picks produced: each picking sequence's ``Pick``, the attention
    regions' sizes, the seconds the model took, and the speculation it verified."""

    picks: list[Pick]
    decode_len: int
    chunk_len: int
    seconds: float
    verifications: int = 0  # sequences that verified drafts
    drafted: int = 0  # drafts they verified
    accepted: int = 0  # drafts kept


class ModelRunner:
    """Runs ``model`` (wrapped, with its pools in ``cache``) over scheduled batches of at most
    ``max_batch_size`` sequences and ``max_tokens_per_step`` tokens, and picks their next tokens.
    ``linears``: the model's ``FewRowLinears`` (``wrap``'s), whose kernel choices a compiled step
    bakes in: they are measured before anything is compiled. ``speculative_tokens``: the drafts a
    sequence may verify in a step (0: none)."""

    def __init__(self, model: PreTrainedModel, cache: PagedKVCache, cache_argument: str, max_batch_size: int,
                 max_tokens_per_step: int, compile_decode: bool | None = None,
                 linears: FewRowLinears | None = None, speculative_tokens: int = 0) -> None:
        if max_tokens_per_step < max_batch_size + CHUNK_BLOCK:
            raise ValueError(
                f"max_tokens_per_step ({max_tokens_per_step}) must leave room for a decode token per sequence "
                f"(max_batch_size={max_batch_size}) and one {CHUNK_BLOCK}-token prefill chunk"
            )
        self.model, self.cache, self.cache_argument = model, cache, cache_argument
        self.max_batch_size, self.max_tokens_per_step = max_batch_size, max_tokens_per_step
        self.device = model.device  # fixed once the pools are allocated (the property is slow)
        # the decode and chunk regions' buckets
        self.shape = StepShape.of(model, self.device, cache.layers[0].keys.dtype, cache.num_kv_heads, cache.head_dim,
                                  1 + speculative_tokens if speculative_tokens else 0)
        self.sampler = Sampler()  # keeps its scratch rows from step to step
        # decode-only steps as static steps, one compiled graph per decode bucket (``StaticSteps``): every
        # bucket, none, or (None) the device policy's choice; not under tensor parallelism or device maps.
        # The buckets hold a decode token per sequence, and a lone sequence's verification of
        # ``speculative_tokens`` drafts (a row per fed token) where that is more
        rows = min(max(max_batch_size, 1 + speculative_tokens), max_tokens_per_step)
        buckets = {self.shape.decode_len(n) for n in range(1, rows + 1)}
        self.compile_decode = compile_decode
        default = compile_decode is None and compiles_by_default(model, self.device)
        self.graphs = StaticSteps(model, cache, cache_argument, linears,
                                  buckets if compile_decode or default else set(), self.shape)
        self.compiled_steps = 0  # steps that ran a compiled graph

    # ------------------------------------------------------------------ a step
    def run(self, batch: Batch) -> StepResult:
        """One forward over the batch (its slots reserved when it was scheduled), then every
        picking sequence's next token(s). Raises ``StepFailedError`` if the forward fails
        (``Scheduler.rollback`` gives the slots back); a request whose pick fails fails alone."""
        try:
            logits, sampled, verify_rows, decode_len, chunk_len, seconds = self._forward(batch)
        except Exception as error:  # the step's tokens were never computed (the scheduler rolls them back)
            raise StepFailedError([seq.index for seq in batch.stepped], error) from error
        picks = []
        asks = []
        for row, seq in sampled:  # a prompt just computed: its sibling samples pick from its row too
            for sibling in seq.siblings if not seq.output else ():
                picks.append(Pick(sibling, parent=seq))
                asks.append((sibling, row, sibling.tokens))
            picks.append(Pick(seq))
            asks.append((seq, row, seq.tokens))
        self._take(logits, asks, picks)
        result = StepResult(picks, decode_len, chunk_len, seconds)
        if batch.verify:
            self._verify(logits, batch.verify, verify_rows, result)
        return result

    def _take(self, logits: torch.Tensor, asks: list[tuple[Sequence, int, list[int]]], picks: list[Pick]) -> list[bool]:
        """Pick a token for each ask and add it to its ``Pick`` (or its failure); returns which succeeded."""
        tokens, logprobs, failed = self.pick(logits, asks)
        for i, ((seq, _, _), pick, token) in enumerate(zip(asks, picks, tokens)):
            if token is not None and seq.constraint is not None:
                try:
                    seq.constraint.take(token)
                except GrammarError as error:
                    token, tokens[i], failed[seq.index] = None, None, str(error)
            if token is None:
                pick.error = failed[seq.index]
            else:
                pick.tokens.append(token)
                pick.logprobs.append(logprobs.get(seq.index))
        return [token is not None for token in tokens]

    def _verify(self, logits: torch.Tensor, verify: list[Sequence], rows: list[int], result: StepResult) -> None:
        """Speculating sequences pick a token at each fed position in turn, as they would one step
        at a time (greedy, sampled, penalised alike: each position sees the tokens picked before
        it), while each picked token equals the draft fed after it and does not end the sequence."""
        going = [(seq, Pick(seq), row) for seq, row in zip(verify, rows)]
        result.picks += [pick for _, pick, _ in going]
        for j in range(1 + max(len(seq.drafts) for seq in verify)):
            # the tokens picked so far count for the penalties (no copy of the history without any)
            asks = [(seq, row + j, seq.tokens + pick.tokens if seq.params.adjusts_logits else seq.tokens)
                    for seq, pick, row in going]
            took = self._take(logits, asks, [pick for _, pick, _ in going])
            still = []
            for (seq, pick, row), ok in zip(going, took):
                token = pick.tokens[-1] if ok else None
                if ok and j < len(seq.drafts) and token == seq.drafts[j] and not seq.ends_with(
                        token, len(seq.tokens) + len(pick.tokens)):
                    pick.accepted += 1
                    still.append((seq, pick, row))
            going = still
        result.verifications = len(verify)
        result.drafted = sum(len(seq.drafts) for seq in verify)
        result.accepted = sum(pick.accepted for pick in result.picks[-len(verify):])

    def _forward(self, batch: Batch) -> tuple[torch.Tensor, list[tuple[int, Sequence]], list[int], int, int, float]:
        """One forward over the batch, packed: the decode tokens, then each prefill chunk (aligned to
        the chunk block), then each speculating sequence's last token and drafts; a step without
        chunks whose tokens fit a compiled bucket is its static step (``_static``). Raises whatever
        the forward raised. Returns the logits kept, each sampling sequence after its row of them,
        each speculating sequence's first row, the regions' sizes and the seconds the model took."""
        if not batch.chunks:  # decode and verification only: its compiled bucket's static step, if it has one
            static = self._static(batch)
            if static is not None:
                return static
        ids = [seq.tokens[-1] for seq in batch.decode]
        decode_len, block = self.shape.decode_len(len(batch.decode)), self.shape.chunk_block
        # speculating sequences are chunks of the chunk region: their last token and their drafts
        chunks = batch.chunks + [(seq, 1 + len(seq.drafts)) for seq in batch.verify]
        chunk_len = self.shape.chunk_len(n for _, n in chunks)
        plan = self.cache.begin_packed_step(
            [s.row for s in batch.decode], [(s.row, n) for s, n in chunks], decode_len, chunk_len, block, reserved=True)
        keep, sampled = list(range(len(batch.decode))), list(batch.decode)  # positions whose logits pick a token
        for seq, n in batch.chunks:
            span = cdiv(n, block) * block
            ids += seq.tokens[seq.num_computed : seq.num_computed + n] + [0] * (span - n)
            if seq.num_computed + n == len(seq.tokens):  # the chunk ends the prompt: its last logit samples
                keep.append(len(ids) - span + n - 1)
                sampled.append(seq)
        verify_rows = []
        for seq in batch.verify:  # every fed token's logits: each position verifies the draft after it
            n = 1 + len(seq.drafts)
            verify_rows.append(len(keep))
            keep += range(len(ids), len(ids) + n)
            ids += [seq.tokens[-1], *seq.drafts] + [0] * (cdiv(n, block) * block - n)
        ids += [0] * (plan.q_len - len(ids))
        logits, seconds = self._logits(ids, plan, keep)
        return logits, list(enumerate(sampled)), verify_rows, decode_len, chunk_len, seconds

    def _static(self, batch: Batch) -> tuple[torch.Tensor, list[tuple[int, Sequence]], list[int], int, int, float] | None:
        """A step without prefill chunks as the static step of the bucket its fed tokens fit, if that
        bucket is compiled (else None): each decode sequence one row, each speculating sequence a row
        per fed token (its last token, then its drafts: ``PageTable.plan_packed`` gives the same
        row its successive positions), so verifying drafts costs a compiled decode step of more rows.
        Returns as ``_forward``."""
        fed = len(batch.decode) + sum(1 + len(seq.drafts) for seq in batch.verify)
        decode_len = self.shape.decode_len(fed)
        if not self.graphs.ready(decode_len):
            return None
        ids, rows, verify_rows = [seq.tokens[-1] for seq in batch.decode], [seq.row for seq in batch.decode], []
        for seq in batch.verify:
            verify_rows.append(len(rows))
            rows += [seq.row] * (1 + len(seq.drafts))
            ids += [seq.tokens[-1], *seq.drafts]
        logits, seconds = self.graphs.run(rows, ids, decode_len)
        self.compiled_steps += 1
        return logits[: len(ids)], list(enumerate(batch.decode)), verify_rows, decode_len, 0, seconds

    def _logits(self, ids: list[int], plan: PackedPlan, keep: list[int]) -> tuple[torch.Tensor, float]:
        """One eager forward over a packed step: the logits of the ``keep`` positions, and the
        seconds the model itself took (inputs and mask are host work)."""
        device = self.device
        mask = PackedBlockMask.for_step(self.cache.page_table, plan)
        inputs = dict(
            input_ids=host_tensor(ids, device).view(1, -1),
            position_ids=plan.position_ids,  # the plan's tensors are on the cache's device already
            attention_mask=mask,
            use_cache=True,
            # every position's logits (0) when all are kept: a pure decode step builds no index tensor
            logits_to_keep=0 if len(keep) == len(ids) else host_tensor(keep, device),
        )
        inputs[self.cache_argument] = self.cache
        start = time.perf_counter()
        logits = self.model(**inputs).logits[0]
        seconds = time.perf_counter() - start
        self.graphs.learn(mask)  # the layers' attention variants, which a static step builds first
        self.cache.learn_window(mask)  # all layers windowed: rows give back pages behind the window
        return logits, seconds

    def pick(self, logits: torch.Tensor, asks: list[tuple[Sequence, int, list[int]]]
             ) -> tuple[list[int | None], dict[int, TokenLogprobs], dict[int, str]]:
        """Each ask's next token (None if its request failed), the logprobs asked for, and why each
        failed request failed. An ask is a sequence, its row of ``logits`` and its tokens so far
        (what penalties see). A row with nothing to sample from fails alone; if the step's
        penalties, sampling or logprobs raise, the picks are taken again one at a time, so only
        the requests that raise alone fail."""
        try:
            tokens = self._next_tokens(logits, asks)
            logprobs = self._logprobs(logits, asks, tokens)
        except Exception:  # noqa: BLE001 - the culprit is found below, one request at a time
            tokens, logprobs, failed = [], {}, {}
            for ask in asks:
                try:
                    (token,) = self._next_tokens(logits, [ask])
                    logprobs |= self._logprobs(logits, [ask], [token])
                except Exception as error:  # noqa: BLE001 - reported to this request alone
                    token, failed[ask[0].index] = None, f"{type(error).__name__}: {error}"
                tokens.append(token)
        else:
            failed = {}
        for (seq, _, _), token in zip(asks, tokens):
            if token is None and seq.index not in failed:
                failed[seq.index] = ("nothing could be sampled from the request's logits: NaN or infinite after "
                                     "its penalties and temperature")
        return tokens, logprobs, failed

    def _next_tokens(self, logits: torch.Tensor, asks: list[tuple[Sequence, int, list[int]]]) -> list[int | None]:
        """Each ask's next token from its row of ``logits`` (after the penalties and bias its
        request asks for): greedy ones by one argmax over the step, sampled ones by one draw over
        the step (``Sampler``), each from its sequence's generator."""
        params = [seq.params for seq, _, _ in asks]
        rows = [row for _, row, _ in asks]
        constrained = [i for i, (seq, _, _) in enumerate(asks) if seq.constraint is not None]
        masked = [i for i in constrained if params[i].do_sample]  # greedy rows are held after their argmax
        if masked or any(p.adjusts_logits for p in params):  # a float copy, a row per sequence, to adjust
            logits = _copied_rows(logits, rows).float()
            if any(p.adjusts_logits for p in params):
                adjust_logits(logits, [tokens for _, _, tokens in asks], [seq.prompt_len for seq, _, _ in asks],
                              params, [seq.stop_token_ids for seq, _, _ in asks])
            if masked:  # then what each grammar allows next
                _hold_to_grammars(logits, [asks[i][0].constraint for i in masked], masked)
            rows = list(range(len(asks)))
        drawn = [i for i, p in enumerate(params) if p.do_sample]
        greedy = greedy_tokens(logits) if len(drawn) < len(asks) else None  # the argmax of every row
        tokens = [0 if greedy is None else greedy[row] for row in rows]
        # a greedy row whose grammar takes its argmax keeps it; the others pick again, masked
        held = [i for i in constrained if not params[i].do_sample and not asks[i][0].constraint.accepts(tokens[i])]
        if held:
            for i, token in zip(held, greedy_allowed(logits, [rows[i] for i in held],
                                                     [asks[i][0].constraint for i in held])):
                tokens[i] = token
        if drawn:
            index = [rows[i] for i in drawn]  # no copy of the logits when every row samples
            chosen = logits if index == list(range(len(logits))) else _copied_rows(logits, index)
            sampled = self.sampler(chosen, [params[i].temperature for i in drawn], [params[i].top_k for i in drawn],
                                   [params[i].top_p for i in drawn], [asks[i][0].generator for i in drawn])
            for i, token in zip(drawn, sampled):
                tokens[i] = token
        return tokens

    def _logprobs(self, logits: torch.Tensor, asks: list[tuple[Sequence, int, list[int]]],
                  tokens: list[int | None]) -> dict[int, TokenLogprobs]:
        """The log-probabilities the step's requests asked for (``SamplingParams.logprobs``), by
        sequence index: one log-softmax and one top-k over all of their rows."""
        asked = [(seq.index, row, token, top) for (seq, row, _), token in zip(asks, tokens)
                 if token is not None and (top := seq.params.logprobs) is not None]
        if not asked:
            return {}
        device = logits.device
        logprobs = _copied_rows(logits, [row for _, row, _, _ in asked]).float().log_softmax(-1)
        chosen = logprobs.gather(1, host_tensor([token for _, _, token, _ in asked], device)[:, None])[:, 0].tolist()
        width = max(top for *_, top in asked)
        values, ids = logprobs.topk(width) if width else (logprobs[:, :0], logprobs[:, :0].long())
        values, ids = values.tolist(), ids.tolist()
        return {index: TokenLogprobs(chosen[i], list(zip(ids[i][:top], values[i][:top])))
                for i, (index, _, _, top) in enumerate(asked)}

    def compiled_shapes(self, decode_len: int, chunk_len: int) -> list[tuple[str, int]]:
        """The compiled attention regions a step of these region sizes used."""
        lone = decode_len == 1 and self.shape.lone_decode
        shapes = (("decode", 0 if lone else decode_len), ("chunk", 0 if self.shape.sdpa else chunk_len))
        return [shape for shape in shapes if shape[1]]

    def step_shapes(self) -> list[tuple[int, int]]:
        """Every ``(decode_len, chunk_len)`` region size a step can have that compiles a graph:
        each chunk-region bucket and each decode-region bucket. Where SDPA or the C decode kernel
        attends a lone decode token, and SDPA the prefill chunks (CPU), those regions compile nothing
        and have no buckets."""
        chunks = []
        if not self.shape.sdpa:
            chunks.append(MIN_CHUNK_REGION)
            while chunks[-1] < self.max_tokens_per_step:
                chunks.append(chunks[-1] * 2)
        first = 2 if self.shape.lone_decode else 1
        decodes = sorted({self.shape.decode_len(k) for k in range(first, self.max_batch_size + 1)})
        return [(0, c) for c in chunks] + [(d, 0) for d in decodes]

    @torch.inference_mode()
    def warmup(self, blocks: BlockManager, progress: bool = True) -> float:
        """Compile every step shape the engine can use (``step_shapes``) now, so that no
        request ever waits on a compile; returns the seconds it took.

        Each shape runs one forward over scratch sequences (zeros as tokens) given rows and slots
        by ``blocks``, keeping every decode row's logits (so the linear layers start timing their
        kernels for these row counts here), then they are freed: the pool, the prefix cache and
        the counters are as they were. A chunk region is warmed with two chunks, since a lone
        chunk is attended by SDPA and compiles nothing.
        """
        start = time.perf_counter()
        page_size = self.cache.page_size
        shapes = self.step_shapes()
        if self.graphs.buckets and not any(decode_len > 1 for decode_len, _ in shapes):
            # one row at most (a lone row is attended by SDPA): a scratch row padded to two names the
            # layers' attention variants, which the compiled decode steps need (``StaticSteps.learn``)
            shapes.append((self.shape.decode_len(2), 0))
        for decode_len, chunk_len in tqdm(shapes, desc="warm-up", unit="shape", disable=not progress):
            free = blocks.num_unused_pages - decode_len - 1  # cached prefix pages stay
            tokens = min(chunk_len, self.shape.chunk_block + min(free, blocks.max_seq_len // page_size) * page_size)
            if free < 0 or chunk_len and tokens <= self.shape.chunk_block:
                raise OutOfPagesError(f"warm-up needs free pages for a step of shape {(decode_len, chunk_len)}: "
                                      f"call it while the engine is idle")
            chunks = []
            if chunk_len:  # two chunks where two rows may run
                sizes = [self.shape.chunk_block, tokens - self.shape.chunk_block] if self.max_batch_size > 1 else [tokens]
                chunks = [(_scratch(n), n) for n in sizes]
            batch = Batch([_scratch(1) for _ in range(min(decode_len, self.max_batch_size))], chunks)
            with _scratch_rows(blocks, batch):
                plan = self.cache.begin_packed_step([s.row for s in batch.decode], [(s.row, n) for s, n in chunks],
                                                    decode_len, chunk_len, self.shape.chunk_block, reserved=True)
                self._logits([0] * plan.q_len, plan, list(range(max(len(batch.decode), 1))))  # LM head: decode rows
        # then the compiled decode graphs, twice over: the first forward of a model sets state that
        # the graphs compiled before it guard on (transformers' kernel hub), so the second builds it
        # the layers' mask variants are learned from an eager multi-row step: none, no compiled steps
        # (largest first: where steps are recorded as graphs, the smaller ones reuse its memory pool)
        graphs = self.graphs
        buckets = sorted(graphs.buckets, reverse=True) if graphs.variants else []
        for decode_len in tqdm(buckets * 2, desc="compiled steps", unit="graph", disable=not (progress and buckets)):
            if decode_len not in graphs.buckets:
                continue
            batch = Batch([_scratch(1) for _ in range(min(decode_len, self.max_batch_size))])
            try:
                with _scratch_rows(blocks, batch):
                    graphs.run([seq.row for seq in batch.decode], [0] * len(batch.decode), decode_len)
            except Exception as error:  # noqa: BLE001 - this bucket's steps run eager instead
                if self.compile_decode:  # asked for explicitly: say why it cannot be had
                    raise
                graphs.buckets.discard(decode_len)
                log.warning("decode bucket %d runs eager: compiling its forward failed (%s)", decode_len, error)
        return time.perf_counter() - start


def _copied_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A copy of some rows of ``logits`` (``index_select``: several times faster on the CPU than
    indexing with a tensor, which goes through the general advanced-indexing kernel)."""
    return logits.index_select(0, host_tensor(rows, logits.device))


def _hold_to_grammars(logits: torch.Tensor, constraints: list[Constraint], rows: list[int]) -> None:
    """Take out of each of ``rows`` of ``logits`` (a float copy) the tokens its constraint does not allow next."""
    whole = rows == list(range(len(logits)))
    chosen = logits if whole else _copied_rows(logits, rows)
    mask_disallowed(chosen, allowed_tokens(constraints))
    if not whole:
        logits.index_copy_(0, host_tensor(rows, logits.device), chosen)


def _scratch(num_tokens: int) -> Sequence:
    """A warm-up sequence of ``num_tokens`` zeros, none computed."""
    return Sequence(-1, [0] * num_tokens, num_tokens)


@contextmanager
def _scratch_rows(blocks: BlockManager, batch: Batch) -> Iterator[None]:
    """Rows and slots for a warm-up batch from ``blocks``, given back afterwards."""
    try:
        for seq in batch.stepped:
            blocks.allocate(seq, [])
        blocks.reserve(batch)
        yield
    finally:
        for seq in batch.stepped:
            if seq.row is not None:
                blocks.free(seq)
