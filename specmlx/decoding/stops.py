"""Where a generation stops: EOS ids, token-id stop sequences and the token budget, kept
per generation (a solo one, or a row of a batch) and checked the same way for both."""

from __future__ import annotations

from collections.abc import Sequence


class Stops:
    """EOS ids, token-id stop sequences and the token budget. EOS is not emitted; a stop
    sequence is emitted (the text layer strips stop strings). Only the last few tokens are
    kept, so checking costs the same at the 10th token and the 10,000th.

    eos: ids that end generation unemitted; seqs: token sequences that end it (emitted);
    max_tokens: the whole budget of the request; made: tokens it already emitted (a request
    that goes on elsewhere: alone, then as a row of a batch): they count against the
    budget, and a stop sequence may begin among them."""

    def __init__(
        self,
        eos: Sequence[int],
        seqs: Sequence[Sequence[int]],
        max_tokens: int,
        made: Sequence[int] = (),
    ):
        self.eos, self.max_tokens = set(eos), max_tokens
        self.seqs = [list(s) for s in seqs if s]
        self.span = max((len(s) for s in self.seqs), default=0)
        # the last ``span`` tokens emitted (a stop sequence's first part may be among them)
        self.recent: list[int] = list(made)[-self.span :] if self.span else []
        self.count = len(made)  # tokens emitted

    @property
    def room(self) -> int:
        """Tokens a round may still draft: it emits up to k + 1, the budget is left - 1."""
        return self.max_tokens - self.count - 1

    def cut(self, new: list[int]) -> tuple[list[int], str | None]:
        """Keep the prefix of ``new`` up to the first stop; return it and the finish reason."""
        for i, t in enumerate(new):
            if t in self.eos:
                return new[:i], "stop"
            self.count += 1
            if self.span:
                self.recent = (self.recent + [t])[-self.span :]
                if any(self.recent[-len(s) :] == s for s in self.seqs):
                    return new[: i + 1], "stop"
            if self.count >= self.max_tokens:
                return new[: i + 1], "length"
        return new, None
