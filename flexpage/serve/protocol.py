"""The OpenAI API's request and response bodies (the fields real clients send and read).

A null for a field is its default, as OpenAI and vLLM take it (the openai client sends options it
was given as None). Fields are checked here, and what only the engine can judge (prompt length,
token ids) when the request is submitted. Fields the server does not implement — known ones
(tools, images, structured output, echo, ...) and unknown ones (vLLM's ``min_p``, guided decoding,
typos) — are refused with a 400 naming the field, never silently dropped; only fields that ask
nothing of the output (``INFORMATIONAL``) are accepted and ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..engine.requests import SEED_RANGE
from ..engine.penalties import MAX_BIAS, MAX_PENALTY, REPETITION_PENALTY_RANGE

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 512  # characters per stop string
MAX_STOP_TOKENS = 64


# request fields that ask nothing of the output: accepted, ignored
INFORMATIONAL = frozenset({"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
                           "parallel_tool_calls"})


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """A field sent as null takes its default."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None or key not in cls.model_fields}
        return data

    def unsupported(self) -> list[str]:
        """The request's fields the server does not implement (neither declared nor ``INFORMATIONAL``)."""
        return sorted(set(self.model_extra or ()) - INFORMATIONAL)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = None  # -1 or None: off (vLLM's convention)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(default=1.0, ge=REPETITION_PENALTY_RANGE[0],
                                      le=REPETITION_PENALTY_RANGE[1])  # vLLM's extension
    min_tokens: int = Field(default=0, ge=0)  # vLLM's extension: no stop token or string before this many
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default=[], max_length=MAX_STOP_TOKENS)  # vLLM's
    logit_bias: dict[int, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]] | None = None  # token id -> bias
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _check(self) -> SamplingRequest:
        if self.top_k is not None and self.top_k != -1 and self.top_k < 1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings of at most "
                             f"{MAX_STOP_CHARS} characters")
        return stop

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one string, one token-id list, or a list of either."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p) or [[]]

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        """Known fields the server cannot honour are refused, not ignored."""
        if self.echo:
            raise ValueError("echo is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (every sample is returned: use n)")
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported")
        return self


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    tool_calls: list | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content: str | list[dict] | None) -> str | list[dict] | None:
        for j, part in enumerate(content if isinstance(content, list) else []):
            if part.get("type") != "text":
                raise ValueError(f"content part {j} has type {str(part.get('type'))[:40]!r}: only text parts are "
                                 f"supported (no images, audio or files)")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {j} of type 'text' needs a string 'text'")
        return content

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, calls: list | None) -> list | None:
        if calls:
            raise ValueError("tool calls are not supported")
        return calls

    def text(self) -> str:
        """The message's text (its text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, tools: list | None) -> list | None:
        if tools:
            raise ValueError("tools and functions are not supported (no tool calling)")
        return tools

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, choice: str | dict | None) -> str | dict | None:
        if choice not in (None, "none"):
            raise ValueError("only 'none' is supported (no tool calling)")
        return choice

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, response_format: dict | None) -> dict | None:
        if response_format and response_format.get("type", "text") != "text":
            raise ValueError("only type 'text' is supported (no structured output: json_object, json_schema)")
        return response_format

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
