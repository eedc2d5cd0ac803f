#!/usr/bin/env python3
"""Trains an EAGLE-3 draft head on features from `aerie dump-features`.

    train_eagle3.py train --features DIR --out DIR [options]
        Trains, checkpointing to OUT/checkpoint.pt (a rerun resumes from
        it), and exports the head to OUT/head/.
    train_eagle3.py train --stream --features DIR --out DIR [options]
        Trains on the shards in order as dump-features writes them, one
        pass, and with --delete-consumed replaces each shard it has used by
        an empty shard-NNNNN.consumed (dump-features --max-pending waits for
        that), so the disk holds a few shards however much data there is.
        The first --val-shards shards are copied to OUT for validation, and
        the draft vocabulary is chosen from the response tokens of the next
        --vocab-shards, which must all be on disk at once: dump-features
        --max-pending must be at least --vocab-shards. It checkpoints after every shard (and at
        --stop-after); a rerun resumes at the batch it stopped at.
    train_eagle3.py vocab --features DIR [--sizes 2048,4096,...]
        Coverage of response tokens by draft vocabularies of those sizes:
        chosen on the first half of the sequences, counted on the second.
    train_eagle3.py export --out DIR
        Exports OUT/checkpoint.pt to OUT/head/ again.
    train_eagle3.py reference --head DIR --features DIR --out FILE [--pairs N]
        The exported head's first draft step in PyTorch over the first N
        pairs of the first sequence: writes the features, tokens and
        logits to FILE (safetensors) so that Aerie's forward pass can be
        compared with it.

The head is the architecture Aerie drafts with (draft/eagle.h, and the
EAGLE-3 section of REFERENCES.md): fc over the three captured features,
one decoder layer whose input is [input_layernorm(embed(token)),
hidden_norm(h)], a final norm and lm_head over a draft vocabulary.

Data (dump-features' shards): for each sequence, input_ids [n], hidden
[n][3H] (features of token t), topk_ids/topk_p [n][K] (the target's K most
likely tokens after token t). Pair i is (hidden[i], input_ids[i+1]) at
position i; its draft output predicts token i+2, against the target's
distribution at row i+1.

Training-time test (EAGLE-3): each batch is unrolled for --ttt steps.
Step 0 runs on the pairs. Step s >= 1 feeds back the head's own output
hidden state of step s-1 at the same index, paired with token i+1+s, at
position i+s, and predicts the target's distribution at row i+1+s. A query
of step s at index i attends to step 0's keys at indices <= i and to its
own chain's keys (steps 1..s at index i): exactly what a drafted node sees
at depth s, its committed prefix and its ancestors. The loss is the cross
entropy against the target's top-K distribution restricted to the draft
vocabulary and renormalised; positions whose target top-1 is outside the
draft vocabulary do not count (as in EAGLE-3). Step s weighs 0.8^s.
Only response positions count (rows from the last prompt token on).

Draft vocabulary: the --draft-vocab most frequent response tokens of the
training data, sorted by id; d2t[i] = target id - i, t2d marks the target
ids in it.

Written for torch >= 1.13 (Debian's python3-torch) on the CPU.
"""
import argparse
import json
import math
import os
import random
import shutil
import struct
import sys
import time
from pathlib import Path

import numpy as np

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("train_eagle3.py needs PyTorch: apt-get install python3-torch (or pip install torch)")

# ---- safetensors, read and written with numpy --------------------------

ST_TO_NP = {"F16": np.float16, "F32": np.float32, "BF16": None, "I32": np.int32, "I64": np.int64,
            "BOOL": np.bool_, "U8": np.uint8}
NP_TO_ST = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.int32): "I32",
            np.dtype(np.int64): "I64", np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8"}


