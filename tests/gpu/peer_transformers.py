"""Hugging Face transformers on the GPU, on the shapes aerie make-model
writes, with random bf16 weights: batch-1 greedy decode speed, the
side-by-side figure for aerie bench --device cuda (tests/gpu/run.sh).

Decode rate = 64 tokens / (time of a 65-token generate - time of a
1-token one), each the best of two, after a warm-up; prompts of 128
tokens, as run.sh's benchmarks. One JSON line per shape.
"""
import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {  # the shapes of cli/make_model.c
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
}


def timed(model, ids, new):
    best = float("inf")
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main(names):
    torch.manual_seed(0)
    for name in names:
        cfg = LlamaConfig(max_position_embeddings=4096, rms_norm_eps=1e-5, eos_token_id=None, **SHAPES[name])
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).eval()
        ids = torch.randint(0, cfg.vocab_size, (1, 128), device="cuda")
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
            t1, t65 = timed(model, ids, 1), timed(model, ids, 65)
        print(json.dumps({"peer": "transformers", "version": __import__("transformers").__version__,
                          "torch": torch.__version__, "shape": name, "dtype": "bf16",
                          "prefill_s": round(t1, 4), "decode_tok_per_s": round(64 / (t65 - t1), 1)}), flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or list(SHAPES))
