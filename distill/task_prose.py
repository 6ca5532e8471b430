"""Human-written English prose documents for summarization / RAG / QA task prompts (draft round 3).

Spec-Bench's document tasks use news articles (CNN/DailyMail) and Wikipedia passages (Natural
Questions); the target's own chat answers (round 2's documents) read differently. This module
collects human prose that every machine of this project carries, with its licence, never from a
model hub and never from Spec-Bench:

- ``python-reference``: the Python language reference topics of ``pydoc_data.topics``
  (PSF-2.0 licence);
- ``vim-user-manual``: ``/usr/share/vim/vim*/doc/*.txt``, user manual and help (Vim licence, ``:help license``);
- ``pypi-metadata``: long descriptions of the installed packages' ``*.dist-info/METADATA``
  (each document records the package's ``License``/``License-Expression``; packages without one
  are skipped);
- ``debian-doc``: ``/usr/share/doc/<package>/README*`` and ``NEWS*`` (``.gz`` too; the first
  ``License:`` of ``/usr/share/doc/<package>/copyright``; packages without one are skipped);
- ``cmake-help``: ``/usr/share/cmake-*/Help/manual/*.rst`` (BSD-3-Clause);
- ``nodejs-api``: ``/usr/share/doc/nodejs/api/*.md`` (MIT, ``/usr/share/doc/nodejs/LICENSE``).

Only prose paragraphs are kept (:func:`is_prose_paragraph`: no code, tables or markup); the
consecutive prose paragraphs of one file form documents of ``MIN_DOC_CHARS``-``MAX_DOC_CHARS``
characters. Each document: ``{"title", "text", "source", "licence", "kind"}``.
"""

from __future__ import annotations

import glob
import gzip
import os
import re
import sys
import sysconfig
from email.parser import Parser

MIN_PARAGRAPH_CHARS = 120
MIN_PARAGRAPH_WORDS = 20
MIN_DOC_CHARS = 600
MAX_DOC_CHARS = 4000
MIN_LETTER_SHARE = 0.8
CODE_CHARS = re.compile(r"(::=|>>>|\$ |[{}<>\\]|\.\.\s*\w+::|^\s*[-*+#|]|\w\(|\w\.\w+\(| = |==|~~~|---|\*\*\*)", re.MULTILINE)
INLINE_MARKUP = ((re.compile(r"\[([^\]]+)\]\([^)]*\)"), r"\1"), (re.compile(r"\[([^\]]+)\]\[[^\]]*\]"), r"\1"), (re.compile(r":\w+:`([^`<]+)[^`]*`"), r"\1"),
                 (re.compile(r"[`*]+"), ""), (re.compile(r"\|[\w-]+\|"), ""), (re.compile(r"\s+"), " "))
VIM_LICENCE = "Vim licence (:help license)"
PSF_LICENCE = "PSF-2.0"
CMAKE_LICENCE = "BSD-3-Clause"
NODE_LICENCE = "MIT (Node.js licence, /usr/share/doc/nodejs/LICENSE)"


def clean(text: str) -> str:
    """Inline markdown / reST / vim-help markup removed and whitespace collapsed."""
    for pattern, repl in INLINE_MARKUP:
        text = pattern.sub(repl, text)
    return text.strip()


def is_prose_paragraph(raw: str) -> bool:
    """True for a block of running text: unindented lines, no code/table/markup characters, at
    least ``MIN_PARAGRAPH_WORDS`` words and ``MIN_PARAGRAPH_CHARS`` chars, mostly letters, ending a sentence."""
    lines = raw.split("\n")
    if any(line.startswith(("  ", "\t")) for line in lines) or CODE_CHARS.search(raw):
        return False
    text = clean(raw)
    letters = sum(c.isalpha() or c.isspace() for c in text)
    return (len(text) >= MIN_PARAGRAPH_CHARS and len(text.split()) >= MIN_PARAGRAPH_WORDS
            and letters >= MIN_LETTER_SHARE * len(text) and text[-1] in ".!?")


def documents_from_text(text: str, title: str, source: str, licence: str, kind: str = "other") -> list[dict]:
    """The prose paragraphs (blank-line separated) of ``text`` in order, grouped into documents of
    ``MIN_DOC_CHARS``-``MAX_DOC_CHARS`` chars; non-prose blocks (code, tables, lists) are skipped."""
    docs, run = [], []

    def flush() -> None:
        if sum(map(len, run)) >= MIN_DOC_CHARS:
            docs.append({"title": title, "text": "\n\n".join(run), "source": source, "licence": licence, "kind": kind})
        run.clear()

    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        block = block.strip("\n")
        if not is_prose_paragraph(block):
            continue
        paragraph = clean(block)
        if sum(map(len, run)) + len(paragraph) > MAX_DOC_CHARS:
            flush()
        run.append(paragraph)
    flush()
    return docs


