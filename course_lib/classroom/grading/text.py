"""Student text, cleaned once where it enters the grader and escaped where it is written.

Everything a submission decides is student text: folder and file names (from a zip, in any
encoding), exception messages (any string its code raises), notes about its files. It enters
through :func:`from_student` (names: :func:`name_from_student`), which makes it a plain,
bounded ``str`` that any file can hold: undecodable bytes and lone surrogates become U+FFFD,
control and bidirectional-override characters are dropped, lines and length are capped. Where it
is written into Markdown (``summary.md``, ``feedback/``) it goes through :func:`markdown_inline`
or :func:`markdown_block`, so that it reads as text there: no heading, link, image, HTML comment or
table cell of its own.
"""
from __future__ import annotations

import html
import re
import unicodedata

__all__ = ["from_student", "name_from_student", "markdown_inline", "markdown_block", "cap_lines",
           "NAME_LIMIT", "LINE_LIMIT"]

NAME_LIMIT = 200      # characters of a student's or a file's name
LINE_LIMIT = 60       # lines of one message
_BIDI = {"\u200e", "\u200f", "\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068",
         "\u2069"}


def _decoded(text: str | bytes) -> str:
    if isinstance(text, bytes):
        return text.decode("utf-8", errors="replace")
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:   # surrogates: a name read with surrogateescape, or a lone one raised on purpose
        try:
            return text.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")
        except UnicodeEncodeError:
            return "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)


def from_student(text: object, limit: int = 4000, *, lines: int = LINE_LIMIT) -> str:
    """``text`` (str, bytes, anything) as clean text: valid Unicode, no control characters but newlines
    and tabs, at most ``lines`` lines and ``limit`` characters (an ellipsis says where it was cut)."""
    text = _decoded(text if isinstance(text, (str, bytes)) else str(text))
    # every line break str.splitlines() knows is a newline here (U+2028 and U+2029 too), so that no line of a
    # report read line by line starts where a student chose
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u2028", "\n").replace("\u2029", "\n")
    kept = "".join(c for c in text if c in "\n\t" or (c not in _BIDI and unicodedata.category(c) not in ("Cc", "Cs")))
    split = kept.split("\n")
    if len(split) > lines:
        kept = "\n".join(split[:lines]) + f"\n... ({len(split) - lines} more lines)"
    return kept if len(kept) <= limit else kept[:max(0, limit - 3)] + "..."


def name_from_student(name: str | bytes) -> str:
    """A name (a student's folder, a file): one clean line; never empty. Invisible format characters (a
    zero-width space) are dropped too, so that no two students' names read alike and differ."""
    flat = re.sub(r"[\r\n\t\u2028\u2029]+", " ", _decoded(name))
    flat = "".join(c for c in flat if unicodedata.category(c) != "Cf")
    cleaned = from_student(flat, NAME_LIMIT, lines=1).strip()
    return cleaned or "(no name)"


_INLINE_SPECIAL = re.compile(r"([\\`*_\[\]{}()#!|~])")
_LINE_START = re.compile(r"^(\s*(?:\d+)?)([-+=>.)])")


# An address a Markdown viewer would turn into a link by itself (GitHub, JupyterLab, VS Code): shown as code. A
# scheme's or www.'s address, and an e-mail address (GFM's extended autolinks, with mailto: or xmpp: too).
_ADDRESS = re.compile(r"(?i)(?:\b[a-z][a-z0-9+.-]*://|\bwww\.)[^\s`]*"
                      r"|(?:\b(?:mailto|xmpp):)?[a-z0-9._+-]+@[a-z0-9-]+(?:\.[a-z0-9_-]+)+")


def _escaped(line: str) -> str:
    """One line of student text as literal Markdown: special characters escaped, addresses as code spans."""
    parts, last = [], 0
    for found in _ADDRESS.finditer(line):
        parts += [_INLINE_SPECIAL.sub(r"\\\1", html.escape(line[last:found.start()], quote=False)),
                  f"`{found.group(0)}`"]
        last = found.end()
    return "".join(parts) + _INLINE_SPECIAL.sub(r"\\\1", html.escape(line[last:], quote=False))


def markdown_inline(text: str) -> str:
    """Student text as literal Markdown on one line (a table cell, a list item, a heading)."""
    return _escaped(" ".join(from_student(text).split("\n")))


def markdown_block(text: str) -> str:
    """Student text as literal Markdown over several lines: each line escaped, line breaks kept."""
    lines = []
    for line in from_student(text).split("\n"):
        line = _escaped(line)
        lines.append(_LINE_START.sub(lambda m: m[1] + "\\" + m[2], line).strip() or "")
    return "  \n".join(line for line in lines if line) or ""


def cap_lines(items: list[str], limit: int, what: str) -> list[str]:
    """At most ``limit`` of ``items``, and a last line saying how many more there were."""
    if len(items) <= limit:
        return list(items)
    return list(items[:limit]) + [f"... and {len(items) - limit} more {what}"]
