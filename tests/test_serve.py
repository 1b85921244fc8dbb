"""`specmlx serve` with the official openai client against real servers on 127.0.0.1 (tiny
random models; one test on the real SmolLM2 weights): the OpenAI shapes, the prompt cache,
bounded concurrency, disconnects, infill, the bad-request matrix, and `specmlx run --server`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from helpers import Server, free_port, tiny_pair
from kit_serve import local_json, server_env
from typer.testing import CliRunner

from specmlx.cli import app
from specmlx.cli.serve import allowed_hosts
from specmlx.drafting.choosing.choosers import K
from specmlx.errors import BadInput
from specmlx.models.footprint import parse_size
from specmlx.serving.guard import Guard, host_name
from specmlx.serving.worker import QueueFull, Worker

KEY = "sk-test-key"
CHAT = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CODE = "import os\nfor i in range(10):\n    print(i, os.getcwd())\n"


def models_toml(root: Path, fim: bool = True) -> Path:
    """Tiny target and draft (FIM tokens and a chat template unless fim=False)."""
    return tiny_pair(root, fim=fim, chat_template=CHAT)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module")
def server(root):
    s = Server(server_env(root, models_toml(root)), "--api-key", KEY, "--max-queue", "16")
    yield s
    code, err = s.stop()
    assert code == 0, err  # SIGTERM: finish or cancel, then exit 0
    assert "Traceback" not in err, err


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120, **kw)


# ------------------------------------------------------------------ the OpenAI shapes


def test_a_request_picks_its_verification_rule(root, client):
    sampled = {"temperature": 0.8, "seed": 4}
    for verify in ("token", "block"):
        got = client.completions.create(
            model="tiny-t", prompt=CODE, max_tokens=12, extra_body={"verify": verify, **sampled}
        )
        assert got.model_extra["specmlx"]["verify"] == verify
    default = client.completions.create(model="tiny-t", prompt=CODE, max_tokens=4)
    assert default.model_extra["specmlx"]["verify"] == "block"  # the server's default
    # greedy decoding is the same under both rules
    greedy = client.completions.create(
        model="tiny-t", prompt=CODE, max_tokens=16, extra_body={"verify": "block"}
    )
    assert greedy.choices[0].text == local_json(root, "-n", "16", CODE)["text"]


def test_completions_chat_and_streaming(client):
    done = client.completions.create(model="tiny-t", prompt=CODE, max_tokens=12)
    assert done.object == "text_completion" and done.id.startswith("cmpl-")
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 12
    assert done.usage.total_tokens == done.usage.prompt_tokens + 12
    assert done.model_extra["specmlx"]["target_passes"] >= 1
    chunks = list(
        client.completions.create(
            model="tiny-t", prompt=CODE, max_tokens=12, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    assert chunks[-2].choices[0].finish_reason == "length"
    msgs = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model="tiny-t", messages=msgs, max_tokens=8)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(
        model="tiny-t", messages=msgs, max_tokens=8, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    assert client.models.list().data[0].id == "tiny-t"


@pytest.mark.parametrize("draft", ["model", "lookup", "none"])
def test_greedy_text_through_the_server_equals_specmlx_run(root, client, draft):
    got = client.completions.create(
        model="tiny-t", prompt=CODE, max_tokens=20,
        extra_body={"draft": draft, "return_tokens": True},
    )  # fmt: skip
    ref = local_json(root, "-n", "20", "--draft", {"model": "tiny-d"}.get(draft, draft), CODE)
    assert got.choices[0].text == ref["text"]
    assert got.choices[0].model_extra["token_ids"] == ref["tokens"]


def test_the_prompt_cache_serves_a_shared_prefix_exactly(root, client):
    """The editor case: the same file, a line longer. The second request reuses the first
    one's KV caches (reported as cached tokens) and returns what a cold run returns."""
    first = CODE * 6
    client.completions.create(model="tiny-t", prompt=first, max_tokens=8)
    second = first + "def helper(x):\n"
    got = client.completions.create(
        model="tiny-t", prompt=second, max_tokens=16, extra_body={"return_tokens": True}
    )
    cached = got.usage.prompt_tokens_details.cached_tokens
    assert cached >= 0.8 * got.usage.prompt_tokens, got.usage
    assert got.model_extra["specmlx"]["cached_tokens"] == cached
    cold = local_json(root, "-n", "16", second)
    assert got.choices[0].model_extra["token_ids"] == cold["tokens"]


@pytest.mark.parametrize("seen", [True, False], ids=["served-before", "new"])
def test_chat_requests_running_at_once_share_their_system_prompts_cache(client, seen):
    """Three chats with one system prompt that run at once (two join a running stream):
    each starts from the system prompt's caches, whether an earlier request left them in
    the prompt cache (not only the first to ask gets them) or the running one holds them
    (the joiners copy its row); each text equals its own run after."""
    system = f"You answer in Python for the {'zeta' if seen else 'eta'} module.\n" * 8
    asks = ["sum the list", "sort it", "reverse the words"]

    def chat(q: str, **kw):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        return client.chat.completions.create(model="tiny-t", messages=messages, **kw)

    if seen:
        chat("hi", max_tokens=4)  # the system prompt's caches are now in the prompt cache
    got = [None, None]

    def join(i: int) -> None:
        got[i] = chat(asks[i + 1], max_tokens=24)

    long = chat(asks[0], max_tokens=300, stream=True, stream_options={"include_usage": True})
    joiners, parts, usage = [], [], None
    for chunk in long:
        parts.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
        usage = chunk.usage or usage
        if len(parts) == 2:  # the first one is decoding (it holds its copy): two join
            joiners = [threading.Thread(target=join, args=(i,)) for i in range(2)]
            for t in joiners:
                t.start()
    for t in joiners:
        t.join()
    for u in [usage] * seen + [g.usage for g in got]:
        assert u.prompt_tokens_details.cached_tokens >= 0.6 * u.prompt_tokens, u
    assert "".join(parts) == chat(asks[0], max_tokens=300).choices[0].message.content
    for q, g in zip(asks[1:], got, strict=True):
        assert g.choices[0].message.content == chat(q, max_tokens=24).choices[0].message.content


def streamed_together(client, prompts: list[str], max_tokens: int) -> list[str]:
    """Each prompt's streamed completion, all sent at once (one thread a prompt)."""

    def stream(p):
        parts = client.completions.create(model="tiny-t", prompt=p, max_tokens=max_tokens,
                                          stream=True)  # fmt: skip
        return "".join(c.choices[0].text for c in parts if c.choices)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(stream, prompts))


def test_eight_concurrent_streams_each_complete_and_unmixed(client):
    prompts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(8)]
    alone = [client.completions.create(model="tiny-t", prompt=p, max_tokens=24) for p in prompts]
    assert streamed_together(client, prompts, 24) == [a.choices[0].text for a in alone]


