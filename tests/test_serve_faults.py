"""`specmlx serve` against the faults of a fault run (issue 45, section 5): bodies nested
past Python's recursion limit, slow bodies holding every connection slot, uvicorn's plain-
text refusals, /openapi.json, lax types, /props' slots. The app runs in-process over a tiny
pair where that is the real path; a real uvicorn on 127.0.0.1 where the protocol is."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
import threading
import time
from contextlib import contextmanager

import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient
from helpers import free_port, tiny_pair
from pydantic import ValidationError

from specmlx.drafting.choosing.choosers import K
from specmlx.serving.api_schemas import ChatBody, CompletionBody
from specmlx.serving.guard import Guard, HeaderDeadline
from specmlx.serving.serve import ServerSettings, create_app
from specmlx.serving.worker import Worker

CHAT = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
ROWS = 2  # the worker's batch rows: what /props must report


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(TestClient, Worker): the real app over a tiny pair that batches ROWS rows, its
    worker thread running. A 500 comes back as a response, not raised here."""
    from specmlx.models.loading import load_pair
    from specmlx.models.registry import load_registry

    root = tmp_path_factory.mktemp("faults")
    toml = tiny_pair(root, fim=True, chat_template=CHAT)
    t, d, shared = load_pair("tiny-t", "tiny-d", registry=load_registry([toml]), context=2048)
    worker = Worker(t, d, shared, persist=False, lookup_memory=False, max_batch=ROWS)
    app = create_app(worker, ServerSettings(model_name="tiny-t", context=2048))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, worker


def post(client: TestClient, path: str, body):
    """POST ``body`` (a dict, or JSON text sent as it is)."""
    if isinstance(body, str):
        return client.post(path, content=body, headers={"Content-Type": "application/json"})
    return client.post(path, json=body)


def nested(depth: int, inner: str = "1") -> str:
    """JSON text: ``inner`` inside ``depth`` lists."""
    return "[" * depth + inner + "]" * depth


DEEP = "<deep>"


def with_depth(body: dict, depth: int) -> str:
    """``body`` as JSON text, ``depth`` nested lists where it holds DEEP."""
    return json.dumps(body).replace(json.dumps(DEEP), nested(depth))


# ------------------------------------------------------------------ nested bodies


def test_a_body_nested_past_the_recursion_limit_is_answered_not_a_500(served, capsys):
    """The surrogate check walked a body recursively: 950 lists deep in stream_options or
    in a chat content part (in a real server; the depth that breaks depends on the stack
    below) was a RecursionError, a 500 and a traceback in the log. Each depth up to where
    the JSON parser itself gives up is now checked and answered (here the 400 of "n": 2,
    refused after the body validates, so nothing is generated)."""
    client, _ = served
    part = {"type": "text", "text": "hi", "extra": DEEP}
    bodies = [
        ("/v1/completions", {"prompt": "hi", "n": 2, "stream_options": {"a": DEEP}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [part]}], "n": 2}),
    ]
    for path, body in bodies:
        for depth in range(600, 1400):  # up the depths until the parser refuses
            r = post(client, path, with_depth(body, depth))
            message = r.json()["error"]["message"]
            if "parsing the body" in message:  # past json's own depth: its 400
                break
            assert r.status_code == 400 and "n must be 1" in message, (depth, r.text)
        assert r.status_code == 400 and depth > 600, (depth, r.text)
    body = {"prompt": "hi", "max_tokens": 2, "stream_options": {"a": DEEP}}
    r = post(client, "/v1/completions", with_depth(body, 500))  # and such a body is served
    assert r.status_code == 200, r.text
    # a text part whose text is not a string: said, not a TypeError and a 500
    part = {"type": "text", "text": [[["hi"]]]}
    r = post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": [part]}]})
    assert r.status_code == 400 and "string" in r.json()["error"]["message"], r.text
    err = capsys.readouterr().err
    assert "RecursionError" not in err and "Traceback" not in err, err


def test_the_surrogate_check_reaches_the_bottom_of_any_depth():
    """Walked with its own stack: a lone surrogate 3,000 levels down is still found (a
    ValidationError, the 400), and the first one in the body is the one named."""
    deep = "\ud800"
    for _ in range(3000):  # (built here: json.loads itself stops short of this depth)
        deep = [deep]
    with pytest.raises(ValidationError, match="stream_options holds a lone surrogate"):
        CompletionBody.model_validate({"prompt": "x", "stream_options": {"a": deep}})
    messages = [{"role": "user", "content": "a\udc00"}, {"role": "user", "content": "\ud800"}]
    with pytest.raises(ValidationError, match="content holds a lone surrogate at character 1"):
        ChatBody.model_validate({"messages": messages})


