#!/usr/bin/env python3
"""Golden data for the target engine (issue 3, "Golden"), made by Hugging Face
`transformers` (PyTorch, CPU, float32) on the same dequantized weights as the
default model file.

Writes tests/golden/llama/smollm2.json:
  meta      versions, model sha256, settings, the conventions below
  prompts   for each prompt:
    ids             prompt token ids: `tokenizers` with
                    tests/golden/tokenizer/smollm/tokenizer.json,
                    add_special_tokens=False (no BOS: add_bos is false for
                    this model); special tokens in the text are parsed
    generated       greedy continuation, exactly 64 new tokens; generation
                    does NOT stop at EOS (eos_at: index of the first EOS in
                    `generated`, or null)
    margins         top1 - top2 logit at each generated step (6 significant
                    digits), so a test can tell a near-tie from a real miss
    top_ids/top_logits  top 20 of the final-position prompt logits (the
                    logits that predict generated[0]); ties by lower id
    logits_l2       L2 norm (float64) of that whole 49152-float vector
    logits_f32      (4 prompts) the whole vector, little-endian f32, base64
    hidden          (3 prompts) {"2": b64, "15": b64, "27": b64}: the
                    residual stream entering decoder layer L at the last
                    prompt position, 576 little-endian f32, base64
                    (= transformers output_hidden_states[L]; [0] would be
                    the token embedding; it is the input of layer L's
                    input RMSNorm, before normalization)

Method: AutoModelForCausalLM.from_pretrained(models/, gguf_file=...,
dtype=float32, attn_implementation="eager"), model.eval(), torch.no_grad(),
model.generate(do_sample=False, max_new_tokens=64) with the KV cache that
generate uses by default and EOS stopping switched off. Every weight that
transformers loaded is first checked to be bit-identical to the `gguf`
package's own numpy dequantization (gguf.quants.dequantize), with llama.cpp's
q/k row permutation undone independently here. Each prompt's greedy tokens
and prompt logits are also checked against a hand-written cached decode loop,
and the hidden states against forward-pre-hooks on the decoder layers.

Needs (CPU only; about 3 GB of pip downloads for torch's wheel):
  pip install torch transformers accelerate gguf tokenizers numpy jinja2
  make model            # models/SmolLM2-135M-Instruct.Q4_1.gguf
Run from anywhere:
  python3 tools/gen_llama_golden.py           # rewrite the JSON
  python3 tools/gen_llama_golden.py --check   # exit 1 if the JSON is stale
It uses 2 threads and takes a few minutes. Output is deterministic: two runs
with the same package versions give byte-identical JSON. Other versions of
torch/transformers may change the last bits of logits (hence of the file).
"""
import argparse
import base64
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TOKENIZER = ROOT / "tests" / "golden" / "tokenizer" / "smollm" / "tokenizer.json"
CHAT_CASES = ROOT / "tests" / "golden" / "chat" / "cases.json"
OUT = ROOT / "tests" / "golden" / "llama" / "smollm2.json"

N_NEW = 64
TOP_K = 20
HIDDEN_LAYERS = [2, 15, 27]          # EAGLE-3 defaults for 30 layers: 2, N/2, N-3
THREADS = 2

LONG_TEXT = (
    "The history of computing is a story of ideas that took decades to become "
    "practical. In the nineteenth century, Charles Babbage designed the "
    "Analytical Engine, a mechanical machine with a store for numbers and a "
    "mill for arithmetic, programmed with punched cards borrowed from the "
    "Jacquard loom. Ada Lovelace wrote what many consider the first program "
    "for it, a method to compute Bernoulli numbers, and she saw that such a "
    "machine could manipulate symbols of any kind, not only numbers. A "
    "century later, Alan Turing described an abstract machine that reads and "
    "writes symbols on an endless tape, and showed that one universal machine "
    "could imitate every other. During the Second World War, engineers built "
    "electronic computers to break codes and to calculate artillery tables; "
    "they filled rooms, used thousands of vacuum tubes, and failed often. The "
    "invention of the transistor in 1947 and of the integrated circuit about "
    "ten years later made computers smaller, cheaper and far more reliable. "
    "By the 1970s a whole processor fit on a single chip, and personal "
    "computers appeared in homes and schools. Networks then connected these "
    "machines, first in universities and laboratories, later across the "
    "whole world, and the web turned the network into a library, a market "
    "and a meeting place. Today a phone in a pocket is millions of times "
    "faster than the machines that sent astronauts to the moon. Looking back "
    "over this long history, the most important lesson is that"
)