def test_requests_join_and_leave_a_running_batch_and_each_gets_its_solo_text(server, client):
    """A long stream runs; a short request joins it mid-generation and leaves before it
    ends; a third joins after. Each text is the one it gets alone, and the long stream was
    still going when the short one had its answer (they did decode together)."""
    asks = [(CODE * 2, 400), ("def g(y):\n", 6), ("class A:\n", 24)]
    alone = [client.completions.create(model="tiny-t", prompt=p, max_tokens=n).choices[0].text
             for p, n in asks]  # fmt: skip
    got, after_short = [None] * 3, []
    short_done = threading.Event()

    def later(i: int) -> None:
        p, n = asks[i]
        got[i] = client.completions.create(model="tiny-t", prompt=p, max_tokens=n).choices[0].text
        if i == 1:
            short_done.set()

    long = client.completions.create(model="tiny-t", prompt=asks[0][0], max_tokens=asks[0][1],
                                     stream=True, stream_options={"include_usage": True})  # fmt: skip
    parts, joiners, usage, finish = [], [], None, None
    for chunk in long:
        parts.append(chunk.choices[0].text if chunk.choices else "")
        usage = chunk.usage or usage
        finish = chunk.choices[0].finish_reason if chunk.choices else finish
        if len(parts) == 2:  # the long one is decoding: the short one joins
            joiners.append(threading.Thread(target=later, args=(1,)))
            joiners[-1].start()
        if short_done.is_set():
            after_short.append(chunk)
            if len(after_short) == 1:  # it left; a third joins
                joiners.append(threading.Thread(target=later, args=(2,)))
                joiners[-1].start()
    for t in joiners:
        t.join(60)
    got[0] = "".join(parts)
    assert got == alone
    assert after_short, "the long stream ended before the short request was answered"
    # one row throughout (alone, then beside others): its count goes on
    assert finish != "length" or usage.completion_tokens == asks[0][1], (finish, usage)
    fresh = client.completions.create(model="tiny-t", prompt=asks[0][0], max_tokens=1)
    assert usage.prompt_tokens == fresh.usage.prompt_tokens  # its prompt's, not a move's


def test_a_client_that_hangs_up_frees_the_slot(server, client):
    before = metrics(server)
    with httpx.stream(
        "POST", server.url + "/v1/completions", timeout=60,
        headers={"Authorization": f"Bearer {KEY}"},
        json={"prompt": CODE, "max_tokens": 1900, "stream": True, "draft": "none"},
    ) as r:  # fmt: skip
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # gone after one chunk: the generation is cancelled and the next request is served
    done = client.completions.create(model="tiny-t", prompt="x = 1", max_tokens=4)
    assert done.choices[0].finish_reason == "length"
    after = metrics(server)
    assert (
        after["specmlx_requests_cancelled_total"] == before["specmlx_requests_cancelled_total"] + 1
    )
    generated = after["specmlx_generated_tokens_total"] - before["specmlx_generated_tokens_total"]
    assert generated < 1900 + 4, generated  # the 1900 asked for were not all generated


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    rows = [ln.split() for ln in text.splitlines() if ln and not ln.startswith("#")]
    return {name: float(value) for name, value in rows}


def test_metrics_count_tokens_and_acceptance(server, client):
    client.completions.create(model="tiny-t", prompt=CODE * 2, max_tokens=16)
    m = metrics(server)
    for name in (
        "requests_total", "generated_tokens_total", "drafted_tokens_total", "acceptance_rate",
        "tokens_per_pass", "decode_tokens_per_second", "queue_depth", "prompt_cache_hits_total",
    ):  # fmt: skip
        assert f"specmlx_{name}" in m, name
    assert m["specmlx_requests_total"] >= 1 and m["specmlx_generated_tokens_total"] >= 16


def test_metrics_parse_as_prometheus_text_and_counters_move(server, client):
    from prometheus_client import CONTENT_TYPE_LATEST
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> tuple[httpx.Response, dict]:
        r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        families = {f.name: f for f in text_string_to_metric_families(r.text)}
        return r, families

    _, before = scrape()
    client.completions.create(model="tiny-t", prompt=CODE, max_tokens=8)
    r, after = scrape()
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE_LATEST
    requests = after["specmlx_requests"]  # the parser names a counter's family without _total
    assert requests.type == "counter" and requests.samples[0].name == "specmlx_requests_total"
    assert requests.samples[0].value == before["specmlx_requests"].samples[0].value + 1
    assert after["specmlx_queue_depth"].type == "gauge"
    # the prompt cache's figures, published by the worker's thread after the completion
    assert after["specmlx_prompt_cache_entries"].samples[0].value >= 1
    assert after["specmlx_prompt_cache_bytes"].samples[0].value > 0


# ------------------------------------------------------------------ fill in the middle


def test_infill_in_llama_cpp_shape_and_suffix_completions(root, server, client):
    body = {
        "input_prefix": "def add(a, b):\n", "input_suffix": "\n    return c\n",
        "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}],
        "n_predict": 12, "temperature": 0,
    }  # fmt: skip
    r = post(server, "/infill", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["stop"] is True and out["tokens_predicted"] <= 12 and "timings" in out
    assert out["timings"]["predicted_n"] == out["tokens_predicted"]
    got = client.completions.create(
        model="tiny-t", prompt="def add(a, b):\n", suffix="\n    return c\n", max_tokens=10
    )
    ref = local_json(root, "-n", "10", "--suffix", "\n    return c\n", "def add(a, b):\n")
    assert got.choices[0].text == ref["text"]
    streamed = httpx.post(server.url + "/infill", json=body | {"stream": True}, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}).text  # fmt: skip
    events = [json.loads(ln[6:]) for ln in streamed.splitlines() if ln.startswith("data: ")]
    assert events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == out["content"]


# ------------------------------------------------------------------ bad requests


