"""A report.md as its readers see it: rendered by a CommonMark viewer, then read as text."""

from __future__ import annotations

import html
import re

from markdown_it import MarkdownIt


def markdown_html(markdown: str) -> str:
    """A Markdown file as a viewer renders it (CommonMark with GitHub's tables and
    strikethrough; raw HTML passes through, as most viewers let it)."""
    return MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(markdown)


def markdown_text(markdown: str) -> str:
    """The text a reader of the rendered Markdown sees."""
    return html.unescape(re.sub(r"<[^>]+>", "", markdown_html(markdown)))