def st_read(path):
    """{name: ndarray} (views of one read of the file) and the metadata."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, e in header.items():
        a, b = e["data_offsets"]
        dt = ST_TO_NP.get(e["dtype"])
        if dt is None:
            raise SystemExit(f"{path}: tensor {name} has dtype {e['dtype']}, which this reader does not take")
        out[name] = np.frombuffer(raw, dtype=dt, count=(b - a) // np.dtype(dt).itemsize,
                                  offset=base + a).reshape(e["shape"])
    return out, meta


def st_write(path, tensors, meta=None):
    """Writes [(name, ndarray)] in order, whole or not at all."""
    header, blobs, at = {}, [], 0
    if meta:
        header["__metadata__"] = {k: str(v) for k, v in meta.items()}
    for name, a in tensors:
        a = np.ascontiguousarray(a)
        b = a.tobytes()
        header[name] = {"dtype": NP_TO_ST[a.dtype], "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for b in blobs:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---- data ---------------------------------------------------------------

def load_shard(path):
    """The sequences of one shard: (input_ids, hidden, topk_ids, topk_p,
    prompt_len, prompt_index), views of one read of the file."""
    t, _ = st_read(path)
    seqs, at = [], 0
    for n, pl, pi in zip(t["lengths"].tolist(), t["prompt_lengths"].tolist(), t["prompt_index"].tolist()):
        sl = slice(at, at + n)
        seqs.append((t["input_ids"][sl], t["hidden"][sl], t["topk_ids"][sl], t["topk_p"][sl], pl, pi))
        at += n
    return seqs


class Features:
    """Every sequence of a dump-features directory, held in memory."""

    def __init__(self, directory):
        d = Path(directory)
        self.dir = d
        self.info = json.loads((d / "features.json").read_text())
        if self.info.get("format") != "aerie-features-1":
            raise SystemExit(f"{d}/features.json: not an aerie-features-1 dump")
        shards = sorted(d.glob("shard-*.safetensors"))
        if not shards:
            raise SystemExit(f"{d}: no shards (run aerie dump-features first)")
        if len(shards) < self.info["shards"]:
            print(f"train: {d} holds {len(shards)} of {self.info['shards']} shards (dump-features did not finish); "
                  "training on those", file=sys.stderr, flush=True)
        self.seqs = []  # (input_ids, hidden, topk_ids, topk_p, prompt_len, prompt_index)
        for p in shards:
            self.seqs += load_shard(p)
        embed, _ = st_read(d / "target_embed.safetensors")
        self.embed = embed["embed"]
        self.hidden = int(self.info["target_hidden"])
        self.topk = int(self.info["topk"])

    def response_counts(self, seqs):
        return response_counts(seqs, int(self.info["target_vocab"]))


def response_counts(seqs, vocab):
    counts = np.zeros(vocab, dtype=np.int64)
    for ids, _, _, _, pl, _ in seqs:
        np.add.at(counts, ids[pl:], 1)
    return counts


class ShardStream:
    """The shards of a dump-features directory in order, as they appear:
    what a streaming trainer reads while the dump still runs."""

    def __init__(self, directory, wait_seconds):
        self.dir = Path(directory)
        self.wait_seconds = wait_seconds
        deadline = time.time() + wait_seconds
        while not (self.dir / "features.json").exists() or not (self.dir / "target_embed.safetensors").exists():
            if time.time() > deadline:
                raise SystemExit(f"train: {self.dir} has no features.json after {wait_seconds} s")
            time.sleep(1)
        self.info = json.loads((self.dir / "features.json").read_text())
        if self.info.get("format") != "aerie-features-1":
            raise SystemExit(f"{self.dir}/features.json: not an aerie-features-1 dump")
        self.n_shards = int(self.info["shards"])
        self.hidden = int(self.info["target_hidden"])
        self.topk = int(self.info["topk"])
        self.embed = st_read(self.dir / "target_embed.safetensors")[0]["embed"]

    def path(self, k):
        return self.dir / f"shard-{k:05d}.safetensors"

    def consumed_path(self, k):
        return self.dir / f"shard-{k:05d}.consumed"

    def get(self, k):
        """Shard k's sequences, waiting for dump-features to write it."""
        return load_shard(self.get_path(k))

    def get_path(self, k):
        p, said, deadline = self.path(k), False, time.time() + self.wait_seconds
        while not p.exists():
            if self.consumed_path(k).exists():
                raise SystemExit(f"train: {p} was consumed by an earlier run, and this checkpoint needs it: "
                                 "the checkpoint and the features directory do not belong together")
            if time.time() > deadline:
                raise SystemExit(f"train: {p} did not appear within {self.wait_seconds} s (is dump-features running?)")
            if not said:
                print(f"train: waiting for {p.name} from dump-features", file=sys.stderr, flush=True)
                said = True
            time.sleep(0.5)
        return p

    def consume(self, k):
        """Replaces used shard k by its marker: marker first, so that a
        crash in between leaves both and no gap for dump-features."""
        self.consumed_path(k).touch()
        self.path(k).unlink(missing_ok=True)


def draft_vocabulary(counts, size):
    """The `size` most frequent ids (ties: lower id first), sorted by id."""
    size = min(size, len(counts))
    order = np.lexsort((np.arange(len(counts)), -counts))
    return np.sort(order[:size]).astype(np.int64)


