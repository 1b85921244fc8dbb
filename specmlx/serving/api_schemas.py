"""The server's request bodies: what each endpoint accepts, validated by pydantic before a
route runs (a bad field is a 400 naming it; see api_errors).

OpenAI's /v1/completions and /v1/chat/completions share ``SamplingBody``; llama.cpp's
/completion and /infill share ``LlamaBody``. Every string in a body must be valid Unicode.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from .api_errors import ApiError

MAX_STOPS = 4  # as OpenAI allows
MAX_COMPLETIONS = 8  # llama.cpp's n_cmpl, generated one after another

# Numbers and flags are strict: pydantic's lax mode would read "max_tokens": true as one
# token, "stream": "yes" as a stream and "temperature": "0.5" as 0.5, where OpenAI's API
# answers a 400. JSON's own ints and floats (what the openai client and the editor plugins
# send) pass: a strict float takes an int too.
Positive = Annotated[int, Field(gt=0, strict=True)]
Count = Annotated[int, Field(ge=0, strict=True)]
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Temperature = Annotated[float, Field(ge=0, strict=True, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, strict=True)]
MinP = Annotated[float, Field(ge=0, lt=1, strict=True)]

# llama.cpp's clients send -1 for "random"; anything else must fit the 64-bit seed MLX takes
Seed = Annotated[int, Field(ge=-1, le=2**64 - 1, strict=True)]


def _no_lone_surrogates(value: Any, where: str = "body") -> None:
    """Refuse text that is not valid Unicode (a lone UTF-16 surrogate such as "\\ud800",
    which JSON can carry and no tokenizer can encode), wherever it sits in a request.

    value: what to check (a model, a str, or JSON's lists and dicts, nested as deep as a
    client likes); where: the field it came from, named in the error.

    The walk keeps its own stack: a client may nest a body deeper than Python's recursion
    limit (a 950-deep ``stream_options``), which a recursive walk answered with a 500."""
    stack = [(value, where)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                msg = f"{where} holds a lone surrogate at character {e.start}"
                raise ValueError(msg) from None
        elif isinstance(value, BaseModel):
            items = [(getattr(value, name), name) for name in type(value).model_fields]
            stack += reversed(items)  # reversed: the first one in the body is named first
        elif isinstance(value, (list, tuple, dict)):
            items = value.values() if isinstance(value, dict) else value
            stack += reversed([(item, where) for item in items])


class _Text(BaseModel):
    """A request body whose every string must be valid Unicode (else a 400)."""

    @model_validator(mode="after")
    def _valid_text(self):
        _no_lone_surrogates(self)
        return self


class SamplingBody(_Text):
    """The fields every generating endpoint shares (unknown fields are ignored, as clients
    send many; fields that would change the output and are not supported are refused)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Positive | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Count | None = None
    min_p: MinP | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None  # -1 or None: random
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    n: StrictInt = 1
    logprobs: bool | int | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict[str, float] | None = None
    # specmlx extensions
    draft: Literal["model", "lookup", "none"] | None = None
    num_draft: Annotated[int, Field(ge=0)] | Literal["auto"] | None = None
    verify: str | None = None  # "block" or "token" (checked where the engine checks it)
    return_tokens: StrictBool = False  # token ids in each chunk (specmlx run --server uses it)

    def refuse_unsupported(self) -> None:
        """A 400 (ApiError) for a field this server accepts but cannot honour."""
        if self.n != 1:
            raise ApiError(400, "n must be 1: one completion per request", code="unsupported")
        if self.logprobs not in (None, False, 0):
            raise ApiError(400, "logprobs are not supported", code="unsupported")
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise ApiError(
                400,
                "presence/frequency penalties and logit_bias are not supported: they would "
                "change the target's distribution",
                code="unsupported",
            )

    def stops(self) -> list[str]:
        """The stop strings, empty ones dropped; a 400 past MAX_STOPS."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        return [s for s in stops if s]


class CompletionBody(SamplingBody):
    """OpenAI's /v1/completions (``suffix``: fill in the middle)."""

    prompt: str
    suffix: str | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None


class Message(BaseModel):
    """One chat message: its text, or a list of text parts."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _has_content(self):
        # OpenAI's API lets only an assistant message (one that made tool calls) go without
        # content; a user message with none was answered as if it were empty
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        """The message's text; a 400 (ApiError) for a part that is not text."""
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content):
                raise ApiError(400, "only text message content is supported")
            if not all(isinstance(p, str) for p in parts):  # (JSON lets it be anything)
                raise ApiError(400, "a text part's text must be a string")
            return "".join(parts)
        return self.content or ""


class ChatBody(SamplingBody):
    """OpenAI's /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Positive | None = None
    # llama-server's own fields, which llama.vim's instruct mode sends: n_predict wins over
    # max_tokens (0: a warm-up, the prompt cache filled and nothing generated; < 0: the
    # default); response_fields is accepted and, as there, leaves OpenAI's answer whole
    n_predict: StrictInt | None = None
    response_fields: list[str] | None = None


class ExtraChunk(BaseModel):
    """One of /infill's input_extra: another file's text, for context."""

    model_config = ConfigDict(extra="ignore")
    filename: str = ""
    text: str = ""


class LlamaBody(_Text):
    """The fields llama.cpp's /completion and /infill share (other fields ignored)."""

    model_config = ConfigDict(extra="ignore")

    n_predict: StrictInt = -1  # < 0: the server's default; 0: a warm-up, prefill only
    temperature: Temperature | None = None
    top_k: Count | None = None
    top_p: TopP | None = None
    min_p: MinP | None = None
    stop: list[str] = []
    seed: Seed = -1  # -1: random
    stream: StrictBool = False
    # llama.cpp's editor limits: stop once this long has passed after the first token and a
    # line is done; stop at a line indented less (both finish as "limit"); <= 0: none
    t_max_predict_ms: Number = 0
    n_indent: StrictInt = 0
    # return just these fields, nested ones flattened as "timings/prompt_n" (llama.vim)
    response_fields: list[str] | None = None
    # false: prefill the prompt afresh, not from the prompt cache (what it leaves is kept)
    cache_prompt: StrictBool = True
    # completions, one after another
    n_cmpl: Annotated[int, Field(ge=1, le=MAX_COMPLETIONS, strict=True)] = 1

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: list[str]) -> list[str]:
        # more than the engine checks cheaply each token: said, never dropped in silence
        if len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stop)}")
        return stop


class InfillBody(LlamaBody):
    """llama.cpp's /infill, as llama.vscode and llama.vim send it."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = []
    prompt: str = ""


class LlamaCompletionBody(LlamaBody):
    """llama.cpp's native /completion (Continue's and Tabby's llama.cpp providers): a text
    prompt or its token ids."""

    prompt: str | list[Count]
    # tokens kept from the prompt's start when it is cut to fit the context (-1: all it can)
    n_keep: Annotated[int, Field(ge=-1, strict=True)] = 0