BAD = [
    ("/v1/completions", "{not json", 400, "not valid JSON"),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5, "max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n must be 1"),
    ("/v1/completions", {"prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "", "max_tokens": 3}, 400, "empty"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "draft": "bigger"}, 400, "draft"),
    ("/v1/completions", {"prompt": "x", "num_draft": -2}, 400, "num_draft"),
    ("/v1/completions", {"prompt": "x", "verify": "blocks"}, 400, "verify"),
    ("/v1/completions", {"prompt": "word " * 3000, "max_tokens": 10}, 400, "context"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4000}, 400, "context of 2048"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/infill", {"input_prefix": "x", "temperature": -3}, 400, "temperature"),
    # seeds: -1 is "random" (llama.cpp's clients send it); beyond 64 bits or below -1, a 400
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -5, "stream": True}, 400, "seed"),
    ("/infill", {"input_prefix": "x", "seed": 2**70}, 400, "seed"),
    # a lone UTF-16 surrogate, which JSON can carry and no tokenizer can encode
    ("/v1/completions", '{"prompt": "ab\\ud800cd", "max_tokens": 2}', 400, "surrogate"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "surrogate"),
    ("/infill", '{"input_prefix": "x", "input_extra": [{"text": "\\ud800"}]}', 400, "surrogate"),
    # more stop strings than checked: said, never dropped in silence
    ("/infill", {"input_prefix": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop strings"),
]  # fmt: skip


# the same bad values on every generating route, each route with its own minimal body
_ROUTES = {
    "/v1/completions": {"prompt": "x"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]},
    "/infill": {"input_prefix": "x"},
    "/completion": {"prompt": "x"},
}
_BAD_VALUES = [
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 1}, "min_p"),
    ({"min_p": -0.5}, "min_p"),
    ({"seed": 2**70}, "seed"),
    ({"seed": -7}, "seed"),
    ({"seed": "x"}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [5]}, "stop"),
    ({"stream": "yes please"}, "stream"),
]
_ROUTE_BAD = [
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream_options": 5}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "penalties"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "text"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/infill", {"input_prefix": 5}, 400, "input_prefix"),
    ("/infill", {"input_extra": [{"text": 5}]}, 400, "input_extra"),
    ("/infill", {"input_prefix": "x", "n_cmpl": 0}, 400, "n_cmpl"),
    ("/infill", {"input_prefix": "x", "n_cmpl": 9}, 400, "n_cmpl"),
    ("/completion", {"n_predict": 4}, 400, "prompt"),
    ("/completion", {"prompt": ""}, 400, "empty"),
    ("/completion", {"prompt": [-1]}, 400, "prompt"),
    ("/completion", {"prompt": "x", "n_cmpl": 2, "stream": True}, 400, "n_cmpl"),
    ("/completion", {"prompt": "x", "n_keep": -2}, 400, "n_keep"),
    ("/completion", '{"prompt": "\\udc00"}', 400, "surrogate"),
    ("/completion", "[1, 2, 3]", 400, "body"),
    ("/infill", "", 400, "body"),
    ("/v1/completions", "null", 400, "body"),
]  # fmt: skip
BAD += [
    (path, {**base, **bad}, 400, words)
    for path, base in _ROUTES.items()
    for bad, words in _BAD_VALUES
] + _ROUTE_BAD


@pytest.mark.parametrize("path,body,status,words", BAD)
def test_bad_requests_get_a_4xx_json_error(server, path, body, status, words):
    if isinstance(body, str):
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        r = httpx.post(server.url + path, content=body, headers=headers, timeout=60)
    else:
        r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and words in err["message"], err
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_seed_minus_one_means_random(server):
    for body in ({"prompt": "def f():", "max_tokens": 3, "seed": -1},
                 {"prompt": "def f():", "max_tokens": 3, "seed": -1, "temperature": 0.7}):  # fmt: skip
        r = post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text


def test_keys_routes_and_sizes(server):
    assert post(server, "/v1/completions", {"prompt": "x"}, key=None).status_code == 401
    wrong = post(server, "/v1/completions", {"prompt": "x"}, key="sk-wrong")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    missing = httpx.get(server.url + "/v2/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404 and "error" in missing.json()
    huge = post(server, "/v1/completions", {"prompt": "x" * (17 * 2**20)})
    assert huge.status_code == 413 and "error" in huge.json()
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed, still up


# ------------------------------------------------------------------ a second server


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """No FIM tokens, two requests decode together, one may wait, no prompt cache."""
    root = tmp_path_factory.mktemp("serve-small")
    env = server_env(root, models_toml(root, fim=False))
    s = Server(env, "--max-queue", "1", "--prompt-cache", "0", "--max-batch", "2")
    yield s
    code, err = s.stop(signal.SIGINT)  # Ctrl-C: exit 0 as well
    assert code == 0, err


def test_past_the_queue_limit_a_503_with_retry_after(small_server):
    body = {"prompt": CODE, "max_tokens": 1500, "draft": "none"}
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: post(small_server, "/v1/completions", body), range(6)))
    codes = sorted(a.status_code for a in answers)
    assert codes.count(503) >= 2 and codes.count(200) >= 3, codes  # two run, one waits
    busy = next(a for a in answers if a.status_code == 503)
    assert busy.headers["Retry-After"] and busy.json()["error"]["code"] == "overloaded"


def test_llama_vims_warm_up_prefills_and_predicts_nothing(server):
    """llama.vim sends n_predict 0 about once a second to put the extra context into the
    server's cache: it must return at once with no tokens, and the next real request that
    shares the context must find it cached."""
    extra = [{"filename": "util.py", "text": CODE * 6}]
    # (llama.vim's response_fields [""] is in test_llama_vims_requests_in_their_own_shapes)
    warm = {"input_extra": extra, "n_predict": 0, "samplers": [], "t_max_predict_ms": 1}
    r = post(server, "/infill", warm)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["content"] == "" and out["tokens_predicted"] == 0 and out["stop"] is True
    assert out["tokens_evaluated"] > 40  # the extra context was taken in
    real = {"input_extra": extra, "input_prefix": "def add(a, b):\n", "input_suffix": "\n",
            "n_predict": 8, "temperature": 0}  # fmt: skip
    again = post(server, "/infill", real).json()
    assert again["tokens_cached"] >= out["tokens_evaluated"] - 8, (again, out)
    assert again["tokens_predicted"] > 0


def test_infill_on_a_model_without_fim_tokens_is_a_400(small_server):
    r = post(small_server, "/infill", {"input_prefix": "def f():", "input_suffix": "\n"})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]
    r = post(small_server, "/v1/completions", {"prompt": "def f():", "suffix": "\n"})
    assert r.status_code == 400


def test_a_public_host_without_a_key_is_refused(tmp_path):
    r = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0"], env=server_env(tmp_path, tmp_path))
    assert r.exit_code == 2 and "--api-key" in r.stderr


# ------------------------------------------------------------------ specmlx run --server


def cli(root: Path, *args: str, server=None, input=None):
    env = server_env(root, root / "models.toml")
    if server is not None:
        env |= {"SPECMLX_SERVER": server.url, "SPECMLX_API_KEY": KEY}
    return CliRunner().invoke(app, ["run", *args], env=env, input=input)


def test_run_through_the_server_keeps_its_contract(root, server):
    local = cli(root, "-n", "16", CODE)
    remote = cli(root, "-n", "16", CODE, server=server)
    assert remote.exit_code == 0, remote.stderr
    assert remote.stdout == local.stdout and "decode" in remote.stderr
    assert "served by" in remote.stderr
    a = json.loads(cli(root, "--json", "-n", "16", CODE, server=server).stdout)
    b = json.loads(cli(root, "--json", "-n", "16", CODE).stdout)
    assert a["text"] == b["text"] and a["tokens"] == b["tokens"] and a["draft"] == "tiny-d"
    assert a["stats"]["generated"] == 16
    piped = cli(root, "-n", "8", "-", server=server, input=CODE)
    assert piped.exit_code == 0 and piped.stdout.strip()
    infill = cli(root, "-n", "6", "--suffix", "\n    return c\n", "def add(a, b):\n", server=server)
    assert infill.exit_code == 0, infill.stderr
    # --verify travels with the request; the server's default shows when it is not given
    token = cli(
        root, "--json", "-n", "8", "--temp", "0.8", "--verify", "token", CODE, server=server
    )
    assert token.exit_code == 0, token.stderr
    assert json.loads(token.stdout)["verify"] == "token" and a["verify"] == "block"


