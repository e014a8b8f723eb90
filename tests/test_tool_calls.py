"""Forced tool calls through the chat API (`tool_choice` "required" or named), read back into OpenAI's tool_calls,
streamed or not; tools and earlier calls reach the chat template as transformers gives them."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest
from test_server import _client, running_server

from loom import LLM, SamplingParams, StructuredOutputParams

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}},
                                       "required": ["zone"], "additionalProperties": False,
                                       "$defs": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris? Use the get_weather tool."}]


@pytest.fixture(scope="module")
def smol(smollm2):
    with running_server(smollm2) as s:
        yield s


def test_a_named_call_holds_the_reply_to_its_parameters(smol, smollm2):
    base, _ = smol
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = _client(base).chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME],
                                                 tool_choice=choice, max_tokens=48, temperature=0)
    message = resp.choices[0].message
    assert message.content is None and resp.choices[0].finish_reason == "stop"
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    # The reply is the output that the parameters' schema gives offline, on the prompt the template renders.
    prompt = smollm2.tokenizer.apply_chat_template(MESSAGES, tools=[WEATHER, TIME])
    offline = LLM(dtype="float32", loaded=smollm2).generate(prompt, SamplingParams(
        max_tokens=48, temperature=0, structured_outputs=StructuredOutputParams(json=WEATHER["function"]["parameters"])))
    assert call.function.arguments == offline[0].text

    streamed = list(_client(base).chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME],
                                                          tool_choice=choice, max_tokens=48, temperature=0,
                                                          stream=True))
    deltas = [d for chunk in streamed for d in chunk.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and all(d.index == 0 for d in deltas)
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_required_call_picks_among_the_tools(smol):
    base, _ = smol
    client = _client(base)
    kwargs = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", max_tokens=96,
                  temperature=0)
    resp = client.chat.completions.create(**kwargs)
    assert resp.choices[0].finish_reason == "tool_calls" and resp.choices[0].message.content is None
    calls = resp.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    for c in calls:
        arguments = json.loads(c.function.arguments)
        assert set(arguments) == ({"city", "unit"} if c.function.name == "get_weather" else {"zone"})
        assert c.function.name == "get_weather" or arguments["zone"] in ("UTC", "CET")  # $defs moved to the top
    one = client.chat.completions.create(**kwargs, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [d for chunk in chunks for d in chunk.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in streamed] == \
        [(k, c.function.name, c.function.arguments) for k, c in enumerate(calls)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    cut = client.chat.completions.create(**{**kwargs, "max_tokens": 3})  # not a list of calls yet: text, "length"
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
    assert cut.choices[0].message.content


def test_a_conversation_with_earlier_calls_and_their_answers(smol):
    base, _ = smol
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "tools": [WEATHER], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("body, needle", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": [WEATHER, WEATHER]}, "differ"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "at most one"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "objectx"),
])
def test_bad_tool_requests_get_400(smol, body, needle):
    base, _ = smol
    r = httpx.post(base + "/v1/chat/completions", timeout=60, json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


TOOL_TEMPLATE = """{%- if tools %}<|im_start|>system
Functions:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{%- if message.tool_calls %}{% for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}{% else %}
{{ message.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_tools_and_earlier_calls_render_as_transformers_renders_them(smollm2, hf_smollm2):
    """Arguments reach the template as objects and `tojson` writes plain JSON ("<", "é" as they are)."""
    from loom.server.protocol import ChatMessage

    _, hf_tok = hf_smollm2
    tool = {"type": "function", "function": {"name": "échelle", "description": "a <b> tag",
                                             "parameters": {"type": "object", "properties": {}}}}
    messages = [ChatMessage(role="user", content="hi"),
                ChatMessage(role="assistant", tool_calls=[{"id": "c", "function": {"name": "échelle",
                                                                                  "arguments": '{"x": 1}'}}]),
                ChatMessage(role="tool", tool_call_id="c", content="2")]
    dicts = [m.as_template_dict() for m in messages]
    tok = dataclasses.replace(smollm2.tokenizer, chat_template=TOOL_TEMPLATE)
    ours = tok.apply_chat_template(dicts, tools=[tool])
    assert ours == hf_tok.apply_chat_template(dicts, tools=[tool], chat_template=TOOL_TEMPLATE, tokenize=False,
                                              add_generation_prompt=True)
    assert '"description": "a <b> tag"' in ours and '"arguments": {"x": 1}' in ours


def test_replies_that_are_not_whole_lists_of_calls_are_not_read_as_calls():
    from loom.server.tools import forced_call_constraint, tool_calls_in_reply

    assert [c["function"] for c in tool_calls_in_reply('[{"name": "f", "parameters": {"é": 1}}]', "required")] == \
        [{"name": "f", "arguments": '{"é": 1}'}]
    for cut in ('[{"name": "f", "param', "[]", '{"name": "f"}', '[{"name": "f"}]', "[1]"):  # a stop string's cuts
        assert tool_calls_in_reply(cut, "required") is None
    other_zone = {"type": "function", "function": {"name": "g", "parameters": {"$defs": {"zone": {"type": "integer"}}}}}
    with pytest.raises(ValueError, match="zone"):
        forced_call_constraint([TIME, other_zone], "required", parallel=True)
