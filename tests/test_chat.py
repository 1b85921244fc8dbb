"""`specmlx chat`: the conversation (turn-to-turn caches, overflow, /save) in this process,
then the command in a real terminal (a pty: two turns, Ctrl-C, Ctrl-D) and against
`--server`, and the bad inputs."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import Server, make_tiny_model, tiny_pair
from kit_serve import server_env
from typer.testing import CliRunner

from specmlx.cli import app
from specmlx.cli.chat import read_message
from specmlx.core.sampling import SamplingParams
from specmlx.decoding.conversation import Chat, Conversation, TooLong, fit
from specmlx.decoding.session import DrafterChoice, Pair, Request, Session
from specmlx.decoding.stream import chat_ids
from specmlx.models.loading import load_model
from specmlx.models.registry import load_registry

# a template whose rendering of a conversation starts with its rendering of the turns
# before, the assistant's turn opened (as real models' templates are)
CHAT = (
    "{% for m in messages %}<s>{{ m['role'] }}:\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:\n{% endif %}"
)


# ------------------------------------------------------------------ the conversation


def _length(messages: list[dict]) -> list[int]:
    """A stand-in template: a token a character, and one a message."""
    return [0] * sum(len(m["content"]) + 1 for m in messages)


def test_overflow_drops_the_oldest_turns_and_keeps_the_system_prompt():
    conv = Conversation("sys")  # 4 tokens
    for i in range(3):
        conv.add("user", f"question {i}")  # 11 tokens each
        conv.add("assistant", "x" * 19)  # 20
    conv.add("user", "last one")  # 9
    assert len(_length(conv.messages())) == 4 + 3 * 31 + 9
    ids, dropped = fit(conv, _length, limit=60, room=10)
    assert dropped == 2 and len(ids) == 4 + 31 + 9  # 44 + 10 <= 60; one turn more is not
    assert [m["content"] for m in conv.messages()] == ["sys", "question 2", "x" * 19, "last one"]
    # what fits is left as it is
    assert fit(conv, _length, limit=60, room=10) == (ids, 0)


def test_a_message_longer_than_the_context_is_refused_with_its_size():
    conv = Conversation()
    conv.add("user", "hi")
    conv.add("assistant", "hello")
    conv.add("user", "y" * 99)
    before = conv.messages()
    with pytest.raises(
        TooLong, match=r"100 tokens .* 16 \(--max-tokens\): 116 > the context of 64"
    ):
        fit(conv, _length, limit=64, room=16)
    assert conv.messages() == before  # nothing dropped for a message that cannot fit


def test_save_writes_the_messages_as_json(tmp_path):
    conv = Conversation("Be brief.")
    conv.add("user", "héllo\nthere")
    conv.add("assistant", "hi")
    conv.save(tmp_path / "c.json")
    assert json.loads((tmp_path / "c.json").read_text()) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "héllo\nthere"},
        {"role": "assistant", "content": "hi"},
    ]
    conv.clear()
    assert conv.messages() == [{"role": "system", "content": "Be brief."}]


def test_multi_line_messages_between_triple_quotes():
    def reader(lines):
        it = iter(lines)
        return lambda _prompt: next(it)

    assert read_message(reader(["plain"])) == "plain"
    assert read_message(reader(['"""', "a", "  b", '"""'])) == "a\n  b"
    assert read_message(reader(['"""first', "second", 'third"""'])) == "first\nsecond\nthird"
    assert read_message(reader(['"""one line"""'])) == "one line"


def test_history_on_a_home_that_cannot_be_written_is_skipped(tmp_path, monkeypatch):
    pytest.importorskip("readline")
    from specmlx.cli.chat import _history

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path / "file" / "home"))  # under a file
    _history()()  # neither reading nor saving raises
    monkeypatch.setenv("SPECMLX_HOME", str(tmp_path / "home"))
    _history()()
    assert (tmp_path / "home" / "chat_history").exists()


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """A tiny random target with a real tokenizer and CHAT, loaded as specmlx loads it."""
    path = make_tiny_model(tmp_path_factory.mktemp("chat") / "t", chat_template=CHAT)
    return load_model(load_registry().resolve(str(path)))


def _turn(chat: Chat, text: str, max_tokens: int = 6):
    request = Request(
        sampling=SamplingParams(), max_tokens=max_tokens, drafter=DrafterChoice.of("none"), seed=0
    )
    turn = chat.ask(text, request)
    reply = "".join(ev.text for ev in turn.generation.text())
    chat.answered(reply)
    return turn


def test_each_turn_prefills_only_its_new_message(tiny_chat):
    session = Session(Pair.of(tiny_chat, None, None))
    chat = Chat(session, limit=2048, system="Be brief.")
    first = _turn(chat, "hello there")
    assert first.generation.stats.cached_tokens == 0
    second = _turn(chat, "and how are you today?")
    stats = second.generation.stats
    assert second.prompt == chat_ids(tiny_chat.tokenizer, chat.conversation.messages()[:-1])
    # all of the first turn's prompt came from the caches; only what came after it was
    # prefilled: the new message, and what of the reply re-tokenizes to other ids
    assert stats.cached_tokens >= len(first.prompt)
    assert 0 < stats.prompt_tokens - stats.cached_tokens <= len(second.prompt) - len(first.prompt)
    # the same conversation in a new chat prefills it all
    fresh = Chat(session, limit=2048, system="Be brief.")
    fresh.conversation.turns = [dict(m) for m in chat.conversation.turns[:2]]
    again = _turn(fresh, "and how are you today?")
    assert again.generation.stats.cached_tokens == 0
    # a new conversation still takes the system prompt from the caches
    chat.clear()
    third = _turn(chat, "new topic")
    assert 0 < third.generation.stats.cached_tokens < len(first.prompt)


def test_a_chat_past_its_context_drops_its_oldest_turns(tiny_chat):
    chat = Chat(Session(Pair.of(tiny_chat, None, None)), limit=90, system="sys")
    dropped = [_turn(chat, f"message number {i} here").dropped for i in range(6)]
    assert dropped[0] == 0 and sum(dropped) > 0
    messages = chat.conversation.messages()
    assert messages[0] == {"role": "system", "content": "sys"}
    assert messages[-2]["content"] == "message number 5 here"
    assert "message number 0 here" not in [m["content"] for m in messages]
    with pytest.raises(TooLong, match="the context of 90"):
        _turn(chat, "z" * 400)
    assert chat.conversation.messages() == messages  # the session goes on as it was
    assert _turn(chat, "still here").prompt


# ------------------------------------------------------------------ the command


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chat-cli")
    tiny_pair(root, chat_template=CHAT)
    return root


ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


class Terminal:
    """`specmlx chat ARGS` on a pty of its own (its controlling terminal: Ctrl-C there is
    SIGINT), read as it writes."""

    def __init__(self, env: dict, *args: str):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            # Ctrl-C as a terminal's shell leaves it: a process that ignored SIGINT (a test
            # worker, or one that ran a rank's code in-process) passes SIG_IGN on through
            # exec, and Python then installs no KeyboardInterrupt handler: every Ctrl-C of
            # this test was lost (seen in two full runs under load)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvpe(sys.executable, [sys.executable, "-m", "specmlx", "chat", *args], env)
        self.out = b""

    def expect(self, pattern: str, timeout: float = 60) -> re.Match:
        """Read until ``pattern`` (a regex) turns up in what came after the last match."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern.encode(), self.out)
            if m:
                self.out = self.out[m.end() :]
                return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} in {self.out[-2000:]!r}")
            if select.select([self.fd], [], [], left)[0]:
                try:
                    self.out += os.read(self.fd, 65536)
                except OSError:  # the child has gone: EIO
                    raise AssertionError(f"exited before {pattern!r}: {self.out!r}") from None
                self.out = ANSI.sub(b"", self.out)  # (rich's colours, readline's modes)

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def interrupt_prompt(self, tries: int = 10) -> None:
        """Ctrl-C at the prompt, until a fresh prompt shows. (A SIGINT that lands after
        readline drew the prompt but before it waits for a key is only seen at the next
        key or signal: CPython's readline loop checks signals when its select() is
        interrupted. The next Ctrl-C is.)"""
        for _ in range(tries):
            self.send("\x03")
            try:
                self.expect(">>> ", timeout=3)
                return
            except AssertionError:
                continue
        raise AssertionError(f"no fresh prompt after {tries} Ctrl-C: {self.out[-2000:]!r}")

    def stats(self) -> tuple[int, int, int, int]:
        """/stats' figures: (prompt tokens, processed, cached, tokens generated)."""
        self.send("/stats\r")
        decode = int(self.expect(r"decode +(\d+) tok").group(1))
        m = self.expect(r"prompt tokens: (\d+), processed (\d+), cached (\d+)")
        self.expect(">>> ")
        return int(m.group(1)), int(m.group(2)), int(m.group(3)), decode

    def wait(self, timeout: float = 30, nudge: str = "") -> int:
        """The exit code, sending ``nudge`` again every 2 s (a key typed while readline is
        not reading meets the terminal's cooked mode instead, and may be lost)."""
        deadline, again = time.monotonic() + timeout, time.monotonic() + 2
        while time.monotonic() < deadline:
            if nudge and time.monotonic() > again:
                self.send(nudge)
                again = time.monotonic() + 2
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if select.select([self.fd], [], [], 0.1)[0]:
                try:
                    self.out += os.read(self.fd, 65536)
                except OSError:
                    pass
        os.kill(self.pid, 9)
        raise AssertionError(f"chat did not exit: {self.out[-2000:]!r}")