def make_batches(seqs, batch_tokens, rng):
    """Lists of sequence indices, similar lengths together, each padded
    batch within batch_tokens, in a random order."""
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i][0]), rng.random()))
    batches, cur, longest = [], [], 0
    for i in order:
        n = len(seqs[i][0])
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(data, seqs, idx, ttt, t2d_index):
    """Padded tensors for a batch. T = longest sequence - 1 (its pairs)."""
    H3 = 3 * data.hidden
    K = data.topk
    T = max(len(seqs[i][0]) for i in idx) - 1
    B = len(idx)
    feat = np.zeros((B, T, H3), dtype=np.float32)
    toks = np.zeros((ttt, B, T), dtype=np.int64)
    tgt_ids = np.zeros((ttt, B, T, K), dtype=np.int64)
    tgt_p = np.zeros((ttt, B, T, K), dtype=np.float32)
    mask = np.zeros((ttt, B, T), dtype=np.float32)
    for b, i in enumerate(idx):
        ids, hid, tki, tkp, pl, _ = seqs[i]
        n = len(ids)
        feat[b, :n - 1] = hid[:n - 1]
        for s in range(ttt):
            # pair index j feeds token j+1+s and is scored on row j+1+s,
            # which must have target probabilities: pl-1 <= row <= n-2.
            m = n - 2 - s  # pairs j < m have a token and a row
            if m <= 0:
                continue
            toks[s, b, :m] = ids[1 + s:1 + s + m]
            rows = np.arange(1 + s, 1 + s + m)
            draft = t2d_index[tki[rows]]  # [m][K], -1 outside the draft vocabulary
            p = tkp[rows].astype(np.float32) * (draft >= 0)
            ok = (rows >= pl - 1) & (draft[:, 0] >= 0) & (p.sum(axis=1) > 0)
            tgt_ids[s, b, :m] = np.maximum(draft, 0)
            tgt_p[s, b, :m] = p / np.maximum(p.sum(axis=1, keepdims=True), 1e-20)
            mask[s, b, :m] = ok
    return (torch.from_numpy(feat), torch.from_numpy(toks), torch.from_numpy(tgt_ids), torch.from_numpy(tgt_p),
            torch.from_numpy(mask))


# ---- the head -----------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, nh, nkv, D = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.q_proj = nn.Linear(2 * H, nh * D, bias=False)
        self.k_proj = nn.Linear(2 * H, nkv * D, bias=False)
        self.v_proj = nn.Linear(2 * H, nkv * D, bias=False)
        self.o_proj = nn.Linear(nh * D, H, bias=False)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, Fi = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(H, Fi, bias=False)
        self.up_proj = nn.Linear(H, Fi, bias=False)
        self.down_proj = nn.Linear(Fi, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, eps = c["hidden_size"], c["rms_norm_eps"]
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(c)


def rope_tables(pos, D, theta):
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()  # [T][D]


def rope(x, cos, sin):
    """HF rotate_half over x [B][T][heads][D]."""
    d = x.shape[-1] // 2
    rot = torch.cat([-x[..., d:], x[..., :d]], dim=-1)
    return x * cos[None, :, None, :] + rot * sin[None, :, None, :]


class Eagle3Head(nn.Module):
    """Parameter names are the published tensor names."""

    def __init__(self, c):
        super().__init__()
        H = c["hidden_size"]
        self.c = c
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(H, c["rms_norm_eps"])
        self.lm_head = nn.Linear(H, c["draft_vocab_size"], bias=False)

    def qkv(self, emb, h, pos):
        a = self.midlayer.self_attn
        c = self.c
        B, T, _ = h.shape
        x = torch.cat([self.midlayer.input_layernorm(emb), self.midlayer.hidden_norm(h)], dim=-1)
        cos, sin = rope_tables(pos, c["head_dim"], c["rope_theta"])
        q = rope(a.q_proj(x).view(B, T, c["num_attention_heads"], c["head_dim"]), cos, sin)
        k = rope(a.k_proj(x).view(B, T, c["num_key_value_heads"], c["head_dim"]), cos, sin)
        v = a.v_proj(x).view(B, T, c["num_key_value_heads"], c["head_dim"])
        return q, k, v

    def finish(self, h, att):
        """att [B][T][heads*D] -> (next hidden, its final norm)."""
        m = self.midlayer
        h1 = h + m.self_attn.o_proj(att)
        h2 = h1 + m.mlp(m.post_attention_layernorm(h1))
        return h2, self.norm(h2)

    def unroll(self, feat, toks, embed, steps):
        """Training-time test over a batch: per step the normed output
        [B][T][H]; lm_head of it gives the logits (the trainer applies it
        only where the loss counts)."""
        c = self.c
        B, T, _ = feat.shape
        nh, nkv, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        g = nh // nkv
        scale = 1.0 / math.sqrt(D)
        h = self.fc(feat)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        base = torch.arange(T)
        out = []
        k0 = v0 = None
        chain_k, chain_v = [], []
        for s in range(steps):
            q, k, v = self.qkv(F.embedding(toks[s], embed), h, base + s)
            q = q.transpose(1, 2)  # [B][nh][T][D]
            k = k.repeat_interleave(g, dim=2).transpose(1, 2)
            v = v.repeat_interleave(g, dim=2).transpose(1, 2)
            if s == 0:
                k0, v0 = k, v
            else:
                chain_k.append(k)
                chain_v.append(v)
            sc = (q @ k0.transpose(-1, -2)) * scale  # [B][nh][T][T]
            sc = sc.masked_fill(~causal, float("-inf"))
            diag = [(q * ck).sum(-1, keepdim=True) * scale for ck in chain_k]  # each [B][nh][T][1]
            p = torch.softmax(torch.cat([sc] + diag, dim=-1), dim=-1)
            att = p[..., :T] @ v0
            for r, cv in enumerate(chain_v):
                att = att + p[..., T + r:T + r + 1] * cv
            att = att.transpose(1, 2).reshape(B, T, nh * D)
            h, logits = self.finish(h, att)
            out.append(logits)
        return out

    def first_step(self, feat, toks, embed):
        """Step 0 over one sequence of pairs at positions 0..n-1: logits [n][Vd]."""
        return self.lm_head(self.unroll(feat[None], toks[None, None], embed, 1)[0][0])


def head_config(info, draft_vocab_size):
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": info["target_hidden"], "intermediate_size": info["target_ffn"],
            "num_attention_heads": info["target_heads"], "num_key_value_heads": info["target_kv_heads"],
            "head_dim": info["target_head_dim"], "num_hidden_layers": 1, "vocab_size": info["target_vocab"],
            # features.json has the engine's float32 eps (9.99999974737875e-06); 7 digits give it back as written.
            "draft_vocab_size": draft_vocab_size, "rms_norm_eps": float(f"{info['target_rms_eps']:.7g}"),
            "rope_theta": info["target_rope_theta"], "max_position_embeddings": info["target_context_length"],
            "tie_word_embeddings": False, "torch_dtype": "float16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(info["capture_layers"]),
                             "use_aux_hidden_state": True}}