# (name, kind, text or messages). kind "chat": messages rendered with the
# model's own ChatML template (add_generation_prompt=True).
PROMPTS = [
    ("en-capital", "text", "The capital of France is"),
    ("en-story", "text", "Once upon a time, there was a little"),
    ("en-fox", "text", "The quick brown fox"),
    ("en-water", "text", "Water boils at a temperature of"),
    ("en-moon", "text", "In 1969, the first human to walk on the moon was"),
    ("en-one-token", "text", "Hello"),
    ("code-python", "text", "def fibonacci(n):\n"),
    ("code-c", "text", "#include <stdio.h>\n\nint main(void) {\n"),
    ("code-sql", "text", "SELECT name, age FROM users WHERE"),
    ("code-js", "text", "function add(a, b) {\n  return"),
    ("code-json", "text", '{"name": "Alice", "age": 30, "city":'),
    ("num-count", "text", "1, 2, 3, 4, 5,"),
    ("num-sum", "text", "12 + 35 ="),
    ("num-primes", "text", "The first ten prime numbers are 2, 3, 5,"),
    ("chat-capital", "chat", [("user", "What is the capital of France?")]),
    ("chat-haiku", "chat", [("user", "Write a haiku about the sea.")]),
    ("chat-recursion", "chat", [("user", "Explain recursion in one sentence.")]),
    ("chat-system", "chat", [("system", "You are a pirate. Answer like one."),
                             ("user", "Say hello to my friend.")]),
    ("chat-multiturn", "chat", [("user", "What is 2 + 2?"),
                                ("assistant", "2 + 2 = 4."),
                                ("user", "And what is that times 3?")]),
    ("long-history", "text", LONG_TEXT),
    ("fr", "text", "La tour Eiffel se trouve à Paris et elle mesure"),
    ("de", "text", "Der schnelle braune Fuchs springt über"),
    ("es", "text", "El español es una lengua que se habla en"),
    ("zh", "text", "北京是中国的首都，它"),
    ("ru", "text", "Москва — столица России, и в ней"),
    ("special-newlines", "text", "<|im_start|>user\nList three colors.\n\n"),
]
FULL_LOGITS = ["en-capital", "code-python", "chat-capital", "long-history"]
HIDDEN = ["en-capital", "chat-haiku", "long-history"]


def log(msg):
    print("[gen_llama_golden %6.1fs] %s" % (time.time() - T0, msg), flush=True)


def b64f32(a):
    import numpy as np
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode("ascii")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def unpermute(w, n_head):
    """Undo llama.cpp's convert permutation of q/k rows (GGUF -> HF order)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permutation (HF -> GGUF order)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def check_weights(model, reader, n_head, n_kv):
    """Every transformers parameter must equal gguf's dequantization bit for bit."""
    import numpy as np
    from gguf.quants import dequantize
    sd = model.state_dict()
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
    }
    per_layer = {
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    }
    covered = set()
    types = {}
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        if m:
            hf = "model.layers.%s.%s.weight" % (m.group(1), per_layer[m.group(2)])
            kind = m.group(2)
        else:
            hf = names[t.name]
            kind = t.name
        ref = dequantize(t.data, t.tensor_type).astype(np.float32)
        ref = ref.reshape([int(d) for d in reversed(t.shape)])   # ne[0] is the fastest axis
        if kind == "attn_q":
            ref = unpermute(ref, n_head)
            assert np.array_equal(permute(ref, n_head), dequantize(t.data, t.tensor_type).reshape(ref.shape))
        elif kind == "attn_k":
            ref = unpermute(ref, n_kv)
        got = sd[hf].detach().cpu().numpy()
        assert got.dtype == np.float32, (hf, got.dtype)
        assert got.shape == ref.shape, (hf, got.shape, ref.shape)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), "not bit-identical: " + hf
        covered.add(hf)
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    # No output.weight in the file: the head is the tied embedding.
    assert "output.weight" not in {t.name for t in reader.tensors}
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    rest = set(k for k in sd if k != "lm_head.weight") - covered
    assert not rest, rest
    return len(covered), types


def render_chat(template, messages):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=[{"role": r, "content": c} for r, c in messages], add_generation_prompt=True)