# ------------------------------------------------------------------ types


STRICT = [
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "x", "seed": True}, "seed"),
    ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_k": "40"}, "top_k"),
    ("/v1/completions", {"prompt": "x", "echo": "no"}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "needs content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "needs content"),
    ("/v1/chat/completions", {"messages": [{"role": "system"}, {"role": "user", "content": "x"}]},
     "needs content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": True}, "max_completion_tokens"),
    ("/infill", {"input_prefix": "x", "n_predict": True}, "n_predict"),
    ("/infill", {"input_prefix": "x", "stream": "true"}, "stream"),
    ("/infill", {"input_prefix": "x", "n_cmpl": True}, "n_cmpl"),
    ("/completion", {"prompt": [True, 5]}, "prompt"),
    ("/completion", {"prompt": "x", "t_max_predict_ms": "250"}, "t_max_predict_ms"),
    # an uncapped num_draft drafted that many steps a round for every row (capped: K_MAX)
    ("/v1/completions", {"prompt": "x", "num_draft": 1000}, "num_draft must be an integer from 0 to 32"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "num_draft": 33},
     "num_draft must be an integer from 0 to 32"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,words", STRICT)
def test_a_value_of_the_wrong_json_type_is_a_400(served, path, body, words):
    """pydantic's lax mode read "max_tokens": true as one token and "stream": "yes" as a
    stream, and answered a user message with no content: each is a 400 naming the field."""
    r = post(served[0], path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and words in err["message"], err


def test_what_real_clients_send_still_passes(served):
    """The official openai client's bodies (ints, floats, bools as JSON gives them; an
    assistant message without content after a tool call) and llama.vim's /infill bodies."""
    client, _ = served
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client,
                        max_retries=0)  # fmt: skip
    got = oai.completions.create(
        model="tiny-t", prompt="def f():", max_tokens=3, temperature=0, top_p=1, seed=7,
        n=1, presence_penalty=0, frequency_penalty=0.0, stop=["\n\n"], echo=False,
        extra_body={"top_k": 40, "min_p": 0.05, "return_tokens": True},
    )  # fmt: skip
    assert got.choices[0].finish_reason in ("length", "stop")
    chunks = list(oai.completions.create(model="tiny-t", prompt="x", max_tokens=2, stream=True,
                                         stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].usage.completion_tokens <= 2
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]  # fmt: skip
    chat = oai.chat.completions.create(model="tiny-t", messages=messages, max_tokens=2,
                                       max_completion_tokens=2, temperature=0.7, seed=1)  # fmt: skip
    assert chat.choices[0].message.role == "assistant"
    vim = {
        "id_slot": 0, "input_prefix": "def f(x):\n", "input_suffix": "\n",
        "input_extra": [{"filename": "a.py", "text": "x = 1\n"}], "prompt": "    ",
        "n_predict": 4, "n_indent": 4, "top_k": 40, "top_p": 0.99, "stream": False,
        "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
        "t_max_prompt_ms": 500, "t_max_predict_ms": 250, "response_fields": ["content"],
    }  # fmt: skip
    assert post(client, "/infill", vim).status_code == 200
    warm = {"input_extra": [], "n_predict": 0, "samplers": [], "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]}  # fmt: skip
    assert post(client, "/infill", warm).status_code == 200
    assert post(client, "/completion", {"prompt": [5, 6], "n_predict": 2}).status_code == 200


# ------------------------------------------------------------------ routes


def test_no_openapi_schema_without_docs(served):
    client, _ = served
    for path in ("/openapi.json", "/docs", "/redoc"):
        r = client.get(path)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", path


def test_props_reports_the_rows_decoded_at_once(served):
    """total_slots was 1 whatever --max-batch: llama.cpp's clients read it as the requests
    the server runs at once."""
    client, worker = served
    assert worker.slots == ROWS  # the tiny pair batches
    assert client.get("/props").json()["total_slots"] == ROWS


# ------------------------------------------------------------------ slow bodies


def test_a_body_trickled_in_time_piece_by_piece_still_has_one_deadline():
    """The deadline was per piece: a byte every so often, each in time, held the request
    (and its connection slot) for as long as the client liked."""
    pieces, sent = 300, []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"read it all"})

    async def receive():  # a byte every 10 ms, 3 s in all
        await asyncio.sleep(0.01)
        sent.append(b" ")
        return {"type": "http.request", "body": b" ", "more_body": len(sent) < pieces}

    answers = []

    async def send(message):
        answers.append(message)

    guard = Guard(app, api_key=None, max_body=1000, hosts=None, body_timeout_s=0.3)
    scope = {"type": "http", "path": "/v1/completions", "headers": [], "method": "POST"}
    asyncio.run(guard(scope, receive, send))
    assert answers[0]["status"] == 408 and len(sent) < pieces
    assert json.loads(answers[1]["body"])["error"]["code"] == "timeout"