# ---- training -----------------------------------------------------------

def step_loss(model, normed, tgt_ids, tgt_p, mask):
    """Cross entropy against the target's renormalised top-K, and top-1
    agreement, over the masked positions (lm_head runs on those alone)."""
    sel = mask > 0
    n = int(sel.sum())
    if n == 0:
        return normed.sum() * 0.0, 0.0, 0
    logits = model.lm_head(normed[sel])
    tid = tgt_ids[sel]
    logp = torch.log_softmax(logits.float(), dim=-1)
    loss = -(logp.gather(-1, tid) * tgt_p[sel]).sum() / n
    hits = float((logits.argmax(-1) == tid[:, 0]).sum())
    return loss, hits, n


def train_step(model, opt, batch, embed, ttt, weights, clip, hits, counts):
    """One optimiser step on a collated batch (feat, toks, tid, tp, mask),
    the unrolled steps' losses weighted; adds each step's top-1 hits and
    positions to hits and counts, and returns the loss."""
    feat, toks, tid, tp, mask = batch
    loss = 0.0
    for s, hn in enumerate(model.unroll(feat, toks, embed, ttt)):
        l, h, n = step_loss(model, hn, tid[s], tp[s], mask[s])
        loss = loss + weights[s] * l
        hits[s] += float(h)
        counts[s] += float(n)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return float(loss.detach())


def fmt_time(s):
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"


def evaluate(model, data, seqs, batches, ttt, t2d_index, embed):
    model.eval()
    hits, counts = np.zeros(ttt), np.zeros(ttt)
    with torch.no_grad():
        for idx in batches:
            feat, toks, tid, tp, mask = collate(data, seqs, idx, ttt, t2d_index)
            for s, hn in enumerate(model.unroll(feat, toks, embed, ttt)):
                _, h, n = step_loss(model, hn, tid[s], tp[s], mask[s])
                hits[s] += float(h)
                counts[s] += float(n)
    model.train()
    return hits / np.maximum(counts, 1)