@pytest.mark.parametrize(
    "args,code,words",
    [
        (["--temp", "-1", "x"], 2, "temperature"),
        (["-n", "4000", "x"], 2, "context of 2048"),
        (["--target", "tiny-t", "x"], 2, "--server"),
    ],
)
def test_run_through_the_server_bad_input(root, server, args, code, words):
    r = cli(root, *args, server=server)
    assert r.exit_code == code and words in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), lines


def test_run_with_an_unreachable_server_is_one_line(root):
    env = server_env(root, root / "models.toml") | {
        "SPECMLX_SERVER": f"http://127.0.0.1:{free_port()}"
    }
    r = CliRunner().invoke(app, ["run", "x"], env=env)
    assert r.exit_code == 1 and "cannot reach the specmlx server" in r.stderr
    assert "loading" not in r.stderr  # not a silent local load


def test_run_through_the_server_closed_pipe_and_ctrl_c(root, server):
    env = server_env(root, root / "models.toml") | {
        "SPECMLX_SERVER": server.url,
        "SPECMLX_API_KEY": KEY,
    }
    cmd = f"{sys.executable} -m specmlx run -n 1500 --draft none -q 'def f():' < /dev/null | head -c 5; exit ${{PIPESTATUS[0]}}"
    p = subprocess.run(
        cmd, shell=True, executable="/bin/bash", capture_output=True, env=env, timeout=120
    )
    assert p.returncode == 0 and len(p.stdout) <= 5, p.stderr
    assert b"Traceback" not in p.stderr
    child = subprocess.Popen(
        [sys.executable, "-m", "specmlx", "run", "-n", "1900", "--draft", "none", CODE],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    first = child.stdout.read(1)  # it is generating
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 130 and first, err
    assert b"decode" in err and b"Traceback" not in err


# ------------------------------------------------------------------ real weights


@pytest.mark.slow
def test_real_weights_through_the_server_equal_specmlx_run(tmp_path):
    from specmlx.errors import SpecmlxError
    from specmlx.models.loading import load_model
    from specmlx.models.registry import load_registry

    try:
        load_model(load_registry().resolve("smollm2-135m"))  # fetched once, cached
    except SpecmlxError as e:
        pytest.skip(f"SmolLM2-135M unavailable: {e}")
    toml = tmp_path / "models.toml"
    toml.write_text('[defaults]\npair = "smollm2"\npair_cpu = "smollm2"\n')
    env = dict(os.environ, SPECMLX_MODELS=str(toml))
    env.pop("SPECMLX_SERVER", None)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specmlx", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stderr.read()
                time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        prompt = "def fibonacci(n):\n    "
        got = client.completions.create(model="x", prompt=prompt, max_tokens=32,
                                        extra_body={"return_tokens": True})  # fmt: skip
        r = CliRunner().invoke(app, ["run", "--json", "-q", "-n", "32", prompt], env=env)
        assert got.choices[0].model_extra["token_ids"] == json.loads(r.stdout)["tokens"]
        assert got.model_extra["specmlx"]["drafted"] > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_max_queue_zero_serves_when_idle_and_refuses_while_busy():
    """--max-queue 0 means no waiting: a request is served while a row is free, refused
    while the thread holds one (from the moment it takes it off the queue)."""
    target = SimpleNamespace(model=None, tokenizer=None, vocab_size=0, identity="t")
    worker = Worker(target, None, 0, max_queue=0, persist=False, lookup_memory=False)
    worker.submit(None, lambda *_: None)  # idle: taken (the thread would start it now)
    with pytest.raises(QueueFull):
        worker.submit(None, lambda *_: None)  # one is already there: it would wait
    worker.queue.get()
    worker.holding = 1  # the thread took it (its prefill may not have begun)
    with pytest.raises(QueueFull):
        worker.submit(None, lambda *_: None)
    worker.holding = 0
    worker.submit(None, lambda *_: None)  # idle again


def test_a_huge_prompt_is_refused_at_once_and_stalls_no_other_client(server, client):
    """Tokenizing ran on the event loop: a 6.6 MB prompt took 19 s to get its 400 and stalled
    every other client's stream that long. Text that cannot fit the context is refused before
    tokenizing, and prompts are tokenized off the loop."""
    gaps: list[float] = []
    texts: list[str] = []

    def stream():
        parts = client.completions.create(
            model="tiny-t", prompt=CODE, max_tokens=150, stream=True, extra_body={"draft": "none"}
        )
        last = time.monotonic()
        for c in parts:
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            texts.append(c.choices[0].text if c.choices else "")

    alone = client.completions.create(
        model="tiny-t", prompt=CODE, max_tokens=150, extra_body={"draft": "none"}
    )
    reader = threading.Thread(target=stream)
    reader.start()
    huge = post(server, "/v1/completions", {"prompt": "the cat sat on a mat. " * 300000})
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded"
    # under the character bound but over the context: tokenized (off the loop), then a 400
    long = post(server, "/v1/completions", {"prompt": "the cat sat on a mat. " * 2900})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    reader.join(120)
    assert "".join(texts) == alone.choices[0].text  # the other client's stream, whole
    assert max(gaps[1:]) < 2.0, max(gaps)  # it never stalled for the big ones (was 19 s)


def test_the_bearer_scheme_is_case_insensitive_and_the_key_exact(server):
    ok = httpx.get(server.url + "/v1/models", headers={"Authorization": f"bearer  {KEY}"})
    assert ok.status_code == 200
    for wrong in (f"Bearer {KEY}x", f"Basic {KEY}", KEY, f"Bearer {KEY[:-1]}"):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": wrong})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", wrong


def test_a_500_names_no_exception_text(caplog):
    from specmlx.serving.api_errors import as_api_error

    err = as_api_error(RuntimeError("cannot open /home/someone/secret.safetensors"))
    assert err.status == 500 and "secret" not in err.message and "logged" in err.message
    assert "secret.safetensors" in caplog.text  # the server's log has it


def test_sigterm_answers_the_queued_and_ends_the_running_stream_cleanly(root):
    """SIGTERM once cut a stream longer than the grace with no final chunk, and started a
    queued request anyway (then a plain-text 500). Now: the queued one gets a 503
    shutting_down at once, the running stream ends with an error event and [DONE] before
    the grace runs out, and the server exits 0."""
    s = Server(server_env(root, models_toml(root)), "--shutdown-grace", "1", "--max-batch", "1")
    body = {"prompt": CODE, "max_tokens": 1900, "stream": True, "draft": "none"}
    lines: list[str] = []
    queued: list[httpx.Response] = []

    def stream():
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            lines.extend(ln for ln in r.iter_lines() if ln)

    def waiting():
        queued.append(httpx.post(s.url + "/v1/completions", timeout=60,
                                 json={"prompt": "x = 1", "max_tokens": 4}))  # fmt: skip

    a = threading.Thread(target=stream)
    a.start()
    deadline = time.monotonic() + 30
    while not httpx.get(s.url + "/health").json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    b = threading.Thread(target=waiting)
    b.start()
    while httpx.get(s.url + "/health").json()["queued"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    code, err = s.stop()
    a.join(30)
    b.join(30)
    assert code == 0, err
    assert queued and queued[0].status_code == 503, queued
    assert queued[0].json()["error"]["code"] == "shutting_down"
    assert lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2][6:])
    assert last["error"]["code"] == "shutting_down", lines[-3:]
    assert sum(1 for ln in lines if '"text"' in ln) > 1  # it had streamed before


