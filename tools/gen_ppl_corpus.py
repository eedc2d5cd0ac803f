#!/usr/bin/env python3
"""The English text of `aerie perplexity`'s accuracy figures
(tests/golden/ppl/corpus.txt), cut from this machine's own documentation:
the GNU gettext manual in Info format, /usr/share/info/gettext.info.gz, as
installed by Debian's package gettext 0.21-12.

Kept: the running prose of chapters 1 ("Introduction"), 2 ("The User's
View"), 12 ("The Translator's View") and 13 ("The Maintainer's View"),
21,386 tokens for SmolLM2's tokenizer. Dropped: Info node headers and
menus, section titles and their underlines, menu leaders ("....."),
footnotes, and every block indented by more than three spaces (examples,
code, tables). Each paragraph is joined onto
one line (single spaces) and paragraphs are separated by one blank line.

  python3 tools/gen_ppl_corpus.py            # rewrite corpus.txt
  python3 tools/gen_ppl_corpus.py --check    # exit 1 if it differs
"""
import argparse
import gzip
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "/usr/share/info/gettext.info.gz"
OUT = ROOT / "tests" / "golden" / "ppl" / "corpus.txt"
CHAPTERS = ["1 Introduction", "2 The User’s View", "12 The Translator’s View",
            "13 The Maintainer’s View"]


def chapter_lines(lines, title):
    """The lines of one chapter: from its title to the next chapter title."""
    start = lines.index(title)
    end = len(lines)
    for i in range(start + 1, len(lines)):
        if re.fullmatch(r"\d+ \S.*", lines[i]) and lines[i + 1].startswith("****"):
            end = i
            break
    return lines[start:end]


def prose(lines):
    """Paragraphs of running text (see the module docstring)."""
    out, block, skip = [], [], False

    def flush():
        if block and not skip:
            first = block[0]
            indent = len(first) - len(first.lstrip(" "))
            if indent <= 3 and not first.lstrip().startswith("*") and not re.match(r"[=*.-]{3,}", block[-1]) \
                    and "....." not in first:
                text = " ".join(l.strip() for l in block)
                out.append(re.sub(r" {2,}", " ", text))
        block.clear()

    for line in lines:
        if line.startswith("\x1f"):
            flush()
            skip = False
            continue
        if "---------- Footnotes ----------" in line:
            flush()
            skip = True
            continue
        if line.startswith("File: ") or line.strip() == "":
            flush()
            continue
        block.append(line)
    flush()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    lines = gzip.open(SOURCE, "rt", encoding="utf-8").read().split("\n")
    paras = []
    for title in CHAPTERS:
        paras += prose(chapter_lines(lines, title))
    text = "\n\n".join(paras) + "\n"
    if args.check:
        sys.exit(0 if OUT.read_text(encoding="utf-8") == text else 1)
    OUT.write_text(text, encoding="utf-8")
    print("%s: %d paragraphs, %d bytes" % (OUT, len(paras), len(text.encode())))


if __name__ == "__main__":
    main()
