#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_chat from tests/golden/chat/cases.json:
each known template joined by a NUL byte to a few message lists."""
import hashlib
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
cases = json.loads((ROOT / "tests/golden/chat/cases.json").read_text())
out = ROOT / "tests/fuzz/corpus/chat"
out.mkdir(parents=True, exist_ok=True)
for old in out.iterdir():
    old.unlink()
for tpl in cases["templates"]:
    for conv in cases["conversations"][:3]:
        blob = tpl["source"].encode() + b"\0" + json.dumps(conv["messages"]).encode()
        (out / hashlib.sha1(blob).hexdigest()[:16]).write_bytes(blob)
print(f"wrote {len(list(out.iterdir()))} seeds to {out.relative_to(ROOT)}")
