"""Request bodies of the OpenAI-compatible API (vLLM's fields), as pydantic models.

A wrong type is a 400 naming the field (``errors.install_handlers``); ranges are checked where the
``SamplingParams`` are built, by ``SamplingParams`` itself, so the server and ``mlaq.LLM`` reject
the same values with the same words. Unknown fields are ignored, as vLLM does. Responses are plain
dicts built in ``completions`` / ``chat``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

INT64 = (-(2**63), 2**63 - 1)  # vLLM's seed range (a C long long)
# the renderer sets these itself; a chat_template_kwargs copy would collide with them
TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token")
# OpenAI / vLLM fields for features mlaq serve does not implement: refused by name (as vLLM refuses
# an unsupported feature), never silently ignored
UNSUPPORTED = (
    "tools",
    "functions",
    "function_call",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
    "guided_decoding_backend",
    "logits_processors",
)


def unicode_text(value: Any, where: str = "") -> Any:
    """``value`` unchanged, or a ValueError when a string in it holds a lone surrogate (JSON's
    ``"\\ud800"``): such text has no UTF-8 form, so no tokenizer can read it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            char = value[exc.start]
            raise ValueError(
                f"{where}holds a lone surrogate (U+{ord(char):04X}), which is not Unicode text; send valid "
                "UTF-8 (pair high and low surrogates)"
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            unicode_text(k, where)
            unicode_text(v, f"{where}{k}: " if isinstance(k, str) else where)
    elif isinstance(value, list | tuple):
        for v in value:
            unicode_text(v, where)
    return value


Text = Annotated[StrictStr, AfterValidator(unicode_text)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions. Numbers must be finite (Python's JSON reads
    ``Infinity`` and ``NaN``)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: Text | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    seed: Annotated[StrictInt, Field(ge=INT64[0], le=INT64[1])] | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    prompt_logprobs: StrictInt | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    user: Text | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None
    logits_processors: Any = None

    def unsupported_field(self) -> str | None:
        """The first field asking for a feature mlaq serve does not implement (``params.unsupported``
        refuses it by name); an empty list, ``tool_choice: "none"`` and ``response_format: {"type":
        "text"}`` ask for nothing."""
        for name in UNSUPPORTED:
            value = getattr(self, name)
            if value is None or value == [] or (name == "response_format" and value == {"type": "text"}):
                continue
            return name
        return None if self.tool_choice in (None, "none") else "tool_choice"


PromptField = Text | list[Text] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_Sampling):
    prompt: PromptField
    max_tokens: StrictInt | None = 16  # OpenAI's legacy default
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: Text | None = None
    best_of: StrictInt | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Text
    content: Text | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _unicode(self) -> ChatMessage:
        if isinstance(self.content, list):
            unicode_text(self.content, "content: ")
        unicode_text(self.model_extra or {})
        return self


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None  # None: up to max_model_len
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = [k for k in TEMPLATE_VARIABLES if k in (value or {})]
        if taken:
            raise ValueError(
                f"may not set {', '.join(taken)}: the request's own fields give the template those"
            )
        return unicode_text(value)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    tokens: list[StrictInt]
