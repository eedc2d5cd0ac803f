"""`tokenize --chat` renders with the model's own template (checked against
jinja2 output in tests/golden/chat) and tokenizes the result; `info` reads a
Hugging Face model directory."""
import json
import shutil
import struct

from conftest import GOLDEN


def _smollm2_cases():
    cases = json.loads((GOLDEN / "chat" / "cases.json").read_text())
    convs = {c["name"]: c["messages"] for c in cases["conversations"]}
    return [(convs[c["conversation"]], c["expected"]) for c in cases["cases"]
            if c["template"] == "smollm2" and c["add_generation_prompt"]]


def test_chat_ids_are_the_ids_of_the_jinja_rendered_prompt(aerie, model):
    cases = _smollm2_cases()
    assert len(cases) == 13
    for messages, rendered in cases:
        chat = aerie("tokenize", "--model", model, "--chat", json.dumps(messages))
        assert chat.rc == 0, chat.err
        plain = aerie("tokenize", "--model", model, rendered)
        assert chat.out == plain.out, messages


def test_chat_default_system_prompt_is_the_templates(aerie, model):
    r = aerie("tokenize", "--model", model, "--chat", '[{"role":"user","content":"Hi"}]')
    ids = r.json()
    text = aerie("detokenize", "--model", model, *ids).out
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
                    "trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n\n")
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|>, two <|im_end|>


def test_bad_chat_json_names_the_element(aerie, model):
    r = aerie("tokenize", "--model", model, "--chat", '[{"role":"user","content":"a"},{"role":7}]')
    assert r.rc == 2
    assert r.err.startswith("aerie tokenize: messages[1].role: ")
    assert r.err.count("\n") == 1


def _write_safetensors(path, tensors):
    """tensors: name -> (dtype, shape, raw bytes)."""
    header, offset, blobs = {}, 0, []
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_info_reads_a_hugging_face_directory(aerie, tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 49152,
              "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 2048,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _write_safetensors(tmp_path / "model.safetensors", {
        "model.norm.weight": ("F32", [8], struct.pack("<8f", *range(8))),
        "model.layers.0.mlp.up_proj.weight": ("BF16", [16, 8], b"\0\0" * 128),
    })
    shutil.copy(GOLDEN / "tokenizer" / "smollm" / "tokenizer.json", tmp_path)
    r = aerie("info", "--model", tmp_path, "--json")
    assert r.rc == 0, r.err
    info = r.json()
    assert info["format"] == "safetensors"
    assert (info["layers"], info["hidden_size"], info["heads"], info["kv_heads"],
            info["head_dim"], info["vocab_size"]) == (2, 8, 2, 1, 4, 49152)
    assert info["tensors"] == 2 and info["parameters"] == 8 + 128
    assert info["tensor_types"] == {"BF16": {"count": 1, "bytes": 256},
                                    "F32": {"count": 1, "bytes": 32}}
    assert info["tokenizer"]["pre"] == "smollm" and info["tokenizer"]["tokens"] == 49152


def test_corrupt_safetensors_directory_exits_2(aerie, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    r = aerie("info", "--model", tmp_path)
    assert r.rc == 2 and r.err.count("\n") == 1
    assert r.err.startswith(f"aerie info: {tmp_path}/config.json: ")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update({"intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "vocab_size": 10, "rms_norm_eps": 1e-6})
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    r = aerie("info", "--model", tmp_path)
    assert r.rc == 2 and r.err.count("\n") == 1
    assert r.err.startswith(f"aerie info: {tmp_path}/model.safetensors: ")
