"""Offline, licence-recorded text for the synthetic task prompts (``distill.task_prompts``).

Collected from files every Debian/Ubuntu system carries, never from a model hub or Spec-Bench:

- German sentences with their English source: GNU gettext catalogs
  ``/usr/share/locale/de/LC_MESSAGES/*.mo`` (and ``/usr/share/vim/*/lang/de/...``); each
  package's licence is in ``/usr/share/doc/<package>/copyright`` (mostly GPL/LGPL, PostgreSQL,
  Vim licence). Only the German ``msgstr`` is used as a source text to translate.
- Country names: tz database ``/usr/share/zoneinfo/iso3166.tab`` (public domain).
- Cities and their country codes: tz database ``/usr/share/zoneinfo/zone1970.tab`` (public domain).
- English prose documents with their licences: ``distill.task_prose`` (Python reference, Vim
  manual, package descriptions, Debian READMEs, CMake and Node.js manuals).

``python -m distill.task_corpus --out corpus.json[.gz]`` writes the JSON that ``minedraft distill
--task-corpus`` reads (a machine without these files gets the corpus as a file).
"""

from __future__ import annotations

import argparse
import glob
import gettext
import gzip
import json
import os
import re
import sys

MO_GLOBS = ("/usr/share/locale/de/LC_MESSAGES/*.mo", "/usr/share/vim/*/lang/de/LC_MESSAGES/*.mo")
ISO3166_TAB = "/usr/share/zoneinfo/iso3166.tab"
ZONE1970_TAB = "/usr/share/zoneinfo/zone1970.tab"
MIN_SENTENCE_CHARS = 40
MAX_SENTENCE_CHARS = 400
MIN_SENTENCE_SPACES = 5
MARKUP = re.compile(r"[{}<>$\\_=%]")


def is_prose(text: str) -> bool:
    """True for a one-line sentence of 40-400 chars with >= 5 spaces and no format/markup chars."""
    return (MIN_SENTENCE_CHARS <= len(text) <= MAX_SENTENCE_CHARS and text.count(" ") >= MIN_SENTENCE_SPACES
            and "\n" not in text and not MARKUP.search(text))


def german_sentences(patterns=MO_GLOBS) -> list[dict]:
    """``[{"de", "package"}]`` prose msgstr entries of German gettext catalogs, deduplicated, sorted."""
    out: dict[str, str] = {}
    for path in sorted(p for pattern in patterns for p in glob.glob(pattern)):
        try:
            with open(path, "rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog
        except (OSError, UnicodeDecodeError, ValueError):
            continue  # unreadable or non-UTF-8 catalog: skipped
        for key, value in catalog.items():
            if isinstance(key, str) and key and isinstance(value, str) and is_prose(value.strip()):
                out.setdefault(value.strip(), os.path.basename(path)[:-3])
    return [{"de": de, "package": pkg} for de, pkg in sorted(out.items())]


def countries(path: str = ISO3166_TAB) -> dict[str, str]:
    """ISO 3166 code -> country name from the tz database (empty if the file is absent)."""
    if not os.path.exists(path):
        return {}
    rows = [line.rstrip("\n").split("\t") for line in open(path, encoding="utf-8") if not line.startswith("#")]
    return {r[0]: r[1] for r in rows if len(r) >= 2}


def cities(path: str = ZONE1970_TAB, names: dict[str, str] | None = None) -> list[dict]:
    """``[{"city", "country"}]`` from tz zone names (``Europe/Berlin`` -> Berlin), first code's country."""
    names = countries() if names is None else names
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path, encoding="utf-8"):
        parts = line.rstrip("\n").split("\t")
        if line.startswith("#") or len(parts) < 3:
            continue
        city = parts[2].split("/")[-1].replace("_", " ")
        country = names.get(parts[0].split(",")[0])
        if country and not city.startswith("GMT"):
            out.append({"city": city, "country": country})
    return out


def collect() -> dict:
    """The whole corpus: ``{"german", "countries", "cities", "prose": [...], "sources": {...}}``."""
    from distill import task_prose
    names = countries()
    prose = task_prose.collect_prose()
    return {"german": german_sentences(), "countries": sorted(set(names.values())), "cities": cities(names=names),
            "prose": prose, "prose_sources": task_prose.source_summary(prose),
            "sources": {"german": "gettext catalogs " + ", ".join(MO_GLOBS) + " (licences: /usr/share/doc/<pkg>/copyright)",
                        "countries": ISO3166_TAB + " (tz database, public domain)",
                        "cities": ZONE1970_TAB + " (tz database, public domain)",
                        "prose": "distill.task_prose (per-document source + licence; per kind in prose_sources)"}}


def main(argv: list[str] | None = None) -> int:
    """CLI: write the corpus JSON and print its sizes."""
    ap = argparse.ArgumentParser(description="collect the offline task-prompt corpus")
    ap.add_argument("--out", required=True)
    corpus = collect()
    out = ap.parse_args(argv).out
    with (gzip.open if out.endswith(".gz") else open)(out, "wt", encoding="utf-8") as f:
        json.dump(corpus, f, ensure_ascii=False)
    print({k: len(v) for k, v in corpus.items() if k not in ("sources", "prose_sources")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
