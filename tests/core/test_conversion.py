"""PDF, DOCX and HTML read as their text, from real files the libraries (or the test) write;
without the documents extra, one line that names it."""

from __future__ import annotations

import sys
from pathlib import Path

import docx
import pytest

from kvchat.core.documents import DocumentError
from kvchat.core.sources import check_sources, read_sources


def minimal_pdf(pages: list[str]) -> bytes:
    """A PDF with one line of Helvetica text per page, written out by hand, offsets and all."""
    objects = {
        1: b"<< /Type /Catalog /Pages 2 0 R >>",
        3: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    }
    kids = []
    for i, text in enumerate(pages):
        page, content = 4 + 2 * i, 5 + 2 * i
        stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
        objects[page] = (
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % content
        )
        objects[content] = b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream)
        kids.append(b"%d 0 R" % page)
    objects[2] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (b" ".join(kids), len(pages))
    out = bytearray(b"%PDF-1.4\n")
    offsets = {}
    for number in sorted(objects):
        offsets[number] = len(out)
        out += b"%d 0 obj\n%s\nendobj\n" % (number, objects[number])
    xref, size = len(out), len(objects) + 1
    out += b"xref\n0 %d\n0000000000 65535 f \n" % size
    out += b"".join(b"%010d 00000 n \n" % offsets[n] for n in range(1, size))
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (size, xref)
    return bytes(out)


def write_docx(path: Path) -> Path:
    document = docx.Document()
    document.add_heading("Tern Rock light", level=1)
    document.add_paragraph("The lamp is lit at 18:02.")
    table = document.add_table(rows=2, cols=2)
    for row, cells in zip(table.rows, [("keeper", "watch"), ("Ada Fenwick", "noon")], strict=True):
        for cell, text in zip(row.cells, cells, strict=True):
            cell.text = text
    document.save(str(path))
    return path


PAGE = """<!doctype html><html><head><title>Tern Rock</title>
<style>p { color: red }</style><script>alert("never shown")</script></head>
<body><h1>Tern   Rock
light</h1><p>The lamp is lit at <b>18:02</b> &amp; put out at dawn.</p>
<ul><li>Ada</li><li>Tom</li></ul><pre>  indented
    code</pre></body></html>"""


def test_a_pdf_is_read_as_its_text_page_by_page(tmp_path: Path) -> None:
    path = tmp_path / "report.pdf"
    path.write_bytes(minimal_pdf(["The lamp is lit at 18:02.", "Ada Fenwick keeps it."]))
    doc = read_sources([path])
    assert doc.text == "[page 1]\nThe lamp is lit at 18:02.\n\n[page 2]\nAda Fenwick keeps it."
    assert doc.name == "report.pdf" and doc.size_bytes == path.stat().st_size


def test_a_pdf_without_its_extension_is_told_by_its_first_bytes(tmp_path: Path) -> None:
    path = tmp_path / "download"
    path.write_bytes(minimal_pdf(["Told by %PDF-."]))
    assert "Told by %PDF-." in read_sources([path]).text


def test_a_pdf_without_text_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "scan.pdf"
    path.write_bytes(minimal_pdf([""]))
    with pytest.raises(DocumentError, match=r"scan\.pdf: holds no text \(a scan"):
        read_sources([path])


def test_a_damaged_pdf_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.pdf"
    path.write_bytes(b"%PDF-1.4\nthis is no PDF\n")
    with pytest.raises(DocumentError, match=r"broken\.pdf: cannot be read as PDF"):
        read_sources([path])


def test_a_docx_is_read_as_its_text(tmp_path: Path) -> None:
    doc = read_sources([write_docx(tmp_path / "notes.docx")])
    assert doc.text == (
        "# Tern Rock light\nThe lamp is lit at 18:02.\nkeeper | watch\nAda Fenwick | noon"
    )


def test_an_html_file_is_read_as_its_text(tmp_path: Path) -> None:
    path = tmp_path / "page.html"
    path.write_text(PAGE)
    assert read_sources([path]).text == (
        "Tern Rock\n"
        "Tern Rock light\n"
        "The lamp is lit at 18:02 & put out at dawn.\n"
        "Ada\n"
        "Tom\n"
        "  indented\n"
        "    code\n"
    )


def test_in_a_folder_pdf_and_docx_are_converted_and_html_is_source(tmp_path: Path) -> None:
    (tmp_path / "report.pdf").write_bytes(minimal_pdf(["Page text."]))
    write_docx(tmp_path / "notes.docx")
    (tmp_path / "page.html").write_text(PAGE)
    doc = read_sources([tmp_path])
    assert doc.files == ("notes.docx", "page.html", "report.pdf")
    assert "==> report.pdf <==\n[page 1]\nPage text." in doc.text
    assert "==> notes.docx <==\n# Tern Rock light" in doc.text
    assert "==> page.html <==\n<!doctype html>" in doc.text


@pytest.mark.parametrize(
    ("module", "name", "fmt"), [("pypdf", "report.pdf", "PDF"), ("docx", "notes.docx", "DOCX")]
)
def test_without_the_extra_one_line_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, name: str, fmt: str
) -> None:
    (tmp_path / "report.pdf").write_bytes(minimal_pdf(["Page text."]))
    write_docx(tmp_path / "notes.docx")
    (tmp_path / "a.txt").write_text("A")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, module, None)  # the extra is not installed: import fails
    message = f"{name}: {fmt} needs the documents extra: pip install 'kvchat[documents]'"
    with pytest.raises(DocumentError) as e:
        check_sources([name])  # refused before anything is read
    assert str(e.value) == message
    with pytest.raises(DocumentError) as e:
        read_sources([name])
    assert str(e.value) == message
    # In a folder the file is left out, and the reason says what would read it.
    reasons = {s.path: s.reason for s in read_sources([Path(".")]).skipped}
    assert reasons == {name: "needs the documents extra"}
