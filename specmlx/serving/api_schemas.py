"""The server's request bodies: what each endpoint accepts, validated by pydantic before a
route runs (a bad field is a 400 naming it; see api_errors).

OpenAI's /v1/completions and /v1/chat/completions share ``SamplingBody``; llama.cpp's
/completion and /infill share ``LlamaBody``. Every string in a body must be valid Unicode.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .api_errors import ApiError

MAX_STOPS = 4  # as OpenAI allows
MAX_COMPLETIONS = 8  # llama.cpp's n_cmpl, generated one after another

Positive = Annotated[int, Field(gt=0)]


# llama.cpp's clients send -1 for "random"; anything else must fit the 64-bit seed MLX takes
Seed = Annotated[int, Field(ge=-1, le=2**64 - 1)]


def _no_lone_surrogates(value: Any, where: str = "body") -> None:
    """Refuse text that is not valid Unicode (a lone UTF-16 surrogate such as "\\ud800",
    which JSON can carry and no tokenizer can encode), wherever it sits in a request."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where} holds a lone surrogate at character {e.start}") from None
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            _no_lone_surrogates(getattr(value, name), name)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _no_lone_surrogates(item, where)
    elif isinstance(value, dict):
        for item in value.values():
            _no_lone_surrogates(item, where)


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
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, lt=1)] | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None  # -1 or None: random
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # specmlx extensions
    draft: Literal["model", "lookup", "none"] | None = None
    num_draft: Annotated[int, Field(ge=0)] | Literal["auto"] | None = None
    verify: str | None = None  # "block" or "token" (checked where the engine checks it)
    return_tokens: bool = False  # token ids in each chunk (specmlx run --server uses it)

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
    echo: bool = False
    best_of: int | None = None


class Message(BaseModel):
    """One chat message: its text, or a list of text parts."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text; a 400 (ApiError) for a part that is not text."""
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content):
                raise ApiError(400, "only text message content is supported")
            return "".join(parts)
        return self.content or ""


class ChatBody(SamplingBody):
    """OpenAI's /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Positive | None = None


class ExtraChunk(BaseModel):
    """One of /infill's input_extra: another file's text, for context."""

    model_config = ConfigDict(extra="ignore")
    filename: str = ""
    text: str = ""


class LlamaBody(_Text):
    """The fields llama.cpp's /completion and /infill share (other fields ignored)."""

    model_config = ConfigDict(extra="ignore")

    n_predict: int = -1  # < 0: the server's default; 0: a warm-up, prefill only
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    min_p: Annotated[float, Field(ge=0, lt=1)] | None = None
    stop: list[str] = []
    seed: Seed = -1  # -1: random
    stream: bool = False
    # llama.cpp's editor limits: stop once this long has passed after the first token and a
    # line is done; stop at a line indented less (both finish as "limit"); <= 0: none
    t_max_predict_ms: float = 0
    n_indent: int = 0
    # return just these fields, nested ones flattened as "timings/prompt_n" (llama.vim)
    response_fields: list[str] | None = None
    n_cmpl: Annotated[int, Field(ge=1, le=MAX_COMPLETIONS)] = 1  # completions, one after another

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

    prompt: str | list[Annotated[int, Field(ge=0)]]