def test_chat_in_a_terminal(models, tmp_path):
    """Two turns (the second prefills only its message, even after a stopped reply), Ctrl-C
    stopping a reply and at the prompt, /save, and Ctrl-D leaving with 0."""
    env = server_env(models, models / "models.toml")
    long = "6000"  # tokens: far more than come before Ctrl-C
    term = Terminal(env, "-d", "none", "-n", long, "--context", "8192", "--system", "Be brief.")
    term.expect(">>> ")
    term.interrupt_prompt()  # at the prompt: a fresh prompt
    term.send("hello there\r")
    term.expect("hello there\r\n")
    term.expect(".")  # the reply has begun
    term.send("\x03")
    term.expect(r"\(stopped\)")
    term.expect(">>> ")
    n1, fed1, cached1, generated = term.stats()
    assert cached1 == 0 and fed1 == n1 and 0 < generated < int(long)
    term.send("how are you\r")
    term.expect("how are you\r\n")
    term.expect(".")
    term.send("\x03")
    term.expect(r"\(stopped\)")
    term.expect(">>> ")
    n2, fed2, cached2, _ = term.stats()
    # the first turn's prompt came from the caches: only the new message (and the reply
    # shown, as the template renders it) was prefilled
    assert cached2 >= n1 and 0 < fed2 <= n2 - n1, (n1, n2, fed2, cached2)
    term.send(f"/save {tmp_path / 'c.json'}\r")
    term.expect("saved 5 messages")
    term.send("/nope\r")
    term.expect("unknown command /nope")
    term.send("\r")  # an empty line: nothing
    term.expect(">>> ")
    term.send("\x04")
    assert term.wait(nudge="\x04") == 0
    saved = json.loads((tmp_path / "c.json").read_text())
    assert [m["role"] for m in saved] == ["system", "user", "assistant", "user", "assistant"]
    assert saved[2]["content"] and saved[4]["content"]  # what was shown before Ctrl-C stays
    assert (Path(env["SPECMLX_HOME"]) / "chat_history").read_text().count("hello there") >= 1