def test_sigterm_ends_every_row_of_a_batch_with_an_error_event(root):
    """Two streams decoding together: SIGTERM past the grace ends both with a final
    shutting_down event and [DONE], and the server exits 0."""
    s = Server(server_env(root, models_toml(root)), "--shutdown-grace", "1", "--max-batch", "2")
    body = {"prompt": CODE, "max_tokens": 1900, "stream": True}
    streams: list[list[str]] = [[], []]

    def stream(i):
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            streams[i].extend(ln for ln in r.iter_lines() if ln)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while metrics(s).get("specmlx_batch_rows", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics(s)["specmlx_batch_rows"] == 2
    while metrics(s).get("specmlx_batch_rounds_total", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # the batch's passes, counted once a round
    assert metrics(s)["specmlx_batch_rounds_total"] >= 2
    code, err = s.stop()
    for t in threads:
        t.join(30)
    assert code == 0, err
    for lines in streams:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert json.loads(lines[-2][6:])["error"]["code"] == "shutting_down", lines[-3:]


def test_a_chunked_body_over_the_limit_is_a_413(server):
    """A body sent in chunks has no length to check first: it is counted as it comes."""

    def chunks():
        for _ in range(17):
            yield b"x" * 2**20

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large", r.text
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_loopback_server_answers_only_to_loopback_host_names(server):
    """DNS rebinding: a page on evil.example that rebinds its name to 127.0.0.1 sends
    Host: evil.example; the server on loopback refuses it (a keyless one would serve it)."""
    port = server.url.rsplit(":", 1)[1]
    evil = httpx.get(server.url + "/health", headers={"Host": f"evil.example:{port}"})
    assert evil.status_code == 400 and evil.json()["error"]["code"] == "invalid_host"
    for name in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(server.url + "/health", headers={"Host": name}).status_code == 200


def test_allowed_host_names_and_sizes():
    assert allowed_hosts("127.0.0.1", True, []) == {"localhost", "127.0.0.1", "::1"}
    assert "box.lan" in allowed_hosts("127.0.0.1", True, ["Box.lan"])
    assert allowed_hosts("0.0.0.0", False, []) is None  # public: a key is required there
    assert allowed_hosts("0.0.0.0", False, ["api.example"]) == {"api.example", "0.0.0.0"}
    assert allowed_hosts("127.0.0.1", True, ["*"]) is None
    assert [host_name(h) for h in ("a:1", "[::1]:8", "::1", "B")] == ["a", "::1", "::1", "b"]
    assert parse_size("1.5kB") == 1500 and parse_size(".5k") == 500
    for bad in ("1.2.3", "1..2", "."):
        with pytest.raises(BadInput, match="not a size"):
            parse_size(bad)


def test_a_malformed_size_is_a_usage_error(root):
    env = server_env(root, root / "models.toml")
    r = CliRunner().invoke(app, ["serve", "--max-body", "1.2.3"], env=env)
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        "error: '1.2.3' is not a size: use bytes or a size like 8GB or 512MiB"
    ]


def test_a_max_batch_below_one_or_past_the_memory_plan_is_a_usage_error(root):
    env = server_env(root, models_toml(root))
    r = CliRunner().invoke(app, ["serve", "--max-batch", "0"], env=env)
    assert r.exit_code == 2 and r.output.strip() == "error: --max-batch must be >= 1, got 0"
    tight = env | {"SPECMLX_MEMORY_BUDGET": "50MB"}  # the tiny pair's weights fit, 64 rows not
    r = CliRunner().invoke(app, ["serve", "--max-batch", "64", "--port", "0"], env=tight)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: --max-batch 64:")
    assert "fit in 50.0 MB ($SPECMLX_MEMORY_BUDGET)" in lines[0], lines


# what llama.vim (autoload/llama.vim) sends: its warm-up and its FIM request, field for field
VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
              "tokens_cached"]  # fmt: skip


