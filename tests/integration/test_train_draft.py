"""The EAGLE-3 training pipeline end to end on a tiny model: gen-prompts,
dump-features, tools/train_eagle3.py (train, export, reference), and the
exported head loaded by aerie to generate. The model is a tiny random
Llama with SmolLM2's tokenizer (tools/gen_tiny_chat_model.py), so the
whole pipeline runs in well under two minutes."""
import json
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

TRAINER = ROOT / "tools" / "train_eagle3.py"
CAPTURE = [1, 2, 3]
PUBLISHED = {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
             "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
             "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
             "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
             "midlayer.post_attention_layernorm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}


def st_read(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    types = {"F16": np.float16, "F32": np.float32, "I32": np.int32, "I64": np.int64, "BOOL": np.bool_}
    out = {}
    for name, e in header.items():
        a, b = e["data_offsets"]
        out[name] = (e["dtype"], np.frombuffer(raw[8 + n + a:8 + n + b], dtype=types[e["dtype"]]).reshape(e["shape"]))
    return out


def trainer(*args, check=True):
    r = subprocess.run([sys.executable, str(TRAINER), *map(str, args)], capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def pipeline(aerie, tmp_path_factory):
    """Runs each stage once; the tests below check what each one left."""
    if subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode != 0:
        pytest.fail("PyTorch is missing: run tools/deps.sh (it installs python3-torch)")
    d = tmp_path_factory.mktemp("pipeline")
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_tiny_chat_model.py"), str(d / "model")], check=True)
    p = {"dir": d, "model": d / "model", "prompts": d / "prompts", "features": d / "features", "train": d / "train"}
    r = aerie("gen-prompts", "--model", p["model"], "--out", p["prompts"], "--count", "14", "--heldout", "3",
              "--max-tokens", "12", "--keep-cut", "--threads", "1")
    assert r.rc == 0, r.err
    p["gen_prompts"] = r.json()
    r = aerie("dump-features", "--model", p["model"], "--prompts", p["prompts"] / "train.jsonl", "--out",
              p["features"], "--max-new-tokens", "24", "--shard-size", "4", "--capture", "1,2,3", "--threads", "1")
    assert r.rc == 0, r.err
    p["dump_err"] = r.err
    r = trainer("train", "--features", p["features"], "--out", p["train"], "--steps", "8", "--draft-vocab", "256",
                "--batch-tokens", "256", "--save-every", "4", "--log-every", "2", "--threads", "1")
    p["train_err"] = r.stderr
    p["head"] = p["train"] / "head"
    return p


def test_prompts_are_distinct_and_held_out_apart(pipeline, aerie):
    g = pipeline["gen_prompts"]
    assert (g["train"], g["heldout"]) == (11, 3)
    train = [json.loads(x)["prompt"] for x in (pipeline["prompts"] / "train.jsonl").read_text().splitlines()]
    held = [json.loads(x)["prompt"] for x in (pipeline["prompts"] / "heldout.jsonl").read_text().splitlines()]
    assert len(train) == 11 and len(held) == 3
    assert len(set(train + held)) == 14 and all(t.strip() == t and t for t in train + held)
    # Sequence i samples from its own stream: the batch size changes nothing.
    again = pipeline["dir"] / "prompts-again"
    r = aerie("gen-prompts", "--model", pipeline["model"], "--out", again, "--count", "14", "--heldout", "3",
              "--max-tokens", "12", "--keep-cut", "--threads", "1", "--max-batch", "3")
    assert r.rc == 0, r.err
    for f in ("train.jsonl", "heldout.jsonl"):
        assert (again / f).read_bytes() == (pipeline["prompts"] / f).read_bytes()


def test_gen_prompts_refuses_a_cold_temperature(pipeline, aerie):
    r = aerie("gen-prompts", "--model", pipeline["model"], "--out", pipeline["dir"] / "cold", "--temperature", "0.5")
    assert r.rc == 2 and "temperature" in r.err and "0.8" in r.err


def test_shards_hold_features_and_the_targets_next_token(pipeline):
    f = pipeline["features"]
    info = json.loads((f / "features.json").read_text())
    assert info["capture_layers"] == CAPTURE and info["shards"] == 3 and info["prompt_count"] == 11
    shards = sorted(f.glob("shard-*.safetensors"))
    assert [s.name for s in shards] == ["shard-00000.safetensors", "shard-00001.safetensors",
                                        "shard-00002.safetensors"]
    seen = []
    for s in shards:
        t = st_read(s)
        ids, hid, tki, tkp = t["input_ids"][1], t["hidden"][1], t["topk_ids"][1], t["topk_p"][1]
        lens, plens = t["lengths"][1], t["prompt_lengths"][1]
        assert t["hidden"][0] == "F16" and hid.shape == (len(ids), 3 * 64) and tki.shape == (len(ids), 8)
        assert lens.sum() == len(ids)
        seen += t["prompt_index"][1].tolist()
        at = 0
        for n, pl in zip(lens.tolist(), plens.tolist()):
            assert n == pl + 24  # the tiny model never says <|im_end|> greedily within 24 tokens
            rows = slice(at + pl - 1, at + n - 1)
            # Greedy responses: each response token is the target's top-1.
            assert np.array_equal(tki[rows, 0], ids[at + pl:at + n])
            p = tkp[rows].astype(np.float32)
            assert np.all(np.diff(p, axis=1) <= 0) and np.all(p.sum(axis=1) <= 1.001) and np.all(p[:, 0] > 0)
            assert not tkp[at:at + pl - 1].any() and not tkp[at + n - 1].any()
            assert np.all(np.abs(hid[at:at + n - 1].astype(np.float32)).sum(axis=1) > 0)
            assert not hid[at + n - 1].any()
            at += n
    assert seen == list(range(11))
    emb = st_read(f / "target_embed.safetensors")["embed"]
    assert emb[0] == "F32" and emb[1].shape == (49152, 64)


def test_dump_resumes_after_the_last_shard_written(pipeline, aerie):
    f = pipeline["features"]
    copy = pipeline["dir"] / "features-resumed"
    shutil.copytree(f, copy)
    (copy / "shard-00002.safetensors").unlink()
    (copy / "shard-00001.safetensors").unlink()
    args = ["dump-features", "--model", pipeline["model"], "--prompts", pipeline["prompts"] / "train.jsonl",
            "--out", copy, "--max-new-tokens", "24", "--shard-size", "4", "--capture", "1,2,3", "--threads", "1"]
    r = aerie(*args)
    assert r.rc == 0, r.err
    assert "resuming after the shards already written" in r.err
    assert r.json()["tokens_this_run"] == sum(st_read(f / s)["lengths"][1].sum()
                                              for s in ("shard-00001.safetensors", "shard-00002.safetensors"))
    for s in sorted(f.glob("shard-*.safetensors")):
        assert (copy / s.name).read_bytes() == s.read_bytes()
    # Other settings would mix two dumps in one directory: refused.
    r = aerie(*args[:-4], "--max-new-tokens", "16", "--shard-size", "4", "--capture", "1,2,3")
    assert r.rc == 2 and "other settings" in r.err


def test_trainer_reports_progress_and_exports_the_published_layout(pipeline):
    err = pipeline["train_err"]
    assert "train: step 8/8" in err and "top-1 by step" in err and "validation top-1 by step" in err
    head = pipeline["head"]
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["hidden_size"] == 64 and cfg["vocab_size"] == 49152 and cfg["draft_vocab_size"] == 256
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == CAPTURE
    t = st_read(head / "model.safetensors")
    assert set(t) == PUBLISHED
    assert all(t[n][0] == "F16" for n in PUBLISHED - {"d2t", "t2d"})
    d2t, t2d = t["d2t"][1], t["t2d"][1]
    assert t["d2t"][0] == "I64" and t["t2d"][0] == "BOOL" and d2t.shape == (256,) and t2d.shape == (49152,)
    ids = d2t + np.arange(256)
    assert np.all(np.diff(ids) > 0) and np.array_equal(np.flatnonzero(t2d), ids)
    rec = json.loads((head / "training.json").read_text())
    assert rec["steps"] == 8 and rec["draft_vocab_size"] == 256 and len(rec["train_top1_by_step"]) == 3
    assert len(rec["val_prompt_index"]) == rec["val_sequences"] == 1
    # The draft vocabulary: the most frequent response tokens of the
    # training sequences (the validation one not counted).
    counts = np.zeros(49152, dtype=np.int64)
    for s in sorted(pipeline["features"].glob("shard-*.safetensors")):
        st = st_read(s)
        at = 0
        for n, pl, i in zip(st["lengths"][1].tolist(), st["prompt_lengths"][1].tolist(),
                            st["prompt_index"][1].tolist()):
            if i not in rec["val_prompt_index"]:
                np.add.at(counts, st["input_ids"][1][at + pl:at + n], 1)
            at += n
    inside = counts[ids]
    outside = np.delete(counts, ids)
    assert inside.min() >= outside.max()
    assert rec["draft_vocab_coverage"] == pytest.approx(inside.sum() / counts.sum(), abs=1e-4)


def test_exported_head_logits_match_pytorch(pipeline, aerie):
    ref = pipeline["dir"] / "reference.safetensors"
    trainer("reference", "--head", pipeline["head"], "--features", pipeline["features"], "--out", ref, "--pairs", "40")
    got = pipeline["dir"] / "aerie-logits.safetensors"
    r = aerie("draft-logits", "--model", pipeline["model"], "--draft", pipeline["head"], "--input", ref, "--out", got)
    assert r.rc == 0, r.err
    want = st_read(ref)["logits"][1].astype(np.float64)
    have = st_read(got)["logits"][1].astype(np.float64)
    assert want.shape == have.shape == (40, 256)  # pairs in three KV blocks of 16
    rel = np.linalg.norm(have - want) / np.linalg.norm(want)
    worst = np.abs(have - want).max() / np.abs(want).max()
    assert rel < 1e-3 and worst < 1e-3, (rel, worst)


def test_exported_head_generates_exactly_the_plain_output(pipeline, aerie):
    for prompt in ["Hello there", "def f(x):", "1 2 3"]:
        args = ["generate", "--model", pipeline["model"], "--prompt", prompt, "--ids", "--max-tokens", "24",
                "--ignore-eos", "--threads", "1"]
        plain = aerie(*args)
        spec = aerie(*args, "--draft", pipeline["head"], "--stats")
        assert plain.rc == 0 and spec.rc == 0, plain.err + spec.err
        assert spec.json() == plain.json() and len(plain.json()) == 24
        st = json.loads(spec.err.strip().splitlines()[-1])
        assert st["speculation"] is True and st["bad_trees"] == 0 and st["draft_failures"] == 0


def test_eval_draft_reports_three_shapes_on_held_out_prompts(pipeline, aerie):
    r = aerie("eval-draft", "--model", pipeline["model"], "--draft", pipeline["head"], "--prompts",
              pipeline["prompts"] / "heldout.jsonl", "--max-new-tokens", "16", "--threads", "1")
    assert r.rc == 0, r.err
    o = r.json()
    assert o["prompts"] == 3 and [s["shape"] for s in o["shapes"]] == ["5/4/8", "4/1/5", "6/4/16"]
    for s in o["shapes"]:
        assert s["outputs_identical"] == 3
        steps = int(s["shape"].split("/")[0])
        assert len(s["accept_per_depth"]) == steps
        # Two counters that must agree: a token accepted at depth d + 1
        # needs one at depth d, and the accepted tokens are the sum over depths.
        depth = s["accept_per_depth"]
        assert all(a >= b for a, b in zip(depth, depth[1:]))
        assert s["mean_accept_len"] == pytest.approx(1 + sum(depth), abs=1e-3)
        assert s["decode_tok_per_s"] > 0 and s["speedup"] > 0 and 0 < s["draft_time_share"] < 1
    assert "eval-draft: 3/3 prompts" in r.err


def test_training_resumes_where_it_stopped(pipeline):
    a, b = pipeline["dir"] / "run-a", pipeline["dir"] / "run-b"
    common = ["--features", pipeline["features"], "--steps", "6", "--draft-vocab", "256", "--batch-tokens", "256",
              "--save-every", "3", "--threads", "1"]
    trainer("train", "--out", a, *common)
    # Step 2 is inside an epoch (3 batches of <= 256 tokens), so the resumed
    # run must skip exactly the batches already done.
    first = trainer("train", "--out", b, *common, "--stop-after", "2")
    assert "stopping after 2 steps" in first.stderr
    per_epoch = int(re.search(r"\((\d+) per epoch\)", first.stderr).group(1))
    assert per_epoch > 2
    refused = trainer("train", "--out", b, *common[:-6], "--batch-tokens", "512", *common[-4:], check=False)
    assert refused.returncode != 0 and "batch_tokens 256 (now 512)" in refused.stderr
    second = trainer("train", "--out", b, *common)
    assert "resuming at step 2" in second.stderr
    wa, wb = st_read(a / "head" / "model.safetensors"), st_read(b / "head" / "model.safetensors")
    for name in PUBLISHED:
        assert np.array_equal(wa[name][1], wb[name][1]), name


HELDOUT = ROOT / "tools" / "prompts" / "heldout.jsonl"


def norm(t):
    return " ".join(t.lower().split())


def test_the_committed_held_out_set_is_60_distinct_chat_prompts():
    held = [json.loads(x)["prompt"] for x in HELDOUT.read_text().splitlines()]
    assert len(held) == 66 and len({norm(h) for h in held}) == 66
    assert all(h.strip() == h and 10 <= len(h) <= 400 for h in held)


def test_training_prompts_never_contain_a_held_out_prompt(pipeline, aerie):
    """Seeds that are, or contain, held-out prompts: gen-prompts --exclude
    drops every turn that contains one, and the others start with their
    opening."""
    held = [json.loads(x)["prompt"] for x in HELDOUT.read_text().splitlines()]
    d = pipeline["dir"]
    seeds = d / "seeds.jsonl"
    openings = [held[0], "Hello", "tell me: " + held[1].upper(), "Write", held[2].replace(" ", "  "), "Why"]
    seeds.write_text("".join(json.dumps({"prompt": o}) + "\n" for o in openings))
    out = d / "seeded"
    r = aerie("gen-prompts", "--model", pipeline["model"], "--out", out, "--count", "8", "--heldout", "0",
              "--max-tokens", "6", "--keep-cut", "--threads", "1", "--seeds", seeds, "--exclude", HELDOUT)
    assert r.rc == 0, r.err
    g = r.json()
    assert g["train"] == 8 and g["seeds"] == 6
    # Attempts cycle through the 6 openings; 3 of them hold a held-out prompt.
    assert g["excluded"] == g["samples"] // 2 == 8
    train = [json.loads(x)["prompt"] for x in (out / "train.jsonl").read_text().splitlines()]
    assert not any(norm(h) in norm(t) for t in train for h in held)
    # Kept in attempt order: openings 1, 3, 5, 1, 3, 5, 1, 3.
    starts = [next(o for o in ("Hello", "Why", "Write") if t.startswith(o)) for t in train]
    assert starts == ["Hello", "Write", "Why"] * 2 + ["Hello", "Write"]


def test_vocab_reports_coverage_on_sequences_it_did_not_choose_from(pipeline):
    r = trainer("vocab", "--features", pipeline["features"], "--sizes", "16,256,4096")
    o = json.loads(r.stdout)
    assert o["sequences"] == 11
    seqs = []
    for s in sorted(pipeline["features"].glob("shard-*.safetensors")):
        st = st_read(s)
        at = 0
        for n, pl in zip(st["lengths"][1].tolist(), st["prompt_lengths"][1].tolist()):
            seqs.append(st["input_ids"][1][at + pl:at + n])
            at += n
    first, second = np.concatenate(seqs[:5]), np.concatenate(seqs[5:])
    cov = [x["coverage_unseen"] for x in o["sizes"]]
    assert cov == sorted(cov) and o["sizes"][2]["coverage_seen"] == 1.0
    top = np.argsort(-np.bincount(first, minlength=49152), kind="stable")[:256]
    assert cov[1] == pytest.approx(np.isin(second, top).mean(), abs=1e-4)


def test_stream_training_interrupted_and_resumed_matches_an_uninterrupted_run(pipeline, aerie):
    """dump-features and a streaming trainer run together; both are stopped
    part way and run again. The head is bit for bit the one trained in one
    go, and the trainer left only markers of the shards it consumed."""
    import os
    import signal
    import time
    from conftest import aerie_bin
    d = pipeline["dir"]
    dump = ["dump-features", "--model", pipeline["model"], "--prompts", pipeline["prompts"] / "train.jsonl",
            "--max-new-tokens", "24", "--shard-size", "2", "--capture", "1,2,3", "--threads", "1"]
    common = ["--stream", "--val-shards", "1", "--vocab-shards", "2", "--draft-vocab", "256", "--batch-tokens",
              "128", "--threads", "1", "--log-every", "1", "--wait-seconds", "120"]
    whole = d / "stream-whole"
    r = aerie(*dump, "--out", whole)
    assert r.rc == 0, r.err
    trainer("train", "--features", whole, "--out", d / "stream-a", *common)
    assert len(list(whole.glob("shard-*.safetensors"))) == 6

    live = d / "stream-live"
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1")
    p = subprocess.Popen([str(aerie_bin()), *map(str, dump), "--out", live, "--max-pending", "2"],
                         stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    # Nobody consumes yet: the dump pauses at 2 pending shards; stop it there.
    deadline = time.time() + 60
    while len(list(live.glob("shard-*.safetensors"))) < 2 and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    assert len(list(live.glob("shard-*.safetensors"))) == 2 and p.poll() is None
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)
    # The trainer waits for shards; it is stopped part way through its pass.
    p = subprocess.Popen([str(aerie_bin()), *map(str, dump), "--out", live, "--max-pending", "2"],
                         stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    first = trainer("train", "--features", live, "--out", d / "stream-b", *common, "--delete-consumed",
                    "--stop-after", "3")
    assert "stopping after 3 steps" in first.stderr
    second = trainer("train", "--features", live, "--out", d / "stream-b", *common, "--delete-consumed")
    assert re.search(r"resuming at shard \d batch \d \(step 3\)", second.stderr), second.stderr
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "resuming after the shards already written" in err and "pausing until it consumes one" in err
    # The validation shard went to the trainer's directory; every shard was consumed.
    assert sorted(f.name for f in live.glob("shard-*")) == [f"shard-{k:05d}.consumed" for k in range(6)]
    assert all((live / f"shard-{k:05d}.consumed").stat().st_size == 0 for k in range(6))
    assert (d / "stream-b" / "val-shard-00000.safetensors").read_bytes() == \
        (whole / "shard-00000.safetensors").read_bytes()
    wa, wb = st_read(d / "stream-a" / "head" / "model.safetensors"), st_read(d / "stream-b" / "head" / "model.safetensors")
    for name in PUBLISHED:
        assert np.array_equal(wa[name][1], wb[name][1]), name
    rec = json.loads((d / "stream-b" / "head" / "training.json").read_text())
    assert rec["stream"] is True and rec["train_shards"] == 5 and rec["val_sequences"] == 2
    assert rec["ttt_steps"] == 3 and len(rec["val_top1_by_step"]) == 3


def test_stream_training_goes_on_from_an_earlier_head(pipeline, aerie):
    """--init with --stream (train-draft's INIT): the trainer starts from the
    head's weights and keeps its draft vocabulary, records what it started
    from, and refuses a head whose vocabulary has another size. At a
    learning rate too small to move an fp16 weight, the head it exports is
    the one it started from, bit for bit."""
    d = pipeline["dir"]
    feats = d / "init-features"
    r = aerie("dump-features", "--model", pipeline["model"], "--prompts", pipeline["prompts"] / "train.jsonl",
              "--max-new-tokens", "24", "--shard-size", "2", "--capture", "1,2,3", "--threads", "1", "--out", feats)
    assert r.rc == 0, r.err
    base = ["--stream", "--val-shards", "1", "--vocab-shards", "2", "--batch-tokens", "128", "--threads", "1",
            "--log-every", "1"]
    common = [*base, "--draft-vocab", "256"]
    trainer("train", "--features", feats, "--out", d / "init-first", *common)
    first = d / "init-first" / "head"
    again = trainer("train", "--features", feats, "--out", d / "init-again", *common, "--init", first, "--lr", "1e-12")
    assert f"starting from {first}" in again.stderr, again.stderr
    wa, wb = st_read(first / "model.safetensors"), st_read(d / "init-again" / "head" / "model.safetensors")
    for name in PUBLISHED:
        assert np.array_equal(wa[name][1], wb[name][1]), name
    rec = json.loads((d / "init-again" / "head" / "training.json").read_text())
    assert rec["init"]["from"] == str(first) and rec["init"]["record"]["train_shards"] == 5
    bad = trainer("train", "--features", feats, "--out", d / "init-bad", *base, "--draft-vocab", "128", "--init", first,
                  check=False)
    assert bad.returncode != 0
    assert f"--init {first} has a draft vocabulary of 256, not --draft-vocab 128" in bad.stderr