async def _echo(scope, receive, send):
    """An app that reads its body and says how long it was."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    out = json.dumps({"read": len(body)}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(out))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": out})


@contextmanager
def serving(app, **config):
    """uvicorn on a free loopback port with the server's protocol (HeaderDeadline), in a
    thread; yields (server, port)."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                            http=HeaderDeadline, **config)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield server, port
    finally:
        server.should_exit = True
        thread.join(10)


def _whole(got: bytes) -> bool:
    """Whether ``got`` holds a whole response (its head and content-length bytes)."""
    head, sep, body = got.partition(b"\r\n\r\n")
    size = re.search(rb"content-length: *(\d+)", head, re.I)
    return bool(sep) and size is not None and len(body) >= int(size.group(1))


def _rest(s: socket.socket, got: bytes = b"") -> bytes:
    """Read on until ``got`` is a whole response or the server closes (10 s at most)."""
    s.settimeout(10)
    while not _whole(got) and (chunk := s.recv(4096)):
        got += chunk
    return got


def ask(port: int, request: bytes) -> bytes:
    """The server's answer to ``request`` sent whole on a new connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        return _rest(s)


def parts(answer: bytes) -> tuple[int, dict, bytes]:
    """(status, headers with lower-case names, body) of a raw HTTP/1.1 answer."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def head(length: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % length)  # fmt: skip


