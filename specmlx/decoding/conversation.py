"""A chat held with a loaded pair: its messages, kept within the context by dropping the
oldest turns, and the caches kept from one turn to the next.

Each turn's prompt is the whole conversation through the chat template, as a chat client
sends it to a server. The caches the last turn left (a KVState: the prompt and the reply's
tokens) are handed to the next generation, whose prefill keeps their longest common prefix
with the new prompt and rolls back the rest (kvstate.reuse_prefix, what the server's prompt
cache does with each entry it hands out): with a template whose rendering of a conversation
starts with its rendering of the conversation before, a turn prefills only its new message
(and whatever of the last reply its text does not re-tokenize to the same ids).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..core.kvstate import KVState
from ..errors import BadInput
from .session import Generation, Request, Session
from .stream import chat_ids

# a conversation's message roles besides the system prompt, in turn order
USER, ASSISTANT = "user", "assistant"


class TooLong(BadInput):
    """A message that does not fit the context even as the conversation's only turn."""


@dataclass
class Conversation:
    """A chat's messages: the system prompt (None: none) and the user and assistant
    messages after it, oldest first, each a {"role", "content"} dict."""

    system: str | None = None
    turns: list[dict] = field(default_factory=list)

    def messages(self) -> list[dict]:
        """Every message, the system prompt first: what the chat template renders."""
        first = [{"role": "system", "content": self.system}] if self.system else []
        return first + [dict(m) for m in self.turns]

    def add(self, role: str, content: str) -> None:
        """Append a message. role: "user" or "assistant"; content: its text."""
        self.turns.append({"role": role, "content": content})

    def clear(self) -> None:
        """A new conversation: every turn goes, the system prompt stays."""
        self.turns.clear()

    def user_turns(self) -> int:
        """How many user messages it holds."""
        return sum(m["role"] == USER for m in self.turns)

    def drop_oldest(self) -> bool:
        """Drop the oldest turn: its user message and the replies before the next one.
        False when there is none to drop but the newest user message (and its reply)."""
        starts = [i for i, m in enumerate(self.turns) if m["role"] == USER]
        if len(starts) < 2:
            return False
        del self.turns[: starts[1]]
        return True

    def save(self, path: Path) -> None:
        """Write the messages (system prompt first) as a JSON list to ``path``.

        path: the file (created or replaced). OSError where it cannot be written."""
        path.write_text(json.dumps(self.messages(), indent=2, ensure_ascii=False) + "\n")


def fit(
    conversation: Conversation,
    encode: Callable[[list[dict]], list[int]],
    limit: int,
    room: int,
) -> tuple[list[int], int]:
    """The prompt ids of ``conversation`` once it fits: its oldest turns dropped (the system
    prompt kept) until the prompt and ``room`` fit in ``limit``. Returns (ids, the number of
    turns dropped). TooLong, with the sizes, when the newest user message does not fit
    alone; the conversation is then left as it was.

    conversation: the messages, ending with the new user message (changed in place);
    encode: messages -> prompt ids (the chat template, with the assistant's turn opened);
    limit: the context in tokens; room: tokens kept for the reply (its --max-tokens)."""
    ids = encode(conversation.messages())
    if len(ids) + room <= limit:
        return ids, 0
    kept = list(conversation.turns)
    dropped = 0
    while len(ids) + room > limit and conversation.drop_oldest():
        dropped += 1
        ids = encode(conversation.messages())
    if len(ids) + room > limit:
        conversation.turns[:] = kept
        raise TooLong(
            f"this message is {len(ids)} tokens with the chat template"
            f"{' and the system prompt' if conversation.system else ''}, and a reply gets "
            f"{room} (--max-tokens): {len(ids) + room} > the context of {limit}; shorten it "
            "or lower --max-tokens"
        )
    return ids, dropped


def require_chat_template(tokenizer, alias: str) -> None:
    """BadInput naming the fix when ``tokenizer`` (the model ``alias``'s) has no chat
    template: models.toml's ``chat_template`` gives one (loading.py applies it)."""
    if not getattr(tokenizer, "chat_template", None):
        raise BadInput(
            f'{alias} has no chat template: give it one with chat_template = "FILE.jinja" '
            f"under its [models.ALIAS] in models.toml, or use `specmlx run` for raw text"
        )


@dataclass
class Turn:
    """One reply being generated: ``generation`` (iterate its ``text()`` once, then call
    ``Chat.answered``), ``dropped`` (the oldest turns dropped to fit it) and ``prompt``
    (its prompt ids)."""

    generation: Generation
    dropped: int
    prompt: list[int]


class Chat:
    """A conversation with a loaded pair, its caches kept between turns.

    session: the pair (its tokenizer must have a chat template); limit: the context in
    tokens; system: the system prompt (None: none)."""

    def __init__(self, session: Session, limit: int, system: str | None = None) -> None:
        tokenizer = session.pair.tokenizer
        self.session, self.limit = session, limit
        self.conversation = Conversation(system)
        self.kv = KVState()  # what the last turn left in both models' caches
        self._encode = lambda messages: chat_ids(tokenizer, messages)
        self._pending = False  # a user message waits for its reply (Chat.answered)

    def ask(self, text: str, request: Request) -> Turn:
        """Add the user message ``text`` and start its reply under ``request`` (its prompt
        ids are filled in here). The oldest turns go where the conversation would overflow;
        TooLong (the message left out) where the message does not fit alone.

        text: the user's message; request: the reply's settings (budget, sampling, k)."""
        if self._pending:
            raise RuntimeError("the last reply was not recorded: call answered() first")
        self.conversation.add(USER, text)
        try:
            ids, dropped = fit(self.conversation, self._encode, self.limit, request.max_tokens)
        except TooLong:
            self.conversation.turns.pop()
            raise
        gen = self.session.start(replace(request, prompt_ids=ids), kv=self.kv)
        self._pending = True
        return Turn(gen, dropped, ids)

    def answered(self, reply: str) -> None:
        """Record ``reply``, the text of the reply as it was shown (all of it, or what came
        before the user stopped it), as the assistant's message."""
        self.conversation.add(ASSISTANT, reply)
        self._pending = False

    def failed(self) -> None:
        """The reply failed before any of it was shown: its user message goes (the caches
        stay as the engine left them: where a failure left them unknown it dropped them)."""
        if self._pending:
            self.conversation.turns.pop()
        self._pending = False

    def clear(self) -> None:
        """A new conversation (the system prompt stays); the caches are kept, so the next
        turn still reuses the system prompt's prefill."""
        self.conversation.clear()
        self._pending = False
