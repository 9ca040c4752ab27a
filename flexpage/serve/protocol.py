"""The OpenAI API's request and response bodies (the fields real clients send and read).

A null for a field is its default, as OpenAI and vLLM take it (the openai client sends options it
was given as None). Fields are checked here, and what only the engine can judge (prompt length,
token ids, grammars) when the request is submitted. Fields the server does not implement — known
ones (images, echo, ...) and unknown ones (vLLM's ``min_p``, typos) — are refused with a 400 naming
the field, never silently dropped; only fields that ask nothing of the output (``INFORMATIONAL``)
are accepted and ignored. Structured outputs come as OpenAI's ``response_format`` or vLLM's
``structured_outputs`` (and its older ``guided_*`` fields); tools as OpenAI's ``tools`` and
``tool_choice``.
"""

from __future__ import annotations

import json
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
INFORMATIONAL = frozenset({"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"})
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


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


class Strict(BaseModel):
    """A nested object of the API: a field it does not know is refused (pydantic names it)."""

    model_config = ConfigDict(extra="forbid")


class JSONSchemaFormat(Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    json_schema: dict | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs``: one of these."""

    json_value: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        if len(self.given()) != 1:
            raise ValueError("takes exactly one of json, regex, choice, grammar, json_object")
        return self

    def given(self) -> dict[str, Any]:
        """Grammar kind -> spec of what is given (None: no spec)."""
        fields = (("json_schema", self.json_value), ("regex", self.regex), ("choice", self.choice),
                  ("grammar", self.grammar))
        found = {kind: value for kind, value in fields if value is not None}
        return found | ({"json_object": None} if self.json_object else {})


# vLLM's older structured-output fields, each the grammar kind it gives
GRAMMAR_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


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
    response_format: ResponseFormat | None = None  # OpenAI's (chat); vLLM takes it for completions too
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    guided_json: dict | str | None = None  # vLLM's older fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check(self) -> SamplingRequest:
        if self.top_k is not None and self.top_k != -1 and self.top_k < 1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if len(self.constraints()) > 1:
            raise ValueError(f"at most one structured output per request, got {', '.join(self.constraints())}")
        return self

    def constraints(self) -> dict[str, tuple[str, Any]]:
        """Each structured output the request asks for: field name -> (grammar kind, spec)."""
        found = {}
        if self.response_format is not None and self.response_format.type != "text":
            schema = self.response_format.json_schema
            found["response_format"] = (("json_schema", schema.json_schema) if schema is not None
                                         else ("json_object", None))
        if self.structured_outputs is not None:
            (found["structured_outputs"],) = self.structured_outputs.given().items()
        for name, kind in GRAMMAR_FIELDS.items():
            if getattr(self, name) is not None:
                found[name] = (kind, getattr(self, name))
        return found

    def grammar_spec(self) -> tuple[str, str, Any] | None:
        """(field, grammar kind, spec) of the request's structured output, if it asks for one."""
        return next(((name, *spec) for name, spec in self.constraints().items()), None)

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


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as the API sends it


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

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

    def text(self) -> str:
        """The message's text (its text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates take it (a call's arguments as a JSON object where they parse)."""
        message = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _json_or_text(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})  # a JSON schema
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True
    functions: list | None = None
    function_call: str | dict | None = None

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, value: Any) -> Any:
        if value:
            raise ValueError("the deprecated functions and function_call are not supported: use tools and tool_choice")
        return value

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError("tools: each function needs a name of its own")
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        if self.calls_forced and self.constraints():
            raise ValueError("a forced tool call (tool_choice 'required' or named) takes no other structured output")
        return self

    @property
    def tool_mode(self) -> str:
        """How the output may call tools: "none", "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def calls_forced(self) -> bool:
        return self.tool_mode in ("required", "named")

    def callable_tools(self) -> list[Tool]:
        """The tools the output may call: the named one, or all."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        return list(self.tools or [])

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
