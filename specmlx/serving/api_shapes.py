"""The server's response shapes: OpenAI's completions (whole and as chunks), their usage,
llama.cpp's /completion and /infill answers, the speculative statistics every response
carries under "specmlx", and server-sent events. Pure functions of figures already known:
no I/O, no worker.
"""

from __future__ import annotations

import json

from ..core.acceptance import DEFAULT_VERIFY
from ..core.stats import Stats, TokenEvent
from .jobs import Job


def usage(stats: Stats) -> dict:
    """OpenAI's usage of a finished generation.

    stats: the generation's figures."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated,
        "total_tokens": stats.prompt_tokens + stats.generated,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def spec_stats(stats: Stats, k_label: str, drafter: str = "", verify: str = DEFAULT_VERIFY) -> dict:
    """The speculative statistics every response carries, under "specmlx".

    stats: the generation's figures; k_label: the k setting as asked ("auto", "4");
    drafter: the draft's alias, "lookup" or "none"; verify: the acceptance rule of sampled
    rounds ("block" or "token")."""
    return {
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_pass": stats.tokens_per_pass,
        "target_passes": stats.rounds,
        "accept_hist": stats.accept_hist,
        "k": k_label,
        "drafter": drafter,
        "verify": verify,
        "last_k": stats.last.k if stats.last else 0,
        "cached_tokens": stats.cached_tokens,
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "decode_tps": stats.decode_tps,
        "draft_s": stats.draft_s,
        "target_s": stats.target_s,
        "timed_rounds": stats.timed_rounds,
        "peak_memory": stats.peak_memory,
    }


def job_stats(stats: Stats, job: Job) -> dict:
    """``spec_stats`` of a worker's job: its k, drafter and rule as the worker ran them.

    stats: the job's figures; job: the job."""
    return spec_stats(stats, job.k_label, job.drafter_name, job.request.verify)


def sse(data: dict | str) -> str:
    """One server-sent event: ``data`` as JSON (a str, such as "[DONE]", as it is)."""
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


def completion(
    base: dict, chat: bool, content: str, stats: Stats, job: Job, tokens: list[int] | None
) -> dict:
    """OpenAI's whole (not streamed) completion or chat completion.

    base: the id, created and model fields; chat: a chat completion (else a text one);
    content: the generated text; stats: the generation's figures; job: the worker's job;
    tokens: the generated ids (the return_tokens extension), or None to leave them out."""
    choice = {"index": 0, "finish_reason": stats.finish_reason or "stop", "logprobs": None}
    choice |= {"message": {"role": "assistant", "content": content}} if chat else {"text": content}
    if tokens is not None:
        choice["token_ids"] = tokens
    kind = "chat.completion" if chat else "text_completion"
    out = base | {"object": kind, "choices": [choice], "usage": usage(stats)}
    return out | {"specmlx": job_stats(stats, job)}


def _chunk_kind(chat: bool) -> str:
    return "chat.completion.chunk" if chat else "text_completion"


def chunk(
    base: dict, chat: bool, text: str | None, finish: str | None, piece: TokenEvent | None = None
) -> dict:
    """One of OpenAI's streamed chunks.

    base: the id, created and model fields; chat: a chat chunk (a delta) or a text one;
    text: the new text (None: a chat chunk with an empty delta); finish: the finish reason
    of the last chunk, else None; piece: the token event, to carry its id and whether the
    draft proposed it (the return_tokens extension), or None."""
    if chat:
        delta = {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    if piece is not None and piece.token is not None:  # the return_tokens extension
        choice["token_ids"], choice["token_from_draft"] = [piece.token], [piece.from_draft]
    return base | {"object": _chunk_kind(chat), "choices": [choice]}


def role_chunk(base: dict) -> dict:
    """The first chunk of a streamed chat completion: the assistant's role, no text yet.

    base: the id, created and model fields."""
    first = chunk(base, True, "", None)
    first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    return first


def usage_chunk(base: dict, chat: bool, stats: Stats) -> dict:
    """The chunk after the last one that carries the usage (stream_options.include_usage).

    base: the id, created and model fields; chat: a chat stream; stats: the figures."""
    return base | {"object": _chunk_kind(chat), "choices": [], "usage": usage(stats)}


def generation_settings(model: str, context: int, max_tokens: int) -> dict:
    """llama.cpp's generation_settings, as far as specmlx has them.

    model: the model's id; context: the context size in tokens; max_tokens: the budget."""
    return {"n_ctx": context, "n_predict": max_tokens, "model": model}


def llama_completion(
    content: str, stats: Stats, job: Job, settings: dict | None, truncated: bool = False
) -> dict:
    """llama.cpp's /completion (and /infill) answer: content, stop, tokens, timings.

    content: the generated text (empty in a stream's last event); stats: the figures;
    job: the worker's job; settings: the generation_settings to report (None: {});
    truncated: whether the prompt was cut to fit the context."""
    stop_type = {"length": "limit", "limit": "limit", "stop": "eos"}.get(
        stats.finish_reason or "", "eos"
    )
    prompt_n = stats.prompt_tokens - stats.cached_tokens
    return {
        "content": content,
        "stop": True,
        "stop_type": stop_type,
        "tokens_predicted": stats.generated,
        "tokens_evaluated": stats.prompt_tokens,
        "tokens_cached": stats.cached_tokens,
        "truncated": truncated,
        "timings": {
            "prompt_n": prompt_n,
            "prompt_ms": stats.prefill_s * 1000,
            "prompt_per_token_ms": stats.prefill_s * 1000 / prompt_n if prompt_n else 0.0,
            "prompt_per_second": stats.prompt_tps,
            "predicted_n": stats.generated,
            "predicted_ms": stats.decode_s * 1000,
            "predicted_per_token_ms": (
                stats.decode_s * 1000 / stats.generated if stats.generated else 0.0
            ),
            "predicted_per_second": stats.decode_tps,
            "draft_n": stats.drafted,
            "draft_n_accepted": stats.accepted,
        },
        "generation_settings": settings or {},
        "specmlx": job_stats(stats, job),
    }


def pick_fields(out: dict, fields: list[str]) -> dict:
    """llama.cpp's response_fields: just these fields of ``out``; "a/b" is out["a"]["b"]
    under the key "a/b"; a field that is not there is left out.

    out: the whole answer; fields: the field names asked for."""
    picked = {}
    for name in fields:
        value = out
        for part in name.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            picked[name] = value
    return picked
