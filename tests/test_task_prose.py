"""Human prose documents for the task prompts (distill.task_prose): prose filter, grouping, licences."""

from __future__ import annotations

import gzip

from distill import task_prose

PROSE = ("The quick brown fox jumps over the lazy dog while the farmer watches from the porch. "
         "Later that day the farmer writes a long letter to his sister about the clever fox.")


def test_prose_filter_keeps_running_text_and_drops_code_and_tables():
    assert task_prose.is_prose_paragraph(PROSE)
    assert task_prose.is_prose_paragraph("A [link](http://x.y) and *emphasis* are cleaned. " + PROSE)
    assert not task_prose.is_prose_paragraph("    x = compute(y)\n    return x " + PROSE)  # indented code
    assert not task_prose.is_prose_paragraph(">>> print(1) " + PROSE)
    assert not task_prose.is_prose_paragraph("| a | b |\n| 1 | 2 | " + PROSE)
    assert not task_prose.is_prose_paragraph("Too short.")
    assert not task_prose.is_prose_paragraph(PROSE.rstrip("."))  # no sentence end
    assert task_prose.clean("See [the docs][ref] and `f` **now**.") == "See the docs and f now."


def test_documents_group_prose_paragraphs_within_the_size_bounds():
    text = "\n\n".join([PROSE] * 40 + ["    code_block()"] + [PROSE] * 5)
    docs = task_prose.documents_from_text(text, "Fox", "src", "MIT")
    assert docs and all(task_prose.MIN_DOC_CHARS <= len(d["text"]) <= task_prose.MAX_DOC_CHARS for d in docs)
    assert all(d["title"] == "Fox" and d["licence"] == "MIT" and "code_block" not in d["text"] for d in docs)
    assert task_prose.documents_from_text(PROSE, "Fox", "src", "MIT") == []  # shorter than MIN_DOC_CHARS


def test_debian_docs_need_a_dep5_licence(tmp_path):
    for pkg, copyright_text in (("good", "Format: x\n\nFiles: *\nLicense: GPL-2+\n"), ("bad", "no licence here\n")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "copyright").write_text(copyright_text)
        with gzip.open(tmp_path / pkg / "README.gz", "wt") as f:
            f.write("\n\n".join([PROSE] * 8))
    docs = task_prose.debian_docs(str(tmp_path))
    assert docs and {d["title"] for d in docs} == {"good"} and {d["licence"] for d in docs} == {"GPL-2+"}
    summary = task_prose.source_summary(docs)
    assert summary["debian-doc"]["num_documents"] == len(docs) and summary["debian-doc"]["licences"] == ["GPL-2+"]


def test_collected_prose_has_sources_and_licences():
    docs = task_prose.collect_prose()  # the Python reference topics exist wherever Python does
    assert len(docs) >= 10 and len({d["text"] for d in docs}) == len(docs)
    assert all(d["licence"] and d["source"] and d["title"] for d in docs)
    assert task_prose.source_summary(docs)["python-reference"]["licences"] == [task_prose.PSF_LICENCE]
