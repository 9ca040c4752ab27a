"""Tool calls in a chat output: how they are written, constrained and found.

The model writes a call as the zoo's chat template (Hermes') shows it:
``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``. A request whose ``tool_choice`` is
"required" or names a function is held to a grammar of such calls, each call's arguments to its
function's parameter schema, so the answer always parses; with "auto" the output is read as it
comes (``ToolCallReader``): text before a call is content, each complete call becomes an OpenAI
``tool_calls`` entry, and a block that does not parse stays text, as vLLM's Hermes parser does.
"""

from __future__ import annotations

import json
import uuid

from ..engine.structured import JSON_OPTIONS
from .protocol import Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tool_calls_grammar(tools: list[Tool], parallel: bool) -> str:
    """A Lark grammar (llguidance's, with inline JSON schemas) of one call, or with ``parallel``
    one or more, each to one of ``tools`` with arguments valid for its parameters."""
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": tool.function.name},
                                                         "arguments": tool.function.parameters},
                         "required": ["name", "arguments"], "additionalProperties": False} for tool in tools],
              "x-guidance": JSON_OPTIONS}  # compact, as structured outputs
    return (f"start: call{'+' if parallel else ''}\n"
            f"call: {json.dumps(OPEN)} %json {json.dumps(schema)} {json.dumps(CLOSE)}\n")


class ToolCallReader:
    """Splits an output's text, fed as it grows, into content and tool calls of ``tools``."""

    def __init__(self, tools: list[Tool]) -> None:
        self.names = {tool.function.name for tool in tools}
        self.pending = ""  # text not yet known to be content or a call
        self.in_call = False
        self.after_call = False  # the last thing read was a call
        self.calls: list[dict] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """Add ``text``; returns the content now known to be content and the calls completed by it
        (``final``: the output has ended, nothing is held back)."""
        self.pending += text
        content, calls = "", []
        while True:
            if not self.in_call:
                if self.after_call:  # whitespace after a call is not content
                    self.pending = self.pending.lstrip()
                    if not self.pending:
                        break
                    self.after_call = False
                start = self.pending.find(OPEN)
                if start < 0:
                    keep = 0 if final else _partial(self.pending, OPEN)
                    content += self.pending[: len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                content += self.pending[:start]
                self.pending, self.in_call = self.pending[start:], True
            end = self.pending.find(CLOSE)
            if end < 0:
                if final:  # an unfinished call is text
                    content, self.pending = content + self.pending, ""
                break
            block, self.pending = self.pending[: end + len(CLOSE)], self.pending[end + len(CLOSE):]
            self.in_call = False
            call = self._parsed(block[len(OPEN): -len(CLOSE)])
            if call is None:
                content += block
            else:
                calls.append(call)
                self.after_call = True
        self.calls += calls
        return content, calls

    def _parsed(self, body: str) -> dict | None:
        """An OpenAI tool call from a block's JSON, or None if it names no tool or does not parse."""
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names or not isinstance(
                value.get("arguments"), dict):
            return None
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": value["name"], "arguments": json.dumps(value["arguments"])}}


def _partial(text: str, marker: str) -> int:
    """The longest end of ``text`` that is a proper beginning of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