def python_reference() -> list[dict]:
    """Documents of the Python language reference topics (``pydoc_data.topics``)."""
    from pydoc_data.topics import topics
    out = []
    for name, text in sorted(topics.items()):
        heading = text.split("\n", 1)[0].strip() or name
        out += documents_from_text(text, heading.replace('"', ""), f"pydoc_data.topics[{name!r}]", PSF_LICENCE,
                                   "python-reference")
    return out


def vim_user_manual(pattern: str = "/usr/share/vim/vim*/doc/*.txt") -> list[dict]:
    """Documents of the Vim user manual and help files (title: the user-manual chapter name, else the file)."""
    out = []
    for path in sorted(glob.glob(pattern)):
        text = _read(path)
        head = [line.strip() for line in text.split("\n")[1:8] if line.strip()]
        title = head[1] if len(head) > 1 and "USER MANUAL" in head[0] else os.path.basename(path)
        out += documents_from_text(text, title, path, VIM_LICENCE, "vim-user-manual")
    return out


def pypi_metadata(site_dir: str | None = None) -> list[dict]:
    """Documents of installed packages' long descriptions; title ``name: summary``."""
    site_dir = site_dir or sysconfig.get_paths()["purelib"]
    out = []
    for path in sorted(glob.glob(os.path.join(site_dir, "*.dist-info", "METADATA"))):
        msg = Parser().parsestr(_read(path))
        licence = (msg.get("License-Expression") or msg.get("License") or "").split("\n")[0].strip()
        if not licence or len(licence) > 60:
            classifiers = [c.split("::")[-1].strip() for c in msg.get_all("Classifier") or [] if c.startswith("License")]
            licence = classifiers[0] if classifiers else ""
        if licence and msg.get("Name"):
            title = f"{msg['Name']}: {msg.get('Summary', '').strip()}".rstrip(": ")
            out += documents_from_text(msg.get_payload() or "", title, path, licence, "pypi-metadata")
    return out


def debian_docs(root: str = "/usr/share/doc") -> list[dict]:
    """Documents of ``<root>/<package>/README*`` / ``NEWS*`` of packages with a DEP-5 licence."""
    out = []
    for pkg_dir in sorted(glob.glob(os.path.join(root, "*"))):
        licence = _copyright_licence(os.path.join(pkg_dir, "copyright"))
        if not licence:
            continue
        for path in sorted(glob.glob(os.path.join(pkg_dir, "README*")) + glob.glob(os.path.join(pkg_dir, "NEWS*"))):
            if "Debian" not in path and os.path.isfile(path):
                out += documents_from_text(_read(path), os.path.basename(pkg_dir), path, licence, "debian-doc")
    return out


def nodejs_api(pattern: str = "/usr/share/doc/nodejs/api/*.md") -> list[dict]:
    """Documents of the Node.js API documentation (title: the module, e.g. ``fs``)."""
    licence_file = os.path.join(os.path.dirname(os.path.dirname(pattern)), "LICENSE")
    if not os.path.exists(licence_file):
        return []
    return [doc for path in sorted(glob.glob(pattern)) for doc in documents_from_text(
        _read(path), "Node.js " + os.path.basename(path)[:-3], path, NODE_LICENCE, "nodejs-api")]


def cmake_help(pattern: str = "/usr/share/cmake-*/Help/manual/*.rst") -> list[dict]:
    """Documents of the CMake manuals (title from the file name, e.g. ``cmake buildsystem``)."""
    out = []
    for path in sorted(glob.glob(pattern)):
        title = re.sub(r"\.\d+\.rst$", "", os.path.basename(path)).replace("-", " ")
        out += documents_from_text(_read(path), title, path, CMAKE_LICENCE, "cmake-help")
    return out


def collect_prose() -> list[dict]:
    """All sources above, deduplicated by text, in a fixed order."""
    seen, out = set(), []
    for maker in (python_reference, vim_user_manual, pypi_metadata, debian_docs, cmake_help, nodejs_api):
        for doc in maker():
            if doc["text"] not in seen:
                seen.add(doc["text"])
                out.append(doc)
    return out


def source_summary(docs: list[dict]) -> dict[str, dict]:
    """Per source kind: number of documents, characters and the licences seen."""
    out: dict[str, dict] = {}
    for doc in docs:
        kind = doc.get("kind", "other")
        row = out.setdefault(kind, {"num_documents": 0, "num_chars": 0, "licences": set()})
        row["num_documents"] += 1
        row["num_chars"] += len(doc["text"])
        row["licences"].add(doc["licence"])
    return {k: {**v, "licences": sorted(v["licences"])} for k, v in out.items()}


def _read(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _copyright_licence(path: str) -> str:
    """First ``License:`` value of a DEP-5 copyright file ('' when absent or not DEP-5)."""
    match = re.search(r"^License:[ \t]*(\S[^\n]*)$", _read(path), re.MULTILINE) if os.path.exists(path) else None
    return match.group(1).strip() if match else ""


if __name__ == "__main__":
    prose = collect_prose()
    print({k: (v["num_documents"], v["num_chars"]) for k, v in source_summary(prose).items()}, file=sys.stderr)