def test_llama_vims_requests_in_their_own_shapes(server):
    extra = [{"filename": "util.py", "text": "def add(a, b):\n    return a + b\n" * 4}]
    warm = post(server, "/infill", {
        "input_extra": extra, "n_predict": 0, "samplers": [], "cache_prompt": True,
        "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""],
    })  # fmt: skip
    assert warm.status_code == 200 and warm.json() == {}  # "" names no field: nothing back
    fim = post(server, "/infill", {
        "id_slot": 0, "input_prefix": "def f(x):\n", "input_suffix": "\n", "input_extra": extra,
        "prompt": "    ", "n_predict": 16, "n_indent": 4, "top_k": 40, "top_p": 0.99,
        "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
        "t_max_prompt_ms": 500, "t_max_predict_ms": 250, "response_fields": VIM_FIELDS,
    })  # fmt: skip
    assert fim.status_code == 200, fim.text
    body = fim.json()
    # the flattened keys llama.vim reads for its info line, and nothing else
    assert set(body) == set(VIM_FIELDS), body
    assert body["timings/predicted_n"] <= 16 and body["timings/prompt_n"] > 0
    assert body["tokens_cached"] > 0  # the warm-up's extra context was reused
    whole = post(server, "/infill", {"input_prefix": "def f(x):\n", "n_predict": 4}).json()
    assert whole["generation_settings"]["n_ctx"] == 2048 and "timings" in whole
    props = httpx.get(server.url + "/props", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert props["default_generation_settings"]["n_ctx"] == 2048
    assert props["total_slots"] >= 1  # (the rows: tests/test_serve_faults.py)


def test_llama_vims_instruct_warm_up_on_the_chat_route_generates_nothing(server):
    """llama.vim's instruct mode posts its warm-up (n_predict 0, response_fields) to
    /v1/chat/completions, which ignored both and generated its 256 tokens. n_predict is
    llama-server's budget there (0: prefill only); the chat after it finds its prompt
    cached; response_fields leaves OpenAI's answer whole, as llama-server does."""
    messages = [{"role": "system", "content": "You edit code. " * 20},
                {"role": "user", "content": "Rename x to y in: x = x + 1"}]  # fmt: skip
    warm = post(server, "/v1/chat/completions", {
        "messages": messages, "n_predict": 0, "cache_prompt": True, "stream": False,
        "response_fields": [""], "temperature": 0.0,
    })  # fmt: skip
    assert warm.status_code == 200, warm.text
    out = warm.json()
    assert out["usage"]["completion_tokens"] == 0 and out["choices"][0]["message"]["content"] == ""
    real = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 4}).json()
    usage = real["usage"]
    assert usage["prompt_tokens"] == out["usage"]["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1, usage
    capped = post(server, "/v1/chat/completions", {"messages": messages, "n_predict": 2,
                                                   "max_tokens": 50}).json()  # fmt: skip
    assert capped["usage"]["completion_tokens"] <= 2


def test_llama_cpps_native_completion(server):
    """llama.cpp's /completion, as Continue's and Tabby's llama.cpp providers post it: a
    text or token-id prompt, n_predict, SSE chunks of "content" ending with "stop": true;
    n_cmpl gives several (each a seed further)."""
    body = {"prompt": "def add(a, b):\n", "n_predict": 8, "temperature": 0, "cache_prompt": True}
    r = post(server, "/completion", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["stop"] is True and out["tokens_predicted"] <= 8 and out["content"]
    with httpx.stream("POST", server.url + "/completion", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as s:  # fmt: skip
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e.get("content", "") for e in events[:-1]) == out["content"]
    assert events[-1]["stop"] is True and not any(e["stop"] for e in events[:-1])
    three = post(server, "/completion", {**body, "temperature": 1.0, "seed": 5, "n_cmpl": 3})
    assert three.status_code == 200 and len(three.json()) == 3
    assert post(server, "/completion", {"prompt": [], "n_predict": 2}).status_code == 400
    assert post(server, "/completion", {"prompt": [10**9], "n_predict": 2}).status_code == 400
    assert post(server, "/completion", {**body, "stream": True, "n_cmpl": 2}).status_code == 400


# ------------------------------------------------------------------ a small context


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory):
    """A context of 512 tokens, as small as an editor's model can be; the log as text."""
    root = tmp_path_factory.mktemp("serve-tight")
    s = Server(server_env(root, models_toml(root)), "--context", "512")
    yield s
    code, err = s.stop()
    assert code == 0, err


def vim_ring(chunks: int = 16, lines: int = 64) -> list[dict]:
    """llama.vim's ring of extra context at its defaults (ring_n_chunks 16, ring_chunk_size
    64 lines), as its requests carry it."""
    return [{"text": "".join(f"    value_{c}_{i} = compute({i}, {c})\n" for i in range(lines)),
             "time": 0, "filename": f"src/m{c}.py"} for c in range(chunks)]  # fmt: skip


def test_llama_vims_default_sizes_are_fitted_to_a_small_context(tight_server):
    """With llama.vim's defaults (256 lines before the cursor, 64 after, 16 chunks of 64
    lines) every request passed the context and got a 400 the plugin shows nowhere. Now it
    is cut as llama-server cuts it and answered, with truncated true; its warm-up too; a
    request that fits is left whole (truncated false). /completion is fitted the same way."""
    s = tight_server
    ring = vim_ring()
    warm = post(s, "/infill", {
        "input_prefix": "", "input_suffix": "", "input_extra": ring, "prompt": "",
        "n_predict": 0, "temperature": 0.0, "stream": False, "samplers": [], "cache_prompt": True,
        "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""],
    })  # fmt: skip
    assert warm.status_code == 200 and warm.json() == {}, warm.text
    before = "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(128))
    after = "".join(f"# note {i}\n" for i in range(64))
    fim = {
        "id_slot": 0, "input_prefix": before, "input_suffix": "\n" + after, "input_extra": ring,
        "prompt": "    re", "n_predict": 128, "n_indent": 4, "top_k": 40, "top_p": 0.99,
        "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
        "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "response_fields": VIM_FIELDS,
    }  # fmt: skip
    r = post(s, "/infill", fim)
    assert r.status_code == 200, r.text  # (was a 400 context_length_exceeded)
    got = r.json()
    assert set(got) == set(VIM_FIELDS) and got["truncated"] is True, got
    whole = post(s, "/infill", {**fim, "response_fields": None}).json()
    assert whole["tokens_evaluated"] + 128 <= 512 and whole["truncated"] is True
    # the control: a request that fits is not cut
    small = {**fim, "input_prefix": "def f(x):\n", "input_suffix": "\n", "input_extra": []}
    fits = post(s, "/infill", small)
    assert fits.status_code == 200 and fits.json()["truncated"] is False, fits.text
    # /completion: text or ids past the context, and a budget past what it leaves
    long = post(s, "/completion", {"prompt": CODE * 60, "n_predict": 8, "temperature": 0})
    assert long.status_code == 200 and long.json()["truncated"] is True, long.text
    assert long.json()["tokens_evaluated"] + 8 <= 512
    ids = post(s, "/completion", {"prompt": [5] * 900, "n_predict": 4, "n_keep": 10}).json()
    assert ids["truncated"] is True and ids["tokens_evaluated"] < 512
    budget = post(s, "/completion", {"prompt": "def f():\n", "n_predict": 5000}).json()
    assert budget["truncated"] is False and budget["generation_settings"]["n_predict"] < 512
    # the OpenAI routes still refuse what does not fit: their clients say so
    refused = post(s, "/v1/completions", {"prompt": CODE * 60, "max_tokens": 8})
    assert refused.status_code == 400, refused.text


def test_each_request_leaves_one_access_log_line(tight_server):
    """A line on stderr per request: route, status, time, and its prompt, cached and
    generated tokens, or the error's message."""
    s = tight_server
    # an earlier test's last line can still be on its way (it is written after the answer):
    # start counting once stderr has been still for a moment
    seen, end = -1, time.monotonic() + 10
    while seen != len(s.stderr().splitlines()) and time.monotonic() < end:
        seen = len(s.stderr().splitlines())
        time.sleep(0.3)
    ok = post(s, "/infill", {"input_prefix": "def g(y):\n", "n_predict": 3, "temperature": 0})
    bad = post(s, "/infill", {"input_prefix": "x", "temperature": -3})
    assert ok.status_code == 200 and bad.status_code == 400
    end = time.monotonic() + 10
    while len(s.stderr().splitlines()) < seen + 2 and time.monotonic() < end:
        time.sleep(0.05)
    lines = s.stderr().splitlines()[seen:]
    assert len(lines) == 2, lines
    out = ok.json()
    assert " POST /infill 200 " in lines[0], lines
    assert (f"prompt={out['tokens_evaluated']} cached={out['tokens_cached']} "
            f"generated={out['tokens_predicted']}") in lines[0]  # fmt: skip
    assert " POST /infill 400 " in lines[1] and "error: temperature" in lines[1], lines


def test_the_access_log_as_json_one_object_a_line(tmp_path):
    s = Server(server_env(tmp_path, models_toml(tmp_path)), "--log-format", "json")
    try:
        assert post(s, "/completion", {"prompt": "def f():\n", "n_predict": 2}).status_code == 200
        assert post(s, "/completion", {"prompt": ""}).status_code == 400
    finally:
        code, err = s.stop()
    assert code == 0, err
    lines = [json.loads(line) for line in err.splitlines()]  # every line, the CLI's too
    access = [x for x in lines if x.get("route") == "/completion"]
    assert [x["status"] for x in access] == [200, 400], lines
    assert access[0]["generated_tokens"] <= 2 and access[0]["prompt_tokens"] > 0
    assert access[0]["error"] is None and "empty" in access[1]["error"]
    assert {"ts", "method", "time_s", "cached_tokens"} <= set(access[0])


def test_a_body_that_stops_coming_is_a_408():
    """A slow client (slowloris on the body) is answered and let go, not waited on for ever."""
    sent = []

    async def app(scope, receive, send):  # never reached
        raise AssertionError("the app ran")

    async def receive():  # the first piece, then nothing more
        if not sent:
            sent.append("first")
            return {"type": "http.request", "body": b"{", "more_body": True}
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    guard = Guard(app, api_key=None, max_body=1000, hosts=None, body_timeout_s=0.05)
    scope = {"type": "http", "path": "/v1/completions", "headers": [], "method": "POST"}
    asyncio.run(guard(scope, receive, send))
    start = next(m for m in sent if isinstance(m, dict) and m["type"] == "http.response.start")
    assert start["status"] == 408


def test_headers_that_never_finish_get_a_408_and_the_connection_closes():
    """Slowloris on the headers (uvicorn has no deadline for them): a client that sends half
    a request head, or connects and sends nothing, is answered and let go; a whole request
    on the same kind of connection is served as usual."""
    import socket
    import threading

    import uvicorn

    from specmlx.serving.guard import HeaderDeadline

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    protocol = type("Quick", (HeaderDeadline,), {"header_timeout_s": 0.5})
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=protocol)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)

    def answer(send: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(send)
            got = b""
            while chunk := s.recv(4096):  # until the server closes (a timeout would raise)
                got += chunk
                if b"\r\n\r\n" in got and send.endswith(b"\r\n\r\n"):
                    break
            return got

    try:
        half = answer(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert half.startswith(b"HTTP/1.1 408"), half
        assert json.loads(half.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "timeout"
        assert answer(b"").startswith(b"HTTP/1.1 408")  # connected, said nothing
        whole = answer(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert whole.startswith(b"HTTP/1.1 200"), whole
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next"])
def test_window_and_recurrent_pairs_are_served_as_one_batch(tmp_path, family):
    """A sliding-window pair (Gemma 3, a window of 8) and a recurrent one (Qwen3-Next) batch
    in the server too: four concurrent streams, prompts past the window, each get the text
    they get alone, and /metrics saw them decode as one batch."""
    from families import family_config
    from helpers import save_tiny, tiny_tokenizer

    tok = tiny_tokenizer()
    for name, seed in (("t", 0), ("d", 1)):
        save_tiny(tmp_path / name, family_config(family, 4, len(tok)), tok, seed)
    env = dict(os.environ, SPECMLX_HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "x"))
    for name in ("SPECMLX_MODELS", "SPECMLX_SERVER", "SPECMLX_API_KEY", "SPECMLX_MEMORY_BUDGET"):
        env.pop(name, None)
    s = Server(env, "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "-k", "3",
               "--max-batch", "4", "--prompt-cache", "0")  # fmt: skip
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        prompts = [f"def f{i}(x):\n    return x * {i} + {i} - x // {i + 1}\n" for i in range(4)]

        def ask(p, stream=False):
            got = c.completions.create(model="t", prompt=p, max_tokens=24, stream=stream)
            return "".join(x.choices[0].text for x in got if x.choices) if stream else got

        alone = [ask(p).choices[0].text for p in prompts]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: ask(p, stream=True), prompts))
        assert together == alone
        seen = metrics(s)
        assert seen.get("specmlx_batch_rounds_total", 0) > 0, seen
    finally:
        code, err = s.stop()
    assert code == 0 and "one request at a time" not in err, err


def test_chats_with_one_system_prompt_on_a_hybrid_model_start_from_where_they_part(tmp_path):
    """Qwen3-Next's recurrent layers cannot give tokens back, so a prompt that parts from an
    entry inside it cannot start from it: the second chat's prefill leaves a copy where the
    two part (its own cached tokens: none), and the third chat starts from that copy. Its
    text is what `specmlx run` makes."""
    from families import family_config
    from helpers import save_tiny, tiny_tokenizer

    tok = tiny_tokenizer()
    for name, seed in (("t", 0), ("d", 1)):
        save_tiny(tmp_path / name, family_config("qwen3_next", 4, len(tok)), tok, seed)
    env = dict(os.environ, SPECMLX_HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "x"))
    for name in ("SPECMLX_MODELS", "SPECMLX_SERVER", "SPECMLX_API_KEY", "SPECMLX_MEMORY_BUDGET"):
        env.pop(name, None)
    models = ["--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "-k", "3"]
    system = CODE * 3
    s = Server(env, *models)
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        got = [c.completions.create(model="t", prompt=system + q, max_tokens=12)
               for q in ("# one\n", "# two\n", "# three\n")]  # fmt: skip
        # the same where a request joins a running batch: its prefill leaves the copy too
        half = system[: len(system) // 2]
        stream = c.completions.create(model="t", prompt=system + "# four\n", max_tokens=200,
                                      stream=True)  # fmt: skip
        for i, _ in enumerate(stream):
            if i == 1:  # decoding: this one joins it
                c.completions.create(model="t", prompt=half + "x = 0\n", max_tokens=4)
        last = c.completions.create(model="t", prompt=half + "y = 1\n", max_tokens=4)
    finally:
        code, err = s.stop()
    assert code == 0, err
    cached = [g.usage.prompt_tokens_details.cached_tokens for g in got]
    assert cached[1] == 0 and cached[2] >= 0.8 * got[2].usage.prompt_tokens, cached
    assert last.usage.prompt_tokens_details.cached_tokens >= 0.8 * last.usage.prompt_tokens
    r = CliRunner().invoke(app, ["run", "-q", *models, "-n", "12", system + "# three\n"], env=env)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.rstrip("\n") == got[2].choices[0].text.rstrip("\n")


# ------------------------------------------------------------------ editors first


def _editor_worker(root: Path, max_batch: int = 4) -> Worker:
    from specmlx.models.loading import load_pair
    from specmlx.models.registry import load_registry

    t, d, shared = load_pair("tiny-t", "tiny-d", registry=load_registry([models_toml(root)]),
                             context=2048)  # fmt: skip
    return Worker(t, d, shared, persist=False, lookup_memory=False, max_batch=max_batch,
                  cache_budget=64 << 20)  # fmt: skip


def _ask(worker: Worker, log: list, name: str, prompt: str, n: int, editor: bool):
    """Submit a greedy request; its events go into ``log`` as (name, kind, token)."""
    from specmlx.decoding.session import Request

    ids = worker.target.tokenizer.encode(prompt)
    r = Request(prompt_ids=ids, max_tokens=n, k=K(3))
    done = threading.Event()

    def emit(kind, value):
        log.append((name, kind, getattr(value, "token", None)))
        if kind in ("done", "error"):
            done.set()

    return worker.submit(r, emit, editor), done


def _wait_for(cond, timeout=60.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


@pytest.mark.parametrize("ahead", ["alone", "a row"])
def test_the_newest_editor_request_runs_first_and_the_older_resumes_exactly(root, ahead):
    """An editor's request (/infill) that arrives while an older one runs goes first: the
    older steps aside (alone, a batch of one, or a row beside a chat request)
    and makes no token until the newer is answered, then goes on from where it stopped;
    every text equals its solo run. The control: a non-editor request beside it interleaves."""
    worker = _editor_worker(root)
    worker.start()
    try:
        asks = {"old": (CODE * 2, 120), "new": ("def g(y):\n", 24), "chat": ("class A:\n", 160)}
        solo = {}
        for name, (p, n) in asks.items():
            log: list = []
            _, done = _ask(worker, log, name, p, n, editor=False)
            assert done.wait(60)
            solo[name] = [tok for _, kind, tok in log if kind == "piece"]

        def run(editor_new: bool) -> list:
            log: list = []
            waits = []
            if ahead == "a row":  # a chat request first, so the old one joins as a row
                waits.append(_ask(worker, log, "chat", *asks["chat"], editor=False)[1])
                _wait_for(lambda: any(x[0] == "chat" and x[1] == "piece" for x in log))
            waits.append(_ask(worker, log, "old", *asks["old"], editor=True)[1])
            _wait_for(lambda: sum(x[:2] == ("old", "piece") for x in log) >= 3)
            waits.append(_ask(worker, log, "new", *asks["new"], editor=editor_new)[1])
            assert all(d.wait(120) for d in waits)
            for name in {x[0] for x in log}:
                assert [tok for nm, kind, tok in log if nm == name and kind == "piece"] == solo[
                    name
                ], name
            return log

        log = run(editor_new=True)
        first = next(i for i, x in enumerate(log) if x[:2] == ("new", "piece"))
        last = next(i for i, x in enumerate(log) if x[:2] == ("new", "done"))
        assert not [x for x in log[first:last] if x[:2] == ("old", "piece")]
        assert any(x[:2] == ("old", "piece") for x in log[last:])  # it went on after
        if ahead == "a row":  # the chat request was not set aside
            assert any(x[:2] == ("chat", "piece") for x in log[first:last])
        log = run(editor_new=False)  # the control: a request that is not an editor's
        first = next(i for i, x in enumerate(log) if x[:2] == ("new", "piece"))
        last = next(i for i, x in enumerate(log) if x[:2] == ("new", "done"))
        assert [x for x in log[first:last] if x[:2] == ("old", "piece")]
    finally:
        worker.stop()


def test_a_parked_editor_request_whose_client_left_is_dropped(root):
    """An older editor request set aside, whose client hangs up meanwhile, never resumes:
    counted as cancelled, its caches back in the prompt cache, no answer sent."""
    worker = _editor_worker(root)
    worker.start()
    try:
        log: list = []
        old, _ = _ask(worker, log, "old", CODE * 2, 200, editor=True)
        _wait_for(lambda: sum(x[:2] == ("old", "piece") for x in log) >= 2)
        _, new_done = _ask(worker, log, "new", "def g(y):\n", 80, editor=True)
        _wait_for(lambda: any(x[:2] == ("new", "piece") for x in log))
        old.cancel()
        assert new_done.wait(60)
        _wait_for(lambda: worker.totals.cancelled == 1)
        assert not [x for x in log if x[0] == "old" and x[1] != "piece"]
        # it never ran again: every token it made was sent before it stepped aside
        assert old.stats.generated == sum(x[:2] == ("old", "piece") for x in log)
        assert worker.cache.entries and not worker.running()
    finally:
        worker.stop()


def test_editor_requests_stacked_past_the_rows_resume_newest_first_exactly(root):
    """Three editor requests, one after another, with room for two rows: the newest runs,
    the older two wait with their caches in the prompt cache (the newer ones take what
    they share); they resume newest first, each text its solo run's."""
    worker = _editor_worker(root, max_batch=2)
    worker.start()
    try:
        asks = {"a": (CODE * 2, 90), "b": ("def g(y):\n", 60), "c": ("class A:\n", 30)}
        solo = {}
        for name, (p, n) in asks.items():
            log: list = []
            assert _ask(worker, log, name, p, n, editor=True)[1].wait(60)
            solo[name] = [tok for _, kind, tok in log if kind == "piece"]
        log, waits = [], []
        for name in asks:
            waits.append(_ask(worker, log, name, *asks[name], editor=True)[1])
            _wait_for(lambda name=name: sum(x[:2] == (name, "piece") for x in log) >= 2)
        assert all(d.wait(120) for d in waits)
        for name in asks:
            assert [tok for nm, kind, tok in log if nm == name and kind == "piece"] == solo[name]
        ends = [x[0] for x in log if x[1] == "done"]
        assert ends == ["c", "b", "a"], ends
    finally:
        worker.stop()


@pytest.mark.parametrize("tree", ["8", "expand:8"])
def test_a_batchs_rows_verify_a_tree_each_and_keep_their_solo_text(tmp_path, tree):
    """`--tree 8` (side leaves) and `--tree expand:8` (EAGLE-2's trees, grown for every row
    at once): requests decoding together verify a token tree a row in each batched pass
    (/metrics counts those passes), and each gets the text it gets alone."""
    s = Server(server_env(tmp_path, models_toml(tmp_path)), "--api-key", KEY, "--tree", tree)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        prompts = [CODE, "def g(y):\n    return", "class A:\n    def", CODE * 2]
        alone = [client.completions.create(model="tiny-t", prompt=p, max_tokens=40)
                 for p in prompts]  # fmt: skip
        before = metrics(s)
        assert before["specmlx_tree_passes_total"] > 0  # (alone, too)

        assert streamed_together(client, prompts, 40) == [a.choices[0].text for a in alone]
        after = metrics(s)
        assert after["specmlx_batch_rounds_total"] > 0
        assert after["specmlx_batch_tree_rounds_total"] > 0, after
    finally:
        code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err