def save_checkpoint(path, state):
    tmp = Path(str(path) + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def export(out, state, info):
    """OUT/head/config.json + model.safetensors (fp16), and training.json."""
    head = Path(out) / "head"
    head.mkdir(parents=True, exist_ok=True)
    ids = np.asarray(state["draft_ids"], dtype=np.int64)
    cfg = head_config(info, len(ids))
    sd = state["model"]
    names = ["fc.weight"] + [f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"] + \
            [f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")] + \
            [f"midlayer.{p}.weight" for p in ("input_layernorm", "hidden_norm", "post_attention_layernorm")] + \
            ["norm.weight", "lm_head.weight"]
    tensors = [(n, sd[n].float().numpy().astype(np.float16)) for n in names]
    t2d = np.zeros(int(info["target_vocab"]), dtype=np.bool_)
    t2d[ids] = True
    tensors += [("d2t", ids - np.arange(len(ids), dtype=np.int64)), ("t2d", t2d)]
    (head / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    st_write(head / "model.safetensors", tensors)
    (head / "training.json").write_text(json.dumps(state["record"], indent=2) + "\n")
    return head


def train(args):
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.pt"
    data = Features(args.features)
    info = data.info
    rng = random.Random(args.seed)
    order = list(range(len(data.seqs)))
    rng.shuffle(order)
    n_val = max(1, int(len(order) * args.val_fraction)) if len(order) > 1 else 0
    val = [data.seqs[i] for i in order[:n_val]]
    trn = [data.seqs[i] for i in order[n_val:]]
    counts = data.response_counts(trn)
    if not trn:
        raise SystemExit(f"train: no training sequences in {args.features} (after holding out {n_val})")
    resume = ckpt_path.exists() and not args.fresh
    state = torch.load(ckpt_path, map_location="cpu") if resume else None
    # What decides the batches, the split and the vocabulary must not change
    # under a resumed run, or it would train on what it validates with.
    run_args = {"features_dir": str(Path(args.features).resolve()), "sequences": len(data.seqs),
                "batch_tokens": args.batch_tokens, "seed": args.seed, "ttt": args.ttt,
                "val_fraction": args.val_fraction, "draft_vocab": args.draft_vocab}
    if state:
        diff = [f"{k} {state['args'].get(k)} (now {v})" for k, v in run_args.items() if state["args"].get(k) != v]
        if diff:
            raise SystemExit(f"train: {ckpt_path} was made with " + ", ".join(diff) +
                             "; rerun with those settings to resume, or use --fresh or another --out")
    init = load_init(args.init, info, args.draft_vocab) if args.init and not state else None
    ids = np.asarray(state["draft_ids"]) if state else init[1] if init else draft_vocabulary(counts, args.draft_vocab)
    coverage = counts[ids].sum() / max(counts.sum(), 1)
    t2d_index = np.full(int(info["target_vocab"]), -1, dtype=np.int64)
    t2d_index[ids] = np.arange(len(ids))
    cfg = head_config(info, len(ids))
    model = Eagle3Head(cfg)
    embed = torch.from_numpy(data.embed.astype(np.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    tokens = sum(len(s[0]) for s in trn)
    resp = int(counts.sum())
    epoch_batches = len(make_batches(trn, args.batch_tokens, random.Random(0)))
    total = args.steps if args.steps else args.epochs * epoch_batches
    step, t_prev = 0, 0.0
    if init:
        model.load_state_dict(init[0])
    if state:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, t_prev = state["step"], state["seconds"]
        if total != state["total_steps"]:
            print(f"train: the checkpoint's schedule runs to step {state['total_steps']}, not {total}; resuming "
                  "it as it was (--fresh starts over)", file=sys.stderr, flush=True)
        total = state["total_steps"]
    if total < 1:
        raise SystemExit("train: no steps to run (--steps or --epochs)")
    print(f"train: {len(trn)} sequences, {tokens} tokens ({resp} response tokens) for training, {len(val)} held out "
          f"for validation; draft vocabulary {len(ids)} covers {coverage:.1%} of response tokens; "
          f"{sum(p.numel() for p in model.parameters())} parameters; {total} steps of <= {args.batch_tokens} tokens "
          f"({epoch_batches} per epoch), "
          f"ttt {args.ttt}; {'resuming at step %d' % step if state else 'starting'}", file=sys.stderr, flush=True)
    val_batches = make_batches(val, args.batch_tokens, random.Random(1))
    warm = max(1, min(args.warmup, total // 10))

    def lr_at(i):
        if i < warm:
            return args.lr * (i + 1) / warm
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (i - warm) / max(1, total - warm))))

    t0 = time.time()
    seen_tokens, hits, counts_s, loss_sum, n_loss = 0, np.zeros(args.ttt), np.zeros(args.ttt), 0.0, 0
    record = state["record"] if state else {}
    if init:
        record["init"] = {"from": str(args.init), "record": init[2]}
    weights = [0.8 ** s for s in range(args.ttt)]
    val_acc = None
    run_steps = 0
    while step < total:
        epoch = step // epoch_batches
        batches = make_batches(trn, args.batch_tokens, random.Random(args.seed * 1000 + epoch))
        for idx in batches[step % epoch_batches:]:
            if step >= total:
                break
            for gr in opt.param_groups:
                gr["lr"] = lr_at(step)
            batch = collate(data, trn, idx, args.ttt, t2d_index)
            loss_sum += train_step(model, opt, batch, embed, args.ttt, weights, args.clip, hits, counts_s)
            step += 1
            run_steps += 1
            seen_tokens += int(batch[0].shape[0] * batch[0].shape[1])
            n_loss += 1
            last = step == total
            if step % args.log_every == 0 or last:
                el = time.time() - t0
                acc = hits / np.maximum(counts_s, 1)
                print(f"train: step {step}/{total} epoch {epoch + 1} loss {loss_sum / n_loss:.3f} top-1 by step "
                      + " ".join(f"{a:.3f}" for a in acc)
                      + f"  lr {lr_at(step - 1):.2e}  {seen_tokens / el:.0f} tok/s, "
                      f"{fmt_time(el / run_steps * (total - step))} left", file=sys.stderr, flush=True)
                record["train_top1_by_step"] = [round(float(a), 4) for a in acc]
                record["train_loss"] = round(loss_sum / n_loss, 4)
                hits[:], counts_s[:], loss_sum, n_loss = 0, 0, 0.0, 0
            stop = args.stop_after and run_steps == args.stop_after and not last
            if step % args.save_every == 0 or last or stop:
                if val_batches:
                    val_acc = evaluate(model, data, val, val_batches, args.ttt, t2d_index, embed)
                    print("train: validation top-1 by step " + " ".join(f"{a:.3f}" for a in val_acc),
                          file=sys.stderr, flush=True)
                    record["val_top1_by_step"] = [round(float(a), 4) for a in val_acc]
                record.update({"steps": step, "total_steps": total, "ttt_steps": args.ttt, "lr": args.lr,
                               "batch_tokens": args.batch_tokens, "train_sequences": len(trn),
                               "train_tokens": tokens, "train_response_tokens": resp, "val_sequences": len(val),
                               "val_prompt_index": sorted(s[5] for s in val),
                               "draft_vocab_size": len(ids), "draft_vocab_coverage": round(float(coverage), 4),
                               "seconds": round(t_prev + time.time() - t0, 1),
                               "target_model": info.get("model"),
                               "features": {k: info[k] for k in ("prompt_count", "max_new_tokens", "temperature",
                                                                 "capture_layers", "topk")}})
                state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "total_steps": total,
                         "seconds": t_prev + time.time() - t0, "draft_ids": ids.tolist(), "record": record,
                         "args": run_args}
                save_checkpoint(ckpt_path, state)
            if stop:
                print(f"train: stopping after {run_steps} steps as asked (--stop-after); checkpoint at step {step}, "
                      "rerun to resume", file=sys.stderr, flush=True)
                return
    state = torch.load(ckpt_path, map_location="cpu")
    head = export(out, state, info)
    print(f"train: done, {state['step']} steps in {fmt_time(state['seconds'])}; head written to {head}",
          file=sys.stderr, flush=True)


def train_stream(args):
    """One pass over the shards in order, as dump-features writes them."""
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.pt"
    data = ShardStream(args.features, args.wait_seconds)
    info = data.info
    V = int(info["target_vocab"])
    n_val, n_vocab = args.val_shards, max(args.vocab_shards, 1)
    if data.n_shards <= n_val:
        raise SystemExit(f"train: {data.n_shards} shards leave none to train on after --val-shards {n_val}")
    resume = ckpt_path.exists() and not args.fresh
    state = torch.load(ckpt_path, map_location="cpu") if resume else None
    run_args = {"features_dir": str(Path(args.features).resolve()), "shards": data.n_shards, "stream": True,
                "batch_tokens": args.batch_tokens, "seed": args.seed, "ttt": args.ttt, "val_shards": n_val,
                "vocab_shards": n_vocab, "draft_vocab": args.draft_vocab, "init": args.init}
    if state:
        diff = [f"{k} {state['args'].get(k)} (now {v})" for k, v in run_args.items() if state["args"].get(k) != v]
        if diff:
            raise SystemExit(f"train: {ckpt_path} was made with " + ", ".join(diff) +
                             "; rerun with those settings to resume, or use --fresh or another --out")
    # Validation shards are copied to OUT and consumed at once, so that
    # every shard of the dump is consumed in order (dump-features counts
    # the shards waiting before the first one not consumed).
    val, record = [], {}
    for k in range(n_val):
        copy = out / f"val-{data.path(k).name}"
        if not copy.exists():
            shutil.copyfile(data.get_path(k), str(copy) + ".tmp")
            os.replace(str(copy) + ".tmp", copy)
        val += load_shard(copy)
        if args.delete_consumed:
            data.consume(k)
    init = load_init(args.init, info, args.draft_vocab) if args.init and not state else None
    if state:
        ids = np.asarray(state["draft_ids"], dtype=np.int64)
    elif init:
        # Training goes on from an earlier head: its vocabulary stays, so
        # that its lm_head rows keep their meaning.
        ids = init[1]
        record["init"] = {"from": str(args.init), "record": init[2]}
    else:
        # The vocabulary must be fixed before the first step: the most
        # frequent response tokens of the first training shards (kept on
        # disk until they are trained on, so nothing is read twice from a
        # deleted file).
        first = [s for k in range(n_val, min(n_val + n_vocab, data.n_shards)) for s in data.get(k)]
        ids = draft_vocabulary(response_counts(first, V), args.draft_vocab)
        record["vocab_coverage_by_size"] = coverage_table(first, V, (2048, 4096, 8192, 16384))
        print("train: coverage of response tokens by draft vocabulary size (chosen on half of the vocabulary shards, "
              "counted on the other): " + ", ".join(f"{r['draft_vocab']} {r['coverage_unseen']:.1%}"
                                                   for r in record["vocab_coverage_by_size"]),
              file=sys.stderr, flush=True)
    t2d_index = np.full(V, -1, dtype=np.int64)
    t2d_index[ids] = np.arange(len(ids))
    model = Eagle3Head(head_config(info, len(ids)))
    embed = torch.from_numpy(data.embed.astype(np.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    shard, batch, step, t_prev = n_val, 0, 0, 0.0
    counts = np.zeros(V, dtype=np.int64)  # response tokens trained on, for the coverage actually seen
    if init:
        model.load_state_dict(init[0])
    if state:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        shard, batch, step, t_prev = state["shard"], state["batch"], state["step"], state["seconds"]
        record, counts = state["record"], np.asarray(state["counts"], dtype=np.int64)
    n_train = data.n_shards - n_val
    print(f"train: streaming {n_train} shards of {info['shard_size']} sequences from {args.features}, "
          f"{n_val} kept for validation ({len(val)} sequences); draft vocabulary {len(ids)}; ttt {args.ttt}; "
          f"{'resuming at shard %d batch %d (step %d)' % (shard, batch, step) if state else 'starting'}"
          f"{' from ' + args.init if init else ''}",
          file=sys.stderr, flush=True)
    val_batches = make_batches(val, args.batch_tokens, random.Random(1))
    weights = [0.8 ** s for s in range(args.ttt)]

    def lr_at(progress):  # progress in [0, 1] over the training shards
        w = args.warmup_fraction
        if progress < w:
            return args.lr * max(progress / w, 0.02)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (progress - w) / max(1e-9, 1 - w))))

    def save(shard_at, batch_at):
        record.update({"steps": step, "ttt_steps": args.ttt, "lr": args.lr, "batch_tokens": args.batch_tokens,
                       "stream": True, "train_shards": shard_at - n_val, "val_sequences": len(val),
                       "val_prompt_index": sorted(s[5] for s in val), "train_response_tokens": int(counts.sum()),
                       "draft_vocab_size": len(ids),
                       "draft_vocab_coverage": round(float(counts[ids].sum() / max(counts.sum(), 1)), 4),
                       "seconds": round(t_prev + time.time() - t0, 1), "target_model": info.get("model"),
                       "features": {k: info[k] for k in ("prompt_count", "max_new_tokens", "temperature",
                                                         "capture_layers", "topk")}})
        save_checkpoint(ckpt_path, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                                    "shard": shard_at, "batch": batch_at, "seconds": t_prev + time.time() - t0,
                                    "draft_ids": ids.tolist(), "record": record, "args": run_args,
                                    "counts": counts.tolist()})

    t0, run_steps, seen = time.time(), 0, 0
    hits, cnt, loss_sum, n_loss = np.zeros(args.ttt), np.zeros(args.ttt), 0.0, 0
    while shard < data.n_shards:
        if shard > n_val and args.delete_consumed:
            data.consume(shard - 1)  # left by a run stopped between its checkpoint and this
        seqs = data.get(shard)
        batches = make_batches(seqs, args.batch_tokens, random.Random(args.seed * 1000003 + shard))
        if batch == 0:
            counts += response_counts(seqs, V)
        for b in range(batch, len(batches)):
            for gr in opt.param_groups:
                gr["lr"] = lr_at((shard - n_val + b / len(batches)) / n_train)
            batch = collate(data, seqs, batches[b], args.ttt, t2d_index)
            loss_sum += train_step(model, opt, batch, embed, args.ttt, weights, args.clip, hits, cnt)
            step += 1
            run_steps += 1
            seen += int(batch[0].shape[0] * batch[0].shape[1])
            n_loss += 1
            if step % args.log_every == 0:
                el = time.time() - t0
                done = (shard - n_val + (b + 1) / len(batches)) / n_train
                acc = hits / np.maximum(cnt, 1)
                print(f"train: step {step} shard {shard + 1}/{data.n_shards} loss {loss_sum / n_loss:.3f} top-1 by "
                      "step " + " ".join(f"{a:.3f}" for a in acc) + f"  {seen / el:.0f} tok/s", file=sys.stderr,
                      flush=True)
                record["train_top1_by_step"] = [round(float(a), 4) for a in acc]
                record["train_loss"] = round(loss_sum / n_loss, 4)
                hits[:], cnt[:], loss_sum, n_loss = 0, 0, 0.0, 0
            if args.stop_after and run_steps == args.stop_after and (b + 1 < len(batches)
                                                                     or shard + 1 < data.n_shards):
                save(shard, b + 1) if b + 1 < len(batches) else save(shard + 1, 0)
                print(f"train: stopping after {run_steps} steps as asked (--stop-after); checkpoint at step {step}, "
                      "rerun to resume", file=sys.stderr, flush=True)
                return
        shard, batch = shard + 1, 0
        last = shard == data.n_shards
        if val_batches and ((shard - n_val) % args.val_every == 0 or last):
            va = evaluate(model, data, val, val_batches, args.ttt, t2d_index, embed)
            print("train: validation top-1 by step " + " ".join(f"{a:.3f}" for a in va), file=sys.stderr, flush=True)
            record["val_top1_by_step"] = [round(float(a), 4) for a in va]
        save(shard, 0)
        if args.delete_consumed and shard - 1 >= n_val:
            data.consume(shard - 1)
    state = torch.load(ckpt_path, map_location="cpu")
    head = export(out, state, info)
    print(f"train: done, {state['step']} steps in {fmt_time(state['seconds'])}; head written to {head}",
          file=sys.stderr, flush=True)