def test_chat_against_a_server(models):
    """`chat --server`: the server's prompt cache keeps the first turn; a conversation past
    the server's context drops its oldest turns; a message too long alone is refused and
    the session goes on."""
    env = server_env(models, models / "models.toml")
    server = Server(env, "-d", "none", "--context", "160")
    try:
        long = " ".join(["some words here"] * 3)  # about 40 tokens
        lines = [
            "hello there", "/stats", "how are you", "/stats", long, long, long, "/stats",
            " ".join(["far too long"] * 30), "still here?", "/save saved.json", "/bye",
        ]  # fmt: skip
        r = subprocess.run(
            [sys.executable, "-m", "specmlx", "chat", "--server", server.url, "-n", "8"],
            input="\n".join(lines) + "\n", capture_output=True, text=True, env=env,
            timeout=120, cwd=models,
        )  # fmt: skip
    finally:
        code, err = server.stop()
    assert r.returncode == 0, r.stderr
    figures = re.findall(r"prompt tokens: (\d+), processed (\d+), cached (\d+)", r.stderr)
    (n1, _, c1), (n2, fed2, c2), _ = [tuple(map(int, f)) for f in figures]
    assert c1 == 0 and c2 >= n1 and fed2 <= n2 - n1, figures
    assert f"tiny-t (served by {server.url})" in r.stderr
    assert re.search(r"dropped the oldest \d+ turns? to fit the server's context", r.stderr)
    assert "context_length" in r.stderr or "> the context of 160" in r.stderr, r.stderr
    saved = json.loads((models / "saved.json").read_text())
    assert saved[-2] == {"role": "user", "content": "still here?"}  # the refused one is not
    assert "hello there" not in [m["content"] for m in saved]  # dropped to fit
    assert code == 0, err


def test_a_model_without_a_chat_template_is_one_line_and_exit_2(tmp_path, specmlx_home):
    path = make_tiny_model(tmp_path / "plain")
    r = CliRunner().invoke(app, ["chat", "-t", str(path), "-d", "none"], input="hi\n")
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error:") and "chat_template" in lines[-1]
    assert "Traceback" not in r.output
