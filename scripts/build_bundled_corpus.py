"""Build the bundled Jane Austen corpus from the CSV that Debian's r-cran-janeaustenr exports.

The six novels are in the public domain. Export them once with R::

    apt-get install r-base-core r-cran-janeaustenr
    Rscript -e 'library(janeaustenr); write.csv(austen_books(), "austen.csv", row.names=FALSE)'
    python scripts/build_bundled_corpus.py austen.csv

Each chapter becomes one JSON line ``{"text", "title", "book", "chapter"}``; the front matter before
chapter 1 is dropped. The output is gzip-compressed without a timestamp, so reruns are byte-identical.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import re
from pathlib import Path

CHAPTER = re.compile(r"^\s*CHAPTER\s+([0-9IVXLC]+)\.?\s*$", re.IGNORECASE)
OUTPUT = Path(__file__).resolve().parents[1] / "hyper_parallel/data/assets/corpus/austen_chapters.jsonl.gz"


def chapters(rows: list[tuple[str, str]]):
    """Yield (book, chapter number, text) for each chapter, paragraphs joined by blank lines."""
    book, number, lines = None, 0, []
    for text, row_book in rows:
        if row_book != book:
            if lines and number:
                yield book, number, lines
            book, number, lines = row_book, 0, []
            continue
        if CHAPTER.match(text):
            if lines and number:
                yield book, number, lines
            number, lines = number + 1, []
            continue
        if number:
            lines.append(text)
    if lines and number:
        yield book, number, lines


def paragraphs(lines: list[str]) -> str:
    out, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            out.append(" ".join(current))
            current = []
    return "\n\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv_path", type=Path)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    with args.csv_path.open(newline="", encoding="utf-8") as f:
        rows = [(r["text"], r["book"]) for r in csv.DictReader(f)]
    buffer = io.StringIO()
    count = 0
    for book, number, lines in chapters(rows):
        text = paragraphs(lines)
        if text:
            record = {"text": text, "title": f"{book}, chapter {number}", "book": book, "chapter": number}
            buffer.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
        gz.write(buffer.getvalue().encode("utf-8"))
    print(f"wrote {count} chapters to {args.output}")


if __name__ == "__main__":
    main()