def sig6(x):
    return float("%.6g" % x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the JSON is stale; write nothing")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()

    # Threads that sleep rather than spin at barriers: same numbers, far less
    # CPU burnt when the machine is shared. Must be set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import numpy as np
    import torch
    import transformers
    import tokenizers
    import jinja2
    from gguf import GGUFReader
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    log("sha256 of %s" % MODEL.name)
    digest = sha256(MODEL)
    assert digest == MODEL_SHA256, "unexpected model file: " + digest

    reader = GGUFReader(str(MODEL))

    def field(k):
        return reader.fields[k].contents()
    n_layer = int(field("llama.block_count"))
    n_head = int(field("llama.attention.head_count"))
    n_kv = int(field("llama.attention.head_count_kv"))
    eos = int(field("tokenizer.ggml.eos_token_id"))
    assert not field("tokenizer.ggml.add_bos_token")
    template = field("tokenizer.chat_template")
    chat_doc = json.loads(CHAT_CASES.read_text(encoding="utf-8"))
    smol = next(t for t in chat_doc["templates"] if t["name"] == "smollm2")
    assert template == smol["source"], "GGUF chat template differs from tests/golden/chat"

    log("loading the GGUF with transformers %s (float32, eager attention)" % transformers.__version__)
    model = AutoModelForCausalLM.from_pretrained(
        str(MODEL.parent), gguf_file=MODEL.name, dtype=torch.float32,
        attn_implementation="eager").eval()
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (n_layer, n_head, n_kv)
    assert cfg.hidden_size == 576 and cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    # Generate exactly N_NEW tokens: no stop on EOS (the EOS is recorded instead).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = eos

    log("faithfulness: every weight vs gguf.quants.dequantize, bit for bit")
    n_checked, types = check_weights(model, reader, n_head, n_kv)
    log("faithfulness OK: %d tensors bit-identical %s (+ tied lm_head)" % (n_checked, types))

    tok = Tokenizer.from_file(str(TOKENIZER))
    layers = model.model.layers
    out_prompts = []
    n_eos = 0
    worst_loop_diff = 0.0
    for i, (name, kind, content) in enumerate(PROMPTS):
        text = render_chat(template, content) if kind == "chat" else content
        ids = tok.encode(text, add_special_tokens=False).ids
        want_hidden = name in HIDDEN
        x = torch.tensor([ids], dtype=torch.long)
        with torch.no_grad():
            # An explicit all-ones mask: without one, generate() would infer
            # it from pad_token_id and mask the prompt's own <|im_end|> tokens.
            g = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=N_NEW, output_logits=True,
                               output_hidden_states=want_hidden, return_dict_in_generate=True)
        gen = g.sequences[0, len(ids):].tolist()
        assert len(gen) == N_NEW, (name, len(gen))
        assert len(g.logits) == N_NEW
        step_logits = [l[0].float() for l in g.logits]
        for s in range(N_NEW):
            assert int(torch.argmax(step_logits[s])) == gen[s], (name, s)
        margins = []
        for l in step_logits:
            top2 = torch.topk(l, 2).values
            margins.append(sig6(float(top2[0] - top2[1])))
        prompt_logits = step_logits[0].numpy().astype(np.float32)

        # Cross-check: a plain cached decode loop (and layer hooks) must agree.
        captured = {}
        hooks = []
        if want_hidden:
            for L in HIDDEN_LAYERS:
                def pre(mod, a, kw, L=L):
                    h = a[0] if a else kw["hidden_states"]
                    captured[L] = h[0, -1].detach().clone()
                hooks.append(layers[L].register_forward_pre_hook(pre, with_kwargs=True))
        with torch.no_grad():
            out = model(input_ids=x, use_cache=True)
            for h in hooks:
                h.remove()
            past = out.past_key_values
            lg = out.logits[0, -1]
            loop_first = lg.clone()
            loop = []
            for s in range(N_NEW):
                t = int(torch.argmax(lg))
                loop.append(t)
                if s == N_NEW - 1:
                    break
                out = model(input_ids=torch.tensor([[t]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                lg = out.logits[0, -1]
        assert loop == gen, (name, "generate() and the decode loop disagree")
        loop_diff = float((loop_first - step_logits[0]).abs().max())
        assert loop_diff <= 1e-4, (name, loop_diff)
        worst_loop_diff = max(worst_loop_diff, loop_diff)

        eos_at = gen.index(eos) if eos in gen else None
        n_eos += eos_at is not None
        order = np.argsort(-prompt_logits, kind="stable")[:TOP_K]
        rec = {
            "name": name,
            "kind": kind,
        }
        if kind == "chat":
            rec["messages"] = [{"role": r, "content": c} for r, c in content]
        rec["text"] = text
        rec["ids"] = ids
        rec["generated"] = gen
        rec["generated_text"] = tok.decode(gen, skip_special_tokens=False)
        rec["eos_at"] = eos_at
        rec["margins"] = margins
        rec["top_ids"] = [int(j) for j in order]
        rec["top_logits"] = [float(prompt_logits[j]) for j in order]
        rec["logits_l2"] = float(np.sqrt(np.sum(prompt_logits.astype(np.float64) ** 2)))
        if name in FULL_LOGITS:
            rec["logits_f32"] = b64f32(prompt_logits)
        if want_hidden:
            hs = g.hidden_states[0]            # prefill step: embeddings + one per layer
            assert len(hs) == n_layer + 1
            emb = model.model.embed_tokens.weight[ids[-1]]
            assert torch.equal(hs[0][0, -1], emb)
            rec["hidden"] = {}
            for L in HIDDEN_LAYERS:
                h = hs[L][0, -1].float()
                assert torch.allclose(h, captured[L], rtol=1e-5, atol=1e-5), (name, L)
                rec["hidden"][str(L)] = b64f32(h.numpy())
        out_prompts.append(rec)
        log("%2d/%d %-16s %3d prompt tokens, eos_at=%s, min margin %.4g, %r" % (
            i + 1, len(PROMPTS), name, len(ids), eos_at, min(margins), rec["generated_text"][:40]))

    doc = {
        "meta": {
            "generator": "tools/gen_llama_golden.py",
            "reference": "Hugging Face transformers, PyTorch CPU, float32, GGUF dequantized by transformers "
                         "(checked bit-identical to gguf.quants.dequantize for every tensor)",
            "versions": {
                "python": "%d.%d.%d" % sys.version_info[:3],
                "torch": torch.__version__, "transformers": transformers.__version__,
                "gguf": _version("gguf"), "tokenizers": tokenizers.__version__,
                "numpy": np.__version__, "jinja2": jinja2.__version__,
            },
            "model": "models/" + MODEL.name,
            "model_sha256": MODEL_SHA256,
            "tokenizer": "tests/golden/tokenizer/smollm/tokenizer.json, add_special_tokens=False, no BOS",
            "chat_template": "the GGUF's tokenizer.chat_template (= tests/golden/chat smollm2), "
                             "jinja2 trim_blocks+lstrip_blocks, add_generation_prompt=true",
            "settings": {
                "dtype": "float32", "attn_implementation": "eager", "threads": THREADS, "seed": 0,
                "decoding": "greedy (argmax; first index on ties), model.generate(do_sample=False) "
                            "with its default KV cache, no stop on EOS",
                "new_tokens": N_NEW,
            },
            "eos_token_id": eos,
            "top_k": TOP_K,
            "conventions": {
                "logits": "final prompt position, i.e. the logits that predict generated[0]; "
                          "top_ids/top_logits sorted by logit descending, ties by lower id; "
                          "logits_l2 = float64 L2 norm of all 49152; logits_f32 = base64 of "
                          "49152 little-endian f32 (only some prompts)",
                "margins": "per generated step, top1 - top2 logit, 6 significant digits",
                "eos_at": "index in generated of the first eos_token_id, or null",
                "generated_text": "informational: tokenizers decode of generated, special tokens kept "
                                  "(a character split across the last token shows as U+FFFD)",
                "hidden": "key L: the residual stream entering decoder layer L (0-based) at the last "
                          "prompt position, before layer L's input RMSNorm = transformers "
                          "output_hidden_states[L] (whose [0] is the token embedding); base64 of "
                          "hidden_size little-endian f32; layers 2, N/2, N-3 for N=30",
            },
            "hidden_layers": HIDDEN_LAYERS,
        },
        "prompts": out_prompts,
    }
    data = dumps(doc)
    size = len(data.encode("utf-8"))
    if args.check:
        try:
            old = Path(args.out).read_text(encoding="utf-8")
        except FileNotFoundError:
            old = None
        if old != data:
            log("STALE: %s differs from a fresh run" % args.out)
            sys.exit(1)
        log("up to date: %s (%d bytes)" % (args.out, size))
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(data)
    log("cross-check: generate() == decode loop tokens for every prompt; prompt logits "
        "max |diff| %.3g" % worst_loop_diff)
    log("wrote %s: %d prompts, %d hit EOS within %d tokens, %d bytes" % (
        args.out, len(out_prompts), n_eos, N_NEW, size))


def _version(pkg):
    from importlib.metadata import version
    return version(pkg)


def dumps(doc):
    """indent=1 JSON with each list of plain numbers kept on one line."""
    s = json.dumps(doc, ensure_ascii=False, indent=1)
    return re.sub(r"\[\s*([-+0-9.eE]+(?:,\s*[-+0-9.eE]+)*)\s*\]",
                  lambda m: "[" + ", ".join(p.strip() for p in m.group(1).split(",")) + "]", s) + "\n"


if __name__ == "__main__":
    T0 = time.time()
    main()
