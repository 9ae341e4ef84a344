"""PDF, DOCX and HTML files as plain text.

PDF and DOCX need the optional `documents` extra: pypdf and python-docx. Both are well kept,
pure Python but for lxml (a wheel), and only parse: no model, no download, nothing in the
file is run. markitdown reads more formats, but pulls in magika (an ONNX model that guesses
file types) and pdfminer for PDF. HTML needs no extra: the standard library's parser drops the
markup and keeps the text.

A converted text is untrusted like any document: the model gets it as plain text.
"""

from __future__ import annotations

import io
import re
from enum import StrEnum
from html.parser import HTMLParser
from pathlib import Path

from .documents import DocumentError, decode_text

EXTRA = "documents"
# A PDF's or DOCX's bytes are mostly images and fonts: the file may be far larger than its
# text, which the caller bounds.
MAX_CONVERTED_FILE_BYTES = 64 << 20


class Format(StrEnum):
    PDF = "PDF"
    DOCX = "DOCX"
    HTML = "HTML"


_SUFFIXES = {".pdf": Format.PDF, ".docx": Format.DOCX, ".html": Format.HTML, ".htm": Format.HTML}


class ExtraMissingError(DocumentError):
    """The format needs the documents extra, which is not installed."""

    def __init__(self, path: Path, fmt: Format) -> None:
        super().__init__(f"{path}: {fmt} needs the {EXTRA} extra: pip install 'kvchat[{EXTRA}]'")


def format_of(path: Path) -> Format | None:
    """The format to convert, told by the file's extension."""
    return _SUFFIXES.get(path.suffix.lower())


def sniff(data: bytes) -> Format | None:
    """The format told by the first bytes: PDF's mark, for a PDF named otherwise."""
    return Format.PDF if data.startswith(b"%PDF-") else None


def require_converter(path: Path, fmt: Format) -> None:
    """ExtraMissingError when `fmt` needs the documents extra and it is not installed."""
    try:
        if fmt is Format.PDF:
            import pypdf  # noqa: F401
        elif fmt is Format.DOCX:
            import docx  # noqa: F401
    except ImportError:
        raise ExtraMissingError(path, fmt) from None


def convert(path: Path, data: bytes, fmt: Format) -> str:
    """The text of `data`, a file of format `fmt`."""
    require_converter(path, fmt)
    if fmt is Format.HTML:
        return html_text(decode_text(path, data))
    try:
        return _pdf_text(data) if fmt is Format.PDF else _docx_text(data)
    except Exception as e:  # noqa: BLE001 - the parsers raise many kinds on a damaged file
        raise DocumentError(f"{path}: cannot be read as {fmt} ({e})") from e


def _pdf_text(data: bytes) -> str:
    from pypdf import PdfReader

    reader = PdfReader(io.BytesIO(data))
    if reader.is_encrypted:
        reader.decrypt("")  # many PDFs are encrypted with an empty password, to restrict edits
    pages = [page.extract_text() for page in reader.pages]
    if not any(text.strip() for text in pages):
        return ""  # a scan: images of text, which only OCR reads
    # Page marks let an answer say where it read something.
    return "\n\n".join(f"[page {n}]\n{text}" for n, text in enumerate(pages, 1))


_HEADING = re.compile(r"Heading (\d)")


def _docx_text(data: bytes) -> str:
    import docx
    from docx.table import Table

    lines = []
    for block in docx.Document(io.BytesIO(data)).iter_inner_content():
        if isinstance(block, Table):
            lines += [" | ".join(cell.text for cell in row.cells) for row in block.rows]
        else:
            heading = _HEADING.fullmatch(block.style.name if block.style is not None else "")
            lines.append(("#" * int(heading[1]) + " " if heading else "") + block.text)
    return "\n".join(lines)


_BLOCK_TAGS = frozenset(
    "address article aside blockquote br dd div dl dt figcaption footer form h1 h2 h3 h4 h5 h6 "
    "header hr li main nav ol p pre section table td th title tr ul".split()
)
_HIDDEN_TAGS = frozenset({"script", "style", "noscript", "template"})
_SPACES = re.compile(r"\s+")


class _HtmlText(HTMLParser):
    """Text outside script and style, a line break at each block element, spaces collapsed
    but inside <pre>."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = self.pre = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._enter(tag, 1)

    def handle_endtag(self, tag: str) -> None:
        self._enter(tag, -1)

    def _enter(self, tag: str, step: int) -> None:
        if tag in _HIDDEN_TAGS:
            self.hidden = max(0, self.hidden + step)
        elif tag in _BLOCK_TAGS and self.parts and not self.parts[-1].endswith("\n"):
            self.parts.append("\n")
        if tag == "pre":
            self.pre = max(0, self.pre + step)

    def handle_data(self, data: str) -> None:
        if self.hidden:
            return
        if not self.pre:
            data = _SPACES.sub(" ", data)
            if not self.parts or self.parts[-1].endswith("\n"):
                data = data.lstrip()
        if data:
            self.parts.append(data)


def html_text(html: str) -> str:
    """The text of an HTML page, one line per paragraph, heading or list item."""
    parser = _HtmlText()
    parser.feed(html)
    parser.close()
    lines = [line.rstrip() for line in "".join(parser.parts).splitlines()]
    return "\n".join(lines).strip("\n") + "\n"
