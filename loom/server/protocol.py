"""OpenAI request schemas (pydantic). Unknown fields are ignored; known fields of the wrong type are a 400, and so are
OpenAI fields whose meaning Loom cannot honour (`suffix`, `best_of` other than `n`), rather than an answer that
quietly ignores them.

Structured outputs come in three dialects, one per request: OpenAI's `response_format` (`json_object`, or
`json_schema` with its `schema`), vLLM's `structured_outputs` object, and llama.cpp's `json_schema` and `grammar`; a
required or named `tool_choice` is one more (loom/server/tools.py)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from loom.sampling import SamplingParams, StructuredOutputParams
from loom.server.tools import forced_call_constraint

Number = Annotated[float, Field(strict=True)] | StrictInt
TokenIds = list[StrictInt]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's: plain text, any JSON object, or JSON that follows a schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object with its schema")
        return self

    def structured_outputs(self) -> StructuredOutputParams | None:
        if self.type == "json_object":
            return StructuredOutputParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputParams(json=self.json_schema.schema_)
        return None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs`. A key Loom does not know (say `structural_tag`) is a 400, never ignored."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | StrictStr | None = Field(default=None, alias="json")
    json_object: StrictBool = False
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    disable_any_whitespace: StrictBool = False

    def params(self) -> StructuredOutputParams:
        return StructuredOutputParams(**self.model_dump(by_alias=True))


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    min_tokens: StrictInt = 0  # vLLM's extra field
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    logit_bias: dict[StrictStr, Number] | None = None  # JSON object keys: token ids as strings
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    n: StrictInt = Field(default=1, ge=1, le=16)
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False  # vLLM's extra field
    skip_special_tokens: StrictBool = True  # vLLM's extra field
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's extra field
    bad_words: list[StrictStr] | None = None  # vLLM's extra field
    truncate_prompt_tokens: StrictInt | None = None  # vLLM's extra field
    priority: StrictInt = Field(default=0, ge=-(2**31), le=2**31 - 1)  # vLLM's extra field: lower runs first
    user: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None  # vLLM's extra field
    json_schema: dict | None = None  # llama.cpp's extra field
    grammar: StrictStr | None = None  # llama.cpp's extra field: GBNF (or Lark)

    def _constraints(self) -> dict[str, StructuredOutputParams | None]:
        """Each field that can constrain the output, with its constraint (None where it sets none)."""
        return {
            "response_format": self.response_format.structured_outputs() if self.response_format else None,
            "structured_outputs": self.structured_outputs.params() if self.structured_outputs else None,
            "json_schema": StructuredOutputParams(json=self.json_schema) if self.json_schema is not None else None,
            "grammar": StructuredOutputParams(grammar=self.grammar) if self.grammar is not None else None,
        }

    def structured_output_params(self) -> StructuredOutputParams | None:
        """The one constraint on the output that the request names, in whichever dialect; ValueError for two."""
        given = {name: params for name, params in self._constraints().items() if params is not None}
        if len(given) > 1:
            raise ValueError(f"give at most one of response_format (JSON), structured_outputs, json_schema, grammar "
                             f"and a forced tool_choice, got {sorted(given)}")
        return next(iter(given.values()), None)

    def logit_bias_by_token(self) -> dict[int, float]:
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r:.40}") from None
        return bias

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        seed_offset: int = 0) -> SamplingParams:
        """Raises ValueError naming the field for out-of-range values."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=None if self.seed is None else self.seed + seed_offset,
            stop=stop,
            stop_token_ids=self.stop_token_ids or [],
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=self.logit_bias_by_token(),
            structured_outputs=self.structured_output_params(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or [],
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("not supported: the model has no fill-in-the-middle mode")
        return value

    @model_validator(mode="after")
    def _best_of_is_n(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of other than n is not supported (n={self.n}, best_of={self.best_of}): ask for n "
                             f"samples and rank them yourself")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_template_dict(self) -> dict:
        """Arguments as a JSON object where they parse, as transformers' tool templates expect them (vLLM does so)."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        call = {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}
        return call if self.id is None else {"id": self.id, **call}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool's answer: the call it answers

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.as_template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON schema for the arguments object
    strict: StrictBool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class _ChatTemplateFields(BaseModel):
    """vLLM's: a chat template for this request alone (only where the server trusts request templates), and more
    variables for the template (say {"enable_thinking": false})."""

    chat_template: StrictStr | None = None
    chat_template_kwargs: dict | None = None


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # vLLM's extra field: the model carries the last message on
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> "ChatCompletionRequest":
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: function names must differ, got {names}")
        if self.forces_tool_call and not names:
            raise ValueError("tool_choice: a required or named tool call needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool is named {self.tool_choice.function.name!r} (tools: {names})")
        return self

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def tool_dicts(self) -> list[dict] | None:
        return None if self.tools is None else [tool.model_dump(exclude_none=True) for tool in self.tools]

    def tool_choice_value(self) -> str | dict | None:
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    def _constraints(self) -> dict[str, StructuredOutputParams | None]:
        forced = (forced_call_constraint(self.tool_dicts(), self.tool_choice_value(), self.parallel_tool_calls)
                  if self.forces_tool_call else None)
        return {**super()._constraints(), "tool_choice": forced}


class TokenizeRequest(_ChatTemplateFields):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True  # for messages, as in a chat request
    continue_final_message: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[StrictInt]
