"""A corrupt model file makes every command exit 2 with one clear line naming
the file, and nothing crashes or leaks (the binary under test is the
ASan/UBSan build, with leak detection on)."""
import struct

import pytest

from conftest import MODEL

COMMANDS = [
    ["info"],
    ["tokenize", "hello"],
    ["detokenize", "1", "2"],
    ["bench-tokenizer", "--repeat", "1", "--file", str(MODEL.parent / ".." / "README.md")],
]


def _patched(data: bytes, offset: int, new: bytes) -> bytes:
    return data[:offset] + new + data[offset + len(new):]


def _variants(data: bytes):
    """(name, bytes) pairs, each a distinct way a file goes bad."""
    size = len(data)
    return [
        ("empty", b""),
        ("text", b"this is not a model\n"),
        ("bad-magic", _patched(data[:4096], 0, b"GGUX")),
        ("version-1", _patched(data[:4096], 4, struct.pack("<I", 1))),
        ("version-99", _patched(data[:4096], 4, struct.pack("<I", 99))),
        ("cut-in-header", data[:20]),
        ("cut-in-metadata", data[:1000]),
        ("cut-in-vocab", data[:400_000]),
        ("cut-in-tensor-data", data[:size - 1]),
        ("absurd-tensor-count", _patched(data, 8, struct.pack("<Q", 1 << 62))),
        ("absurd-kv-count", _patched(data, 16, struct.pack("<Q", 1 << 62))),
    ]


@pytest.fixture(scope="module")
def corrupt_files(tmp_path_factory, model):
    d = tmp_path_factory.mktemp("corrupt")
    data = model.read_bytes()
    out = []
    for name, blob in _variants(data):
        p = d / f"{name}.gguf"
        p.write_bytes(blob)
        out.append(p)
    return out


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c[0])
def test_every_command_rejects_every_corrupt_file(aerie, corrupt_files, cmd):
    for path in corrupt_files:
        r = aerie(cmd[0], "--model", path, *cmd[1:])
        assert r.rc == 2, f"{path.name}: rc={r.rc} err={r.err!r}"
        assert r.out == "", path.name
        lines = r.err.splitlines()
        assert len(lines) == 1, f"{path.name}: {r.err!r}"
        assert lines[0].startswith(f"aerie {cmd[0]}: {path}: "), lines[0]
        assert "Sanitizer" not in r.err and "runtime error" not in r.err


def test_messages_name_the_problem(aerie, corrupt_files):
    by_name = {p.stem: p for p in corrupt_files}
    expect = {
        "bad-magic": "not a GGUF file",
        "version-1": "version 1",
        "cut-in-tensor-data": "past end of file",
        "absurd-tensor-count": "tensor count",
    }
    for name, words in expect.items():
        r = aerie("info", "--model", by_name[name])
        assert words in r.err, r.err


def _json_variants(good: str):
    import json as _json
    doc = _json.loads(good)

    def edited(fn):
        d = _json.loads(good)
        fn(d)
        return _json.dumps(d)

    return [
        ("json-empty", ""),
        ("json-truncated", good[: len(good) // 2]),
        ("json-array", "[1, 2, 3]"),
        ("json-wordpiece", edited(lambda d: d["model"].update(type="WordPiece"))),
        ("json-no-merges", edited(lambda d: d["model"].pop("merges"))),
        ("json-merge-of-unknown-token", edited(lambda d: d["model"]["merges"].insert(0, "qqqq zzzz"))),
        ("json-unknown-pre-tokenizer", edited(lambda d: d.update(pre_tokenizer={"type": "Whitespace"}))),
        ("json-negative-id", edited(lambda d: d["model"]["vocab"].update({"Ġthe": -5}))),
    ] if doc else []


@pytest.mark.parametrize("cmd", COMMANDS[1:], ids=lambda c: c[0])
def test_every_command_rejects_every_corrupt_tokenizer_json(aerie, tmp_path, cmd):
    from conftest import GOLDEN
    good = (GOLDEN / "tokenizer" / "smollm" / "tokenizer.json").read_text(encoding="utf-8")
    for name, text in _json_variants(good):
        path = tmp_path / name / "tokenizer.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
        r = aerie(cmd[0], "--model", path, *cmd[1:])
        assert r.rc == 2, f"{name}: rc={r.rc} err={r.err!r}"
        lines = r.err.splitlines()
        assert len(lines) == 1, f"{name}: {r.err!r}"
        assert lines[0].startswith(f"aerie {cmd[0]}: {path}: "), lines[0]
        assert "Sanitizer" not in r.err and "runtime error" not in r.err


def test_unsupported_tokenizer_named_once_and_info_still_reports(aerie, model, tmp_path):
    data = model.read_bytes()
    key = b"tokenizer.ggml.pre"
    at = data.index(key) + len(key) + 4 + 8  # value type (u32), string length (u64)
    assert data[at:at + 6] == b"smollm"
    path = tmp_path / "bad-pre.gguf"
    path.write_bytes(data[:at] + b"smollx" + data[at + 6:])
    r = aerie("tokenize", "--model", path, "hi")
    assert r.rc == 2
    assert r.err.startswith(f"aerie tokenize: {path}: ")
    assert r.err.count(str(path)) == 1 and r.err.count("\n") == 1, r.err
    assert '"smollx"' in r.err
    info = aerie("info", "--model", path, "--json")
    assert info.rc == 0, info.err
    tk = info.json()["tokenizer"]
    assert tk["model"] == "gpt2"
    assert "smollx" in tk["error"] and "pre" not in tk
    assert info.json()["layers"] == 30


def _patched_u32(data: bytes, key: bytes, value: int) -> bytes:
    at = data.index(key) + len(key)
    assert struct.unpack("<I", data[at:at + 4])[0] in (4, 6)  # u32 or f32
    return data[:at + 4] + struct.pack("<I", value) + data[at + 8:]


@pytest.mark.parametrize("key,value,message", [
    (b"llama.context_length", 0, "key llama.context_length: 0 is outside 1..2147483647"),
    (b"llama.attention.layer_norm_rms_epsilon", 0xBF800000,  # -1.0f
     "key llama.attention.layer_norm_rms_epsilon: -1 is outside 0..1"),
])
def test_generate_refuses_impossible_model_values(aerie, model, tmp_path, key, value, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(_patched_u32(model.read_bytes(), key, value))
    r = aerie("generate", "--model", path, "--prompt", "hi", "--max-tokens", "2")
    assert r.rc == 2, r.err
    assert r.err == f"aerie generate: {path}: {message}\n"