def vocab_coverage(args):
    """Coverage of response tokens: vocabulary from the first half of the
    sequences, counted on the second half (so the figure is what unseen
    data gets)."""
    d = Path(args.features)
    V = int(json.loads((d / "features.json").read_text())["target_vocab"])
    seqs = []
    for p in sorted(d.glob("shard-*.safetensors")):
        seqs += load_shard(p)
    c = response_counts(seqs, V)
    print(json.dumps({"sequences": len(seqs), "response_tokens": int(c.sum()), "distinct_response_tokens":
                      int((c > 0).sum()), "sizes": coverage_table(seqs, V, [int(x) for x in args.sizes.split(",")])}))


def coverage_table(seqs, V, sizes):
    half = len(seqs) // 2
    a, b = response_counts(seqs[:half], V), response_counts(seqs[half:], V)
    rows = []
    for size in sizes:
        ids = draft_vocabulary(a, size)
        rows.append({"draft_vocab": size, "coverage_unseen": round(float(b[ids].sum() / max(b.sum(), 1)), 4),
                     "coverage_seen": round(float(a[ids].sum() / max(a.sum(), 1)), 4)})
    return rows


def load_init(path, info, draft_vocab):
    """Weights, draft vocabulary and record of an earlier head directory or
    checkpoint, to train further under a new schedule; its vocabulary must
    have draft_vocab tokens."""
    p = Path(path)
    if p.is_dir():
        model, d2t = load_head(p)
        rec = json.loads((p / "training.json").read_text()) if (p / "training.json").exists() else {}
        init = model.state_dict(), (d2t + np.arange(len(d2t))).astype(np.int64), rec
    else:
        st = torch.load(p, map_location="cpu")
        init = st["model"], np.asarray(st["draft_ids"], dtype=np.int64), st.get("record", {})
    if len(init[1]) != draft_vocab:
        raise SystemExit(f"train: --init {path} has a draft vocabulary of {len(init[1])}, not --draft-vocab "
                         f"{draft_vocab}")
    return init


