"""Stop strings of a width-1 request: its text, as the server's tokenizer spells it, is matched
after every token; the first stop string to appear ends the request (SGLang's `stop`).

Only the last tokens are decoded each step, enough to spell the longest stop string and a few
tokens more (a token may spell nothing on its own, as part of a multi-byte character), so a
step costs the same at token 5 and at token 5,000.
"""

from __future__ import annotations

from collections.abc import Callable

TAIL_SLACK = 8  # tokens decoded beyond the longest stop string's length in characters


class StopStrings:
    def __init__(self, strings: tuple[str, ...], detokenize: Callable[[list[int]], str]):
        self.strings = strings
        self.detokenize = detokenize
        self.tail = max(len(s) for s in strings) + TAIL_SLACK
        self.tokens: list[int] = []

    def push(self, token: int) -> str | None:
        """Add the request's next token; the stop string its text now holds, if any."""
        self.tokens.append(token)
        text = self.detokenize(self.tokens[-self.tail :])
        return next((s for s in self.strings if s in text), None)
