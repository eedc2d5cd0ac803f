"""`aerie tokenize` reproduces the Hugging Face `tokenizers` library's ids on
the golden corpus (tests/golden/tokenizer/corpus.jsonl, made by
tools/gen_tokenizer_golden.py), for SmolLM2 loaded from its GGUF file and
from a tokenizer.json. Each text goes through --file, so texts that start
with "-" or hold control bytes are passed exactly: all of those go through
the command, and every 6th of the others (a process each; the unit suite
tests/unit/test_tokenizer.c checks every text in one process)."""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import GOLDEN

CORPUS = [json.loads(line) for line in
          (GOLDEN / "tokenizer" / "corpus.jsonl").read_text(encoding="utf-8").split("\n") if line]


def awkward(text):
    return text.startswith("-") or any(ord(c) < 32 and c not in "\n\t" for c in text)


SAMPLE = [i for i, row in enumerate(CORPUS) if awkward(row["text"]) or i % 6 == 0]


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 300
    assert len(SAMPLE) >= 150


@pytest.mark.parametrize("source", ["gguf", "tokenizer.json"])
def test_cli_matches_reference_on_the_sampled_corpus(aerie, model, tmp_path, source):
    path = model if source == "gguf" else GOLDEN / "tokenizer" / "smollm" / "tokenizer.json"

    def check(i):
        f = tmp_path / f"{i}.txt"
        f.write_bytes(CORPUS[i]["text"].encode("utf-8"))
        r = aerie("tokenize", "--model", path, "--file", f)
        assert r.rc == 0, r.err
        return json.loads(r.out) == CORPUS[i]["smollm"]

    with ThreadPoolExecutor(max_workers=2) as pool:
        ok = list(pool.map(check, SAMPLE))
    mismatched = [CORPUS[i]["text"][:60] for i, good in zip(SAMPLE, ok) if not good]
    print(f"corpus: {len(SAMPLE) - len(mismatched)}/{len(SAMPLE)} sampled texts match ({source})")
    assert mismatched == []