def load_head(head_dir):
    cfg = json.loads((Path(head_dir) / "config.json").read_text())
    t, _ = st_read(Path(head_dir) / "model.safetensors")
    model = Eagle3Head(cfg)
    sd = {k: torch.from_numpy(v.astype(np.float32)) for k, v in t.items() if k not in ("d2t", "t2d")}
    model.load_state_dict(sd)
    return model, t["d2t"]


def reference(args):
    data = Features(args.features)
    model, d2t = load_head(args.head)
    ids, hid, _, _, _, _ = data.seqs[0]
    n = min(args.pairs, len(ids) - 1)
    feat = torch.from_numpy(hid[:n].astype(np.float32))
    toks = torch.from_numpy(ids[1:n + 1].astype(np.int64))
    embed = torch.from_numpy(data.embed.astype(np.float32))
    with torch.no_grad():
        logits = model.first_step(feat, toks, embed)
    st_write(args.out, [("features", feat.numpy()), ("tokens", toks.numpy().astype(np.int32)),
                        ("logits", logits.numpy().astype(np.float32))])
    print(f"reference: {n} pairs, logits [{n}, {logits.shape[1]}] written to {args.out}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--features", required=True, help="dump-features output directory")
    t.add_argument("--out", required=True, help="checkpoint and export directory")
    t.add_argument("--draft-vocab", type=int, default=4096)
    t.add_argument("--ttt", type=int, default=3, help="unrolled draft steps per position")
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--steps", type=int, default=0, help="optimiser steps (overrides --epochs)")
    t.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per batch")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--val-fraction", type=float, default=0.02)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--save-every", type=int, default=200)
    t.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    t.add_argument("--seed", type=int, default=1)
    t.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    t.add_argument("--init", help="start from this head directory or checkpoint (its draft vocabulary kept) "
                                  "instead of random weights")
    t.add_argument("--stop-after", type=int, default=0,
                   help="stop after this many steps of this run, as an interruption would (rerun to resume)")
    t.add_argument("--stream", action="store_true",
                   help="one pass over the shards as dump-features writes them (see the top of this file)")
    t.add_argument("--delete-consumed", action="store_true",
                   help="with --stream: replace each shard trained on by an empty shard-NNNNN.consumed")
    t.add_argument("--val-shards", type=int, default=1, help="with --stream: first shards kept for validation")
    t.add_argument("--vocab-shards", type=int, default=8,
                   help="with --stream: training shards whose response tokens choose the draft vocabulary "
                        "(at most dump-features' --max-pending)")
    t.add_argument("--val-every", type=int, default=20, help="with --stream: validate every this many shards")
    t.add_argument("--warmup-fraction", type=float, default=0.02, help="with --stream: of the pass, warm-up")
    t.add_argument("--wait-seconds", type=float, default=7200,
                   help="with --stream: how long to wait for dump-features to write the next shard")
    v = sub.add_parser("vocab")
    v.add_argument("--features", required=True)
    v.add_argument("--sizes", default="2048,4096,8192,16384")
    e = sub.add_parser("export")
    e.add_argument("--out", required=True)
    e.add_argument("--features", required=True)
    r = sub.add_parser("reference")
    r.add_argument("--head", required=True)
    r.add_argument("--features", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--pairs", type=int, default=16)
    args = ap.parse_args()
    if args.cmd == "train":
        train_stream(args) if args.stream else train(args)
    elif args.cmd == "vocab":
        vocab_coverage(args)
    elif args.cmd == "export":
        info = json.loads((Path(args.features) / "features.json").read_text())
        state = torch.load(Path(args.out) / "checkpoint.pt", map_location="cpu")
        print(f"export: {export(args.out, state, info)}", file=sys.stderr)
    else:
        reference(args)


if __name__ == "__main__":
    main()