GET = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def _wait_for_connections(server, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(server.server_state.connections) != n:
        assert time.monotonic() < deadline, len(server.server_state.connections)
        time.sleep(0.02)


def test_past_the_connection_limit_a_json_503_with_retry_after():
    """uvicorn's limit_concurrency answered a plain-text 503 with no Retry-After."""
    app = Guard(_echo, api_key=None, max_body=1000, hosts=None)  # the default 30 s deadline
    with serving(app, limit_concurrency=3) as (server, port):
        holders = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        try:
            for s in holders:  # a body begun and not finished: each holds its slot
                s.sendall(head(10) + b"{")
            _wait_for_connections(server, 2)
            status, headers, body = parts(ask(port, GET))
            assert status == 503, (status, body)
            assert headers["content-type"] == "application/json" and headers["retry-after"] == "1"
            err = json.loads(body)["error"]
            assert err["code"] == "overloaded" and "3" in err["message"], err
        finally:
            for s in holders:
                s.close()
        _wait_for_connections(server, 0)
        assert parts(ask(port, head(2) + b"{}"))[0] == 200  # served again


def test_clients_trickling_their_bodies_are_let_go_and_others_served():
    """The fault run's lock-out: clients each sending a byte now and then, each in time
    for a per-piece deadline, kept every slot. With one deadline for the whole body they
    get a 408 before their bodies are done, and the next client is served."""
    length = 100  # a byte every 50 ms: 5 s for the whole body, the deadline 0.5 s
    app = Guard(_echo, api_key=None, max_body=1000, hosts=None, body_timeout_s=0.5)
    answers: dict[int, tuple[int, bytes]] = {}

    def trickle(i: int) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(head(length))
            s.settimeout(0.05)  # each wait for an answer paces the bytes
            got, sent = b"", 0
            while sent < length and not _whole(got):
                try:
                    s.sendall(b" ")
                    sent += 1
                    chunk = s.recv(4096)
                except TimeoutError:
                    continue
                except OSError:  # the server closed while a byte was on its way
                    break
                if not chunk:
                    break
                got += chunk
            answers[i] = (sent, _rest(s, got))

    with serving(app, limit_concurrency=3) as (server, port):
        clients = [threading.Thread(target=trickle, args=(i,)) for i in range(2)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(30)
        for sent, answer in answers.values():
            status, _, body = parts(answer)
            assert status == 408 and sent < length, (sent, answer)
            assert json.loads(body)["error"]["code"] == "timeout"
        _wait_for_connections(server, 0)
        assert parts(ask(port, head(2) + b"{}"))[0] == 200
    assert len(answers) == 2


def test_63_clients_sending_their_bodies_keep_no_ordinary_request_out():
    """63 connections each with a body begun and not finished held every one of the 64
    slots until their 30 s deadlines, and every other client got a 503 (issue 66). The slots
    the app has are for requests with whole bodies now (guard.MAX_REQUESTS); connections
    still sending count only against uvicorn's far larger connection cap, so an ordinary
    request is served at once beside them."""
    from specmlx.serving.guard import MAX_REQUESTS
    from specmlx.serving.serve import MAX_CONNECTIONS

    app = Guard(_echo, api_key=None, max_body=1000, hosts=None)  # the default 30 s deadline
    with serving(app, limit_concurrency=MAX_CONNECTIONS) as (server, port):
        senders = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(63)]
        try:
            for s in senders:
                s.sendall(head(100) + b"{")
            _wait_for_connections(server, 63)
            t0 = time.monotonic()
            status, _, body = parts(ask(port, head(2) + b"{}"))
            assert status == 200 and time.monotonic() - t0 < 1.0, (status, body)
        finally:
            for s in senders:
                s.close()
    assert MAX_CONNECTIONS >= 8 * MAX_REQUESTS


def test_past_the_requests_the_app_works_on_a_json_503_with_retry_after():
    """The request cap counts requests whose body is whole, in the app: past it a 503 in
    OpenAI's shape with Retry-After, and served again once one ends."""
    release = threading.Event()

    async def slow(scope, receive, send):
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
        await _echo(scope, receive, send)

    app = Guard(slow, api_key=None, max_body=1000, hosts=None, max_requests=1)
    with serving(app, limit_concurrency=16) as (_server, port):
        held = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            held.sendall(head(2) + b"{}")
            time.sleep(0.3)  # (the first request is in the app)
            status, headers, body = parts(ask(port, head(2) + b"{}"))
            assert status == 503 and headers["retry-after"] == "1", (status, body)
            assert json.loads(body)["error"]["code"] == "overloaded"
            release.set()
            assert parts(_rest(held))[0] == 200
        finally:
            release.set()
            held.close()
        assert parts(ask(port, head(2) + b"{}"))[0] == 200


# ------------------------------------------------------------------ malformed HTTP


@pytest.mark.parametrize(
    "request_",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: x\r\n\r\n",
    ],
)
def test_malformed_http_gets_a_json_400(request_):
    """uvicorn answered a request h11 cannot parse with a plain-text 400."""
    with serving(_echo) as (_, port):
        status, headers, body = parts(ask(port, request_))
        assert status == 400 and headers["content-type"] == "application/json", body
        assert json.loads(body)["error"]["code"] == "bad_request"
        assert headers["connection"] == "close"
        assert parts(ask(port, GET))[0] == 200  # and the server serves on


def test_the_server_log_writes_to_stderr_as_it_is_at_each_line(monkeypatch, capsys):
    """A command run earlier in the same process (a CLI runner, which swaps stderr and closes
    its own) installed the server's log: its lines still reach the stderr of now, never a
    closed stream (that was a "Logging error" traceback in a later test's stderr)."""
    import io
    import logging

    from specmlx.serving import access_log

    old = io.StringIO()
    monkeypatch.setattr(sys, "stderr", old)
    log = access_log.install()
    old.close()
    monkeypatch.undo()
    log.info("after the swap")
    err = capsys.readouterr().err
    assert "after the swap" in err and "Logging error" not in err, err
    logging.getLogger(access_log.SERVER).handlers.clear()


# ------------------------------------------------------------------ a failed generation


@contextmanager
def app_over(root, rows: int, **worker_kw):
    """(TestClient, Worker) of a fresh server over the tiny FIM pair under ``root``, with a
    prompt cache and ``rows`` batch rows."""
    from specmlx.models.loading import load_pair
    from specmlx.models.registry import load_registry

    toml = tiny_pair(root, fim=True, chat_template=CHAT)
    t, d, shared = load_pair("tiny-t", "tiny-d", registry=load_registry([toml]), context=2048)
    worker = Worker(t, d, shared, persist=False, lookup_memory=False, max_batch=rows,
                    cache_budget=10**9, **worker_kw)  # fmt: skip
    app = create_app(worker, ServerSettings(model_name="tiny-t", context=2048, k=K(3)))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, worker


