"""`wire.stream.StreamTiming` with a shortcut for the message vLLM sends most: one more token.

Decoding every SSE message as JSON is most of what the timing rules cost the proxy, yet nearly
all messages of a stream are byte-for-byte the same apart from the token's text:

    data: {"id":"cmpl-…","object":"text_completion","created":…,"model":"m","choices":[{"index":0,
    "text":"<token>","logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}

So after a token message has been decoded the ordinary way, its bytes before and after the text
value become a template. A later message made of the same prefix, a non-empty middle holding no
`"`, no `\\` and no control character (valid UTF-8), and the same suffix is the same JSON object
with another plain string in that one place: it is a token message that sets no finish reason,
no usage and no error, exactly what decoding it would have concluded. Anything else (the first
token, escapes, the finish reason, usage, errors, `n > 1`, a changed id) is decoded as before.
The rules stay `StreamTiming`'s; tests/integration/test_gateway.py checks the two give equal
results on generated streams, and the gateway's numbers keep meaning what the bench client's mean.
"""

from __future__ import annotations

import re
from typing import Any

from servescope.wire.stream import Chunk, StreamTiming

_NOT_PLAIN = re.compile(rb'["\\\x00-\x1f]')  # what a JSON string cannot hold unescaped
_WS = b" \t\r\n"


class RelayTiming(StreamTiming):
    """The gateway's feed of the timing rules (see the module docstring)."""

    __slots__ = ("_prefix", "_suffix")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prefix = b""  # empty while there is no template
        self._suffix = b""

    def feed(self, data: bytes, now: float) -> Any:
        """Feed every line of `data` (whole lines of one network read, all stamped `now`) as
        `StreamTiming.feed_line` would, lines that are not JSON skipped; returns the `error` of
        the last message that has one (None when none has)."""
        error = None
        search = _NOT_PLAIN.search
        prefix, suffix = self._prefix, self._suffix
        lp, ls = len(prefix), len(suffix)
        for line in data.split(b"\n"):
            if not line:  # the blank line after each message
                continue
            n = len(line)
            if (
                prefix
                and n > lp + ls
                and line.startswith(prefix)
                and line.endswith(suffix)
                and search(line, lp, n - ls) is None
                and (line.isascii() or _utf8(line[lp : n - ls]))
            ):  # the template's message with another plain token: the rules' token case
                if self.first is None:
                    self.first = now
                elif self.last is not None:
                    self.gaps.append((now - self.last) * 1000.0)
                self.last = now
                continue
            try:
                chunk = self.feed_line(line, now)
            except ValueError:  # not JSON: passed through, not timed
                continue
            if chunk is None:
                continue
            if "error" in chunk:
                error = chunk["error"]
            elif self._learn(line, chunk):
                prefix, suffix = self._prefix, self._suffix
                lp, ls = len(prefix), len(suffix)
        return error

    def _learn(self, line: bytes, chunk: Chunk) -> bool:
        """Make `line` the template when it is a plain one-token message whose text value can
        be found unambiguously in its bytes; whether it did."""
        choices = chunk.get("choices")
        if (
            not isinstance(choices, list)
            or len(choices) != 1
            or not isinstance(choices[0], dict)
            or chunk.get("usage")
            or "error" in chunk
            or (choice := choices[0]).get("finish_reason")
            or not self.endpoint.is_token(choice)
            or b"\\" in line  # with no escapes, every quote opens or closes a string
        ):
            return False
        if self.endpoint.chat:
            key, value = b'"content"', choice["delta"]["content"]
        else:
            key, value = b'"text"', choice["text"]
        if not isinstance(value, str) or not value or line.count(key) != 1:
            return False  # the key is unique: this is the choice's own (its value is a string)
        i = line.index(key) + len(key)
        n = len(line)
        while i < n and line[i] in _WS:
            i += 1
        if i >= n or line[i] != 0x3A:  # ':'
            return False
        i += 1
        while i < n and line[i] in _WS:
            i += 1
        if i >= n or line[i] != 0x22:  # '"'
            return False
        start = i + 1
        end = line.find(b'"', start)
        if end < 0 or line[start:end] != value.encode():
            return False
        self._prefix, self._suffix = line[:start], line[end:]
        return True


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
