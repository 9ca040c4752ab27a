"""The OpenAI API's semantics below the HTTP layer: nulls, fields not implemented, stop strings before
``min_tokens``, outputs of tokens with no text, a vanishing ``top_p``, and the model's positions."""

from __future__ import annotations

import pytest
import torch

import flexpage
from flexpage import zoo
from flexpage.engine.sampling import Sampler
from flexpage.serve.app import Choice
from flexpage.serve.protocol import ChatCompletionRequest, CompletionRequest


def test_a_null_field_takes_its_default_and_unimplemented_fields_are_named():
    body = CompletionRequest.model_validate({"prompt": "hi", "temperature": None, "top_p": None, "n": None,
                                             "stream": None, "echo": None, "max_tokens": None, "min_p": 0.1,
                                             "store": True, "guided_decoding_backend": "xgrammar"})
    assert (body.temperature, body.top_p, body.n, body.stream, body.echo, body.max_tokens) == (1.0, 1.0, 1, False,
                                                                                                False, 16)
    assert body.unsupported() == ["guided_decoding_backend", "min_p"]  # "store" asks nothing of the output
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x", "name": "n"}],
                                                 "logprobs": None, "tools": None})
    assert chat.logprobs is False and chat.unsupported() == []
    with pytest.raises(ValueError, match="prompt"):
        CompletionRequest.model_validate({"prompt": None})  # a required field has no default to take


class Output:
    def __init__(self, token: int, finish_reason: str | None = None) -> None:
        self.token, self.finish_reason, self.logprobs = token, finish_reason, None


def test_stop_strings_wait_for_min_tokens_as_vllms():
    """A stop string completed before ``min_tokens`` tokens does not end the output; the first one
    completed by a token from there on does, cut before it."""
    tokenizer = zoo.load_tokenizer("llama-tiny")
    ids = tokenizer("ab ab ab ab", add_special_tokens=False)["input_ids"]
    early, late = Choice(tokenizer, ["ab"]), Choice(tokenizer, ["ab"], min_tokens=3)
    for token in ids:
        for choice in (early, late):
            if choice.finish_reason is None:
                choice.add(Output(token))
    assert early.finish_reason == "stop" and early.text == ""
    for j in range(3, len(ids) + 1):  # the reference: the first "ab" that a token from the third on completes
        before, text = tokenizer.decode(ids[: j - 1]), tokenizer.decode(ids[:j])
        starts = [i for i in range(len(text) - 1) if text[i : i + 2] == "ab" and i + 2 > len(before)]
        if starts:
            break
    assert late.finish_reason == "stop" and len(late.tokens) == j >= 3 and late.text == text[: starts[0]] != ""


def test_tokens_without_text_keep_the_decode_window_short():
    """Special tokens decode to nothing; each new one must not re-decode the whole run (quadratic)."""
    tokenizer = zoo.load_tokenizer("llama-tiny")
    special = tokenizer.all_special_ids[0]
    widths = []
    decode = tokenizer.decode

    def counting(ids, **options):
        widths.append(len(ids))
        return decode(ids, **options)

    tokenizer.decode = counting
    choice = Choice(tokenizer, [])
    for _ in range(300):
        choice.add(Output(special))
    choice.add(Output(tokenizer("x", add_special_tokens=False)["input_ids"][0], finish_reason="length"))
    assert choice.text == "x" and max(widths) <= 8


def test_a_vanishing_top_p_keeps_the_most_likely_token():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    picks = Sampler()(logits, [1.0] * 3, [5, None, 50], [1e-300, 1e-300, 1e-45],
                      [torch.Generator().manual_seed(i) for i in range(3)])
    assert picks == logits.argmax(-1).tolist()


def test_a_request_holds_at_most_the_models_positions():
    model = zoo.build("llama-tiny")
    positions = model.config.max_position_embeddings
    engine = flexpage.Engine(model, max_cached_tokens=2 * positions, max_batch_size=2, warmup=False)
    assert engine.max_seq_len == positions  # the pool holds more, the model was made for this many
    with pytest.raises(flexpage.InvalidRequestError, match=str(positions)):
        engine.add_request([3] * (positions - 3), flexpage.SamplingParams(max_new_tokens=8))
    assert engine.cache.stats().pages_used == 0
    with pytest.raises(ValueError, match="max_position_embeddings"):
        flexpage.Engine(zoo.build("llama-tiny"), max_seq_len=positions + 1, warmup=False)
