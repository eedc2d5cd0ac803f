#!/usr/bin/env python3
"""GGUF files of the tiny DeepSeek-V3 model (tests/golden/tiny/deepseek, made
by tools/gen_tiny_golden.py), written by llama.cpp's own converter, so that
Aerie's reader of llama.cpp's `deepseek2` architecture is tested against
what llama.cpp writes rather than against our reading of it.

Writes tests/golden/tiny/:
  deepseek.gguf      convert_hf_to_gguf.py --outtype f32 on the Hugging Face
                     directory: W_UK and W_UV apart (attn_k_b, attn_v_b),
                     the experts stacked (ffn_*_exps), key_length_mla and
                     value_length_mla, YaRN's keys
  deepseek-q8_0.gguf the converter's --outtype q8_0: the matrices Q8_0 (the
                     stacked experts too), the norms and biases f32
  deepseek-kvb.gguf  the f32 file rewritten as older converters wrote MLA:
                     kv_b_proj whole (attn_kv_b), no *_mla keys, and
                     attention.key_length / value_length the query's
                     (nope + rope) and a head's value length. Rewritten here
                     with llama.cpp's gguf-py.
The test compares the f32 ones with transformers' reference outputs of
the same weights (tests/golden/tiny/deepseek/expected.json), and the Q8_0
one with the f32 one.

The converter comes from llama-cpp-python's source release on PyPI (it
vendors llama.cpp, its convert_hf_to_gguf.py and gguf-py): pass its
vendor/llama.cpp directory with --llama-cpp, or the script downloads
llama-cpp-python==LLAMA_CPP_PYTHON with pip into a temporary directory.
The model has no tokenizer, and the converter needs one: a byte-level BPE of
the 256 byte symbols is written beside a copy of the model, and the
converter's pre-tokenizer check is told "default" (the tokenizer is not what
the test reads).

Needs (CPU only): pip install torch transformers safetensors numpy tokenizers
Run from anywhere:
  python3 tools/gen_deepseek_gguf.py [--llama-cpp DIR]
  python3 tools/gen_deepseek_gguf.py --check    # exit 1 if a file is stale
Two runs with the same converter give byte-identical files.
"""
import argparse
import json
import runpy
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "golden" / "tiny"
LLAMA_CPP_PYTHON = "0.3.36"


def llama_cpp_dir(given, tmp):
    if given:
        return Path(given)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                    f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(tmp)], check=True)
    (sdist,) = tmp.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as t:
        t.extractall(tmp, filter="data")
    return tmp / sdist.name[:-len(".tar.gz")] / "vendor" / "llama.cpp"


def byte_tokenizer(dest):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def convert(llama, src, out, outtype):
    if str(llama) not in sys.path:
        sys.path[:0] = [str(llama), str(llama / "gguf-py")]
    import conversion.base as base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(src), "--outtype", outtype, "--outfile", str(out)]
    try:
        runpy.run_path(str(llama / "convert_hf_to_gguf.py"), run_name="__main__")
    finally:
        sys.argv = argv


def legacy(src, out, hf_dir):
    """src rewritten with kv_b_proj whole, as older converters wrote it."""
    import gguf
    from safetensors.numpy import load_file
    st = load_file(str(hf_dir / "model.safetensors"))
    cfg = json.loads((hf_dir / "config.json").read_text())
    r = gguf.GGUFReader(str(src))
    arch = "deepseek2"
    w = gguf.GGUFWriter(str(out), arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k.endswith("_mla"):
            continue
        if k in (f"{arch}.attention.key_length", f"{arch}.attention.value_length"):
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), vt, sub_type=f.types[-1])
        else:
            w.add_key_value(k, f.contents(), vt)
    w.add_uint32(f"{arch}.attention.key_length", cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_uint32(f"{arch}.attention.value_length", cfg["v_head_dim"])
    done = set()
    for t in r.tensors:
        name = t.name
        if name.endswith("attn_k_b.weight") or name.endswith("attn_v_b.weight"):
            blk = name.split(".")[1]
            if blk in done:
                continue
            done.add(blk)
            kvb = st[f"model.layers.{blk}.self_attn.kv_b_proj.weight"]
            w.add_tensor(f"blk.{blk}.attn_kv_b.weight", kvb)
            continue
        w.add_tensor(name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", help="llama.cpp's directory (vendor/llama.cpp of llama-cpp-python's sdist)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a committed file differs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        llama = llama_cpp_dir(args.llama_cpp, tmp)
        hf = tmp / "deepseek"
        shutil.copytree(TINY / "deepseek", hf)
        (hf / "expected.json").unlink()
        byte_tokenizer(hf)
        fresh = {n: tmp / n for n in ("deepseek.gguf", "deepseek-q8_0.gguf", "deepseek-kvb.gguf")}
        convert(llama, hf, fresh["deepseek.gguf"], "f32")
        convert(llama, hf, fresh["deepseek-q8_0.gguf"], "q8_0")
        legacy(fresh["deepseek.gguf"], fresh["deepseek-kvb.gguf"], TINY / "deepseek")
        stale = []
        for name, f in fresh.items():
            dest = TINY / name
            same = dest.exists() and dest.read_bytes() == f.read_bytes()
            if args.check:
                if not same:
                    stale.append(name)
            elif not same:
                shutil.copyfile(f, dest)
                print(f"wrote {dest.relative_to(ROOT)} ({f.stat().st_size} bytes)")
        if stale:
            print("stale: " + ", ".join(stale), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
