"""Forced tool calls (`tool_choice` "required" or a named function), made as vLLM makes them: structured outputs hold
the reply to the tools' JSON schemas, and the reply is read back into OpenAI's `tool_calls`.

"auto" is not parsed: a model's own tool-call syntax differs from model to model, so it answers in text."""

from __future__ import annotations

import copy
import json
import uuid

from loom.sampling import StructuredOutputParams

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _parameters(tool: dict) -> dict:
    return copy.deepcopy(tool["function"].get("parameters") or EMPTY_PARAMETERS)


def forced_call_constraint(tools: list[dict], choice: str | dict, parallel: bool) -> StructuredOutputParams | None:
    """The constraint for a reply that must call a tool: the named function's parameters as a JSON object, or for
    "required" a JSON array of {"name", "parameters"} calls (one at most unless `parallel`). None for "auto"/"none".
    Each tool's `$defs` move to the array's top, where its `#/$defs/...` references then point."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        return StructuredOutputParams(json=next(_parameters(t) for t in tools if t["function"]["name"] == name))
    if choice != "required":
        return None
    calls, defs = [], {}
    for tool in tools:
        parameters = _parameters(tool)
        for key, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, schema) != schema:
                raise ValueError(f"tools: two tools define $defs/{key} differently")
        calls.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return StructuredOutputParams(json=schema)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str) -> dict:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_calls_in_reply(text: str, choice: str | dict) -> list[dict] | None:
    """OpenAI's `tool_calls` for a forced call's reply. A named call's arguments are the reply as it stands, as a
    stream sent them; a "required" reply cut short by max_tokens is not a list of calls, so None."""
    if isinstance(choice, dict):  # the reply is the arguments, as far as they got
        return [_call(choice["function"]["name"], text)]
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    # The grammar makes a whole reply a list of calls; a stop string could still have cut it to other JSON.
    if not isinstance(calls, list) or not calls or not all(isinstance(c, dict) and {"name", "parameters"} <= c.keys()
                                                           for c in calls):
        return None
    return [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