FIM = {
    "input_prefix": "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n",
    "input_suffix": "\n    y: int = 0\n", "prompt": "    ", "n_predict": 12, "temperature": 0,
    "response_fields": ["content", "tokens_cached"],
}  # fmt: skip


@pytest.mark.parametrize("rows", [1, 2])
def test_a_failed_generation_leaves_its_prompt_the_next_request_served(
    tmp_path, monkeypatch, caplog, rows
):
    """A generation that fails after it took caches from the prompt cache (a drafter that
    raises mid-generation, standing in for any fault) answers its client with an error,
    drops the entries it came from, and logs which request it was; the same prompt sent
    again is a 200 equal to a fresh server's answer (issue 63: one failure poisoned the
    entry, and every later request for that prompt failed too)."""
    from specmlx.drafting.row_drafters import ModelRows

    with app_over(tmp_path / "fresh", rows) as (client, _):
        fresh = post(client, "/infill", FIM).json()
    with app_over(tmp_path / "fail", rows) as (client, worker):
        assert post(client, "/infill", FIM).json() == fresh | {"tokens_cached": 0}
        assert len(worker.cache.entries) == 1
        propose, calls = ModelRows.propose, []

        def failing(self, *a, **kw):
            calls.append(1)
            if len(calls) == 2:  # mid-generation: a round has already been kept
                raise RuntimeError("injected")
            return propose(self, *a, **kw)

        monkeypatch.setattr(ModelRows, "propose", failing)
        with caplog.at_level("WARNING", logger="specmlx.serve"):
            failed = post(client, "/infill", FIM)
        assert failed.status_code == 500 and len(calls) == 2, failed.text
        assert worker.cache.entries == []
        logged = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert logged == [
            "request 2 (42 prompt tokens, an editor's) failed (RuntimeError): dropped the 1 "
            "prompt-cache entry it came from"
        ]
        again = post(client, "/infill", FIM)
        assert again.status_code == 200 and again.json() == fresh | {"tokens_cached": 0}
        # cache_prompt false: a fresh prefill, whatever the cache holds (llama-server's)
        assert post(client, "/infill", FIM).json()["tokens_cached"] > 0
        uncached = post(client, "/infill", FIM | {"cache_prompt": False}).json()
        assert uncached == fresh | {"tokens_cached": 0}


def test_warm_ups_are_not_prefilled_while_no_other_file_fits(tmp_path, caplog):
    """At a context of 2048, llama.vim's sizes fill the window: every suggestion's other
    files (input_extra) were cut to nothing, yet each warm-up prefilled them (issue 63).
    While the latest suggestion kept none, a warm-up prefills nothing, /props says so and
    the log says why, once; a suggestion that fits whole (its other files kept) ends it."""
    lines = "".join(f"    value_{i} = compute({i}, scale) + offset\n" for i in range(400))
    ring = [{"filename": "other.py", "text": "def add(a, b):\n    return a + b\n" * 40}]
    big = {"input_prefix": lines, "input_suffix": lines[:2000], "input_extra": ring,
           "n_predict": 4, "response_fields": ["truncated"]}  # fmt: skip
    warm = {"input_extra": ring, "n_predict": 0, "response_fields": ["timings/prompt_n"]}
    with app_over(tmp_path, 2) as (client, _):
        assert (
            post(client, "/infill", warm).json()["timings/prompt_n"] > 100
        )  # (kept: nothing says otherwise yet)
        assert client.get("/props").json()["input_extra_fits"] is True
        with caplog.at_level("WARNING", logger="specmlx.serve"):
            assert post(client, "/infill", big).json()["truncated"] is True
            post(client, "/infill", big)
        said = [r.getMessage() for r in caplog.records if "input_extra" in r.getMessage()]
        assert len(said) == 1 and "warm-ups are answered without a prefill" in said[0], said
        assert client.get("/props").json()["input_extra_fits"] is False
        assert post(client, "/infill", warm).json()["timings/prompt_n"] <= 1
        small = big | {"input_prefix": lines[:300], "input_suffix": ""}
        assert post(client, "/infill", small).json()["truncated"] is False
        assert client.get("/props").json()["input_extra_fits"] is True
        other = [{"filename": "util.py", "text": "class Point:\n    x: int = 0\n" * 40}]
        assert (
            post(client, "/infill", warm | {"input_extra": other}).json()["timings/prompt_n"] > 100
        )
