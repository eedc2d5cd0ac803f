#!/usr/bin/env python3
"""Openings of user turns for `aerie gen-prompts --seeds`, so that the
prompts the model writes for itself cover many tasks and topics.

    make_seeds.py harvest > tools/prompts/tools.txt
        Programs of this machine and what they do, one "NAME<TAB>SUMMARY" a
        line: the one-line summaries of the installed Debian packages
        (dpkg-query) and the NAME lines of the English manual pages in
        sections 1 and 8. The list is committed, so a run does not depend
        on the machine it runs on.
    make_seeds.py seeds --count N --out FILE [--seed S]
        N openings, one {"prompt": TEXT} a line: the task openings of
        tools/prompts/tasks.txt filled with the topics of topics.txt
        (everyday life) and tools.txt (programs), in a shuffled order.

    make_seeds.py merge --out FILE --exclude HELDOUT PART.jsonl...
        The prompts of gen-prompts' parts as one file: in order, each text
        once (case and spacing aside), none that contains a held-out prompt.

Each opening is the start of the user's text; gen-prompts lets the model
write the rest at temperature, so one opening yields many different turns.
"""
import argparse
import gzip
import json
import random
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent / "prompts"


def clean_summary(s):
    s = re.sub(r"\\f[BIRP]|\\-|\\\(..|\\&", lambda m: "-" if m.group(0) == "\\-" else "", s)
    s = re.sub(r"\s+", " ", s).strip().rstrip(".")
    return s


def good(name, summary):
    return (re.fullmatch(r"[a-z][a-z0-9+._-]{1,30}", name) is not None and 10 <= len(summary) <= 80
            and re.fullmatch(r"[A-Za-z0-9 ,.()/'+:_-]+", summary) is not None)


def harvest():
    found = {}
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Package}\t${binary:Summary}\n"], capture_output=True,
                         text=True).stdout
    for line in out.splitlines():
        name, _, summary = line.partition("\t")
        name = name.split(":")[0]
        summary = clean_summary(summary)
        if good(name, summary) and not name.startswith(("lib", "python3-", "fonts-", "linux-")):
            found.setdefault(name, summary)
    for section in ("man1", "man8"):
        for p in sorted(Path("/usr/share/man", section).glob("*.gz")):
            try:
                text = gzip.open(p, "rt", errors="replace").read(4000)
            except OSError:
                continue
            m = re.search(r"^\.SH\s+\"?NAME\"?\s*\n(.+?)\n", text, re.M)
            if not m:
                continue
            line = re.sub(r"^\.(Nm|Nd)\s*", "", m.group(1))
            name, sep, summary = line.partition(" \\- ")
            name, summary = clean_summary(name.split(",")[0]), clean_summary(summary)
            if sep and good(name, summary):
                found.setdefault(name, summary)
    for name in sorted(found):
        print(f"{name}\t{found[name]}")


def lines(path):
    return [x for x in path.read_text().splitlines() if x.strip() and not x.startswith("#")]


def seeds(args):
    tasks = [x.split("\t", 1) for x in lines(HERE / "tasks.txt")]
    life = lines(HERE / "topics.txt")
    tools = [x.split("\t", 1) for x in lines(HERE / "tools.txt")]
    rng = random.Random(args.seed)
    out = []
    while len(out) < args.count:
        kind, text = rng.choice(tasks)
        if kind == "life":
            text = text.replace("{topic}", rng.choice(life))
        elif kind == "tool":
            name, what = rng.choice(tools)
            text = text.replace("{topic}", name).replace("{what}", what[0].lower() + what[1:])
        out.append(text)
    with open(args.out, "w") as f:
        for t in out:
            f.write(json.dumps({"prompt": t}, ensure_ascii=False) + "\n")
    print(f"make_seeds: {len(out)} openings ({len(set(out))} distinct) from {len(tasks)} tasks, {len(life)} "
          f"everyday topics and {len(tools)} programs", file=sys.stderr)


def norm(t):
    return " ".join(t.lower().split())


def merge(args):
    held = [norm(json.loads(x)["prompt"]) for x in Path(args.exclude).read_text().splitlines() if x.strip()]
    seen, kept, dropped = set(), [], 0
    for part in args.parts:
        for line in Path(part).read_text().splitlines():
            t = json.loads(line)["prompt"]
            n = norm(t)
            if n in seen or any(h in n for h in held):
                dropped += 1
                continue
            seen.add(n)
            kept.append(t)
    tmp = Path(args.out + ".tmp")
    tmp.write_text("".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\n" for t in kept))
    tmp.replace(args.out)
    print(f"make_seeds: {len(kept)} prompts from {len(args.parts)} parts ({dropped} repeated or held out)",
          file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("harvest")
    s = sub.add_parser("seeds")
    s.add_argument("--count", type=int, required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=1)
    m = sub.add_parser("merge")
    m.add_argument("--out", required=True)
    m.add_argument("--exclude", required=True)
    m.add_argument("parts", nargs="+")
    a = ap.parse_args()
    {"harvest": lambda _: harvest(), "seeds": seeds, "merge": merge}[a.cmd](a)


if __name__ == "__main__":
    main()
