"""The services and aerie bench on --device cuda, on a machine with no GPU.

The draft service runs its head on --device cuda the same way: the head,
its copy of the target's embedding table and its KV in the backend's
buffers, features uploaded and draft probabilities downloaded.

build/shim/libaerie-cuda.so is the CUDA plugin's sources built against the
CPU stand-in for CUDA (kernels/cuda/shim), so `--device cuda` takes the
path it takes on a GPU: the plugin opened with dlopen, the model copied
into the backend's buffers, every step's inputs uploaded and its logits
downloaded, and the memory plan made of the device's memory. The model is
a small random Llama (aerie make-model): the shim is far slower than the
CPU backend."""
import json
import os
import signal
import subprocess

import pytest

import aerie_rpc as rpc
from conftest import ROOT, run_aerie

SHIM = ROOT / "build" / "shim" / "libaerie-cuda.so"
TARGET = ROOT / "build" / "aerie-target"
DRAFT = ROOT / "build" / "aerie-draft"
EAGLE = ROOT / "tests" / "golden" / "eagle" / "tiny"  # a 6-layer target of vocabulary 32 and its head
PROMPTS = [[1, 17, 300, 42, 9, 250], [5, 5, 480, 3]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("cuda") / "tiny-q4_1.gguf"
    r = run_aerie("make-model", "--shape", "smollm2-135m", "--layers", "2", "--vocab", "512", "--type", "q4_1",
                  "--out", path)
    assert r.rc == 0, r.err
    made = json.loads(r.out)
    assert made["layers"] == 2 and made["vocab"] == 512
    return path


def env_with_shim():
    env = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
    env["AERIE_CUDA_LIB"] = str(SHIM)
    return env


def serve(model, device, tmp_path, *extra, env=None):
    tag = "-".join([device, *map(str, extra)]).replace("--", "")
    addr = f"unix:{tmp_path}/{tag}.sock"
    log = open(tmp_path / f"{tag}.log", "w")
    p = subprocess.Popen([str(TARGET), "--model", str(model), "--listen", addr, "--device", device, "--max-batch", "4",
                          "--max-seq-len", "64", "--threads", "2", "--log-interval-s", "0", *map(str, extra)],
                         stdout=log, stderr=subprocess.STDOUT, env=env or env_with_shim(), cwd=ROOT)
    rpc.wait_for_socket(addr, p)
    try:
        c = rpc.Conn(addr)
        ids = [rpc.start_generate(c, prompt, MAX_TOKENS, ignore_eos=True) for prompt in PROMPTS]
        # and one sampled: on cuda each token is drawn on the device (kn_sample)
        ids.append(rpc.start_generate(c, PROMPTS[0], MAX_TOKENS, ignore_eos=True, temperature=0.9, top_k=8,
                                      seed=5))
        streams = rpc.collect(c, ids)
        c.close()
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) == 0
        log.close()
    for cid in ids:
        assert streams[cid].status == "OK", streams[cid].error
    return [streams[cid].tokens for cid in ids], (tmp_path / f"{tag}.log").read_text()


def test_target_on_the_cuda_backend_serves_the_cpu_backends_tokens(tiny, tmp_path):
    cpu, _ = serve(tiny, "cpu", tmp_path)
    cuda, log = serve(tiny, "cuda", tmp_path)
    assert all(len(t) == MAX_TOKENS for t in cpu)
    assert cpu[2] != cpu[0]  # the sampled request is not greedy's
    assert cuda == cpu
    # the device and its memory plan: the shim reports a 4096 MiB device
    assert "device cuda:0: cuda shim (CPU), compute capability 0.0, 4096 MiB of 4096 MiB free" in log
    assert "free on cuda:0 at start" in log
    assert "cuda:0: 4 GiB in all, 4 GiB free at start; this plan as the peers' settings: vLLM " \
           "--gpu-memory-utilization" in log
    # decode steps captured as graphs and replayed, with the same tokens:
    # the plan's line (2 layers x 24 + 8 + 3 launches at most), and each
    # capture's measured size, which the shim makes 4 KiB a launch
    assert "graphs = 32 step shapes (cuda-graphs, auto) x 59 nodes x 4 KiB = 7.38 MiB" in log
    captured = [line for line in log.splitlines() if " graph captured tokens=" in line]
    assert captured
    for line in captured:
        f = dict(kv.split("=") for kv in line.split() if "=" in kv)
        assert int(f["nodes"]) <= 59 and int(f["bytes"]) == 4096 * int(f["nodes"])


def test_print_config_names_the_cuda_device_and_an_impossible_gpu_plan_exits_2(tiny):
    env = env_with_shim()
    out = subprocess.run([str(TARGET), "--model", str(tiny), "--print-config"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert printed["device"] == {"value": "cuda:0", "source": "auto"}
    assert printed["deterministic"] == {"value": True, "source": "default"}
    assert printed["cuda-graphs"] == {"value": 32, "source": "auto"}
    assert "device cuda:0 (auto: a GPU is usable: cuda shim (CPU))" in out.stderr
    env["AERIE_SHIM_GPU_MIB"] = "8"  # the weights alone are 4.4 MiB: no room for a sequence of 4096
    out = subprocess.run([str(TARGET), "--model", str(tiny), "--device", "cuda", "--max-seq-len", "4096"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 2
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("aerie-target: memory plan: one sequence of max-seq-len 4096 does not fit: weights 4.41 MiB")
    assert line.endswith("> budget 0 x 8 MiB free on cuda:0 at start = 0 B; would work: no setting; more memory")
    # fast mode needs cuBLAS, which the shim has not: one line, exit 2
    env["AERIE_SHIM_GPU_MIB"] = "4096"
    out = subprocess.run([str(TARGET), "--model", str(tiny), "--device", "cuda", "--max-seq-len", "64",
                          "--no-deterministic"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == "aerie-target: fast mode: the CPU shim has no cuBLAS"
    # ranks on CUDA reduce with NCCL, which the shim has not, or the custom
    # kernel; the CPU's kind is refused there, and a kind that is none of them
    for args, line in [
            (["--tp", "2", "--allreduce", "nccl"],
             "aerie-target: --tp 2: cuda comm: nccl: the CPU shim has no NCCL (it needs a GPU)"),
            (["--tp", "2", "--allreduce", "cpu"],
             "aerie-target: --tp 2: tensor parallel: --allreduce cpu is for ranks on the CPU; the cuda backend's "
             "ranks reduce with nccl or custom"),
            (["--allreduce", "ring"], "aerie-target: --allreduce ring: not one of auto, cpu, nccl, custom")]:
        out = subprocess.run([str(TARGET), "--model", str(tiny), "--device", "cuda", "--max-seq-len", "64", *args],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        assert out.returncode == 2
        assert out.stderr.strip().splitlines()[-1] == line


def test_ranks_on_the_cuda_backend_serve_the_cpu_ranks_tokens(tiny, tmp_path):
    # Both reduce in rank order (the custom kernel on CUDA), and every op
    # keeps the CPU's bits: the same tokens, greedy and sampled.
    cpu, _ = serve(tiny, "cpu", tmp_path, "--tp", "2")
    cuda, log = serve(tiny, "cuda", tmp_path, "--tp", "2")
    assert all(len(t) == MAX_TOKENS for t in cpu)
    assert cuda == cpu
    # auto measured the custom kernel; NCCL is not in the shim, and the log says so
    assert "tensor parallel: allreduce custom (auto: custom: " in log
    assert "nccl not measured (cuda comm: nccl: the CPU shim has no NCCL (it needs a GPU))" in log
    assert "allreduces = 2 per layer x 2 layers = 4 a pass" in log
    custom, _ = serve(tiny, "cuda", tmp_path, "--tp", "3", "--allreduce", "custom")
    three, _ = serve(tiny, "cpu", tmp_path, "--tp", "3")
    assert custom == three
    # one GPU only: auto puts both ranks on it, and says why
    assert "tensor parallel: tp-devices 0,0 (auto: every rank on cuda:0; a GPU a rank from cuda:0 did not do: " \
           "--device cuda:1: cuda:1 does not exist: this machine has 1 GPU(s))" in log


def test_ranks_on_two_gpus_serve_the_cpu_ranks_tokens(tiny, tmp_path):
    # The shim with two devices: auto gives each rank its own, rank 1's
    # weights copied to cuda:1; the same tokens as two CPU ranks.
    env = env_with_shim()
    env["AERIE_SHIM_DEVICES"] = "2"
    cpu, _ = serve(tiny, "cpu", tmp_path, "--tp", "2")
    two, log = serve(tiny, "cuda", tmp_path, "--tp", "2", env=env)
    assert two == cpu
    assert "tensor parallel: tp-devices 0,1 (auto: a GPU a rank, from cuda:0)" in log
    rank = [line for line in log.splitlines() if "tensor parallel: rank " in line and " on cuda:" in line]
    assert len(rank) == 2, log
    assert "rank 0 on cuda:0: " in rank[0] and "views of the one loaded copy" in rank[0]
    assert "rank 1 on cuda:1: " in rank[1] and "MiB copied to its device" in rank[1]
    plan = [line for line in log.splitlines() if "tensor parallel: memory plan of cuda:1" in line]
    assert len(plan) == 1 and "(1 rank from rank 1): weights " in plan[0] and " MiB free at start" in plan[0], log
    # a device that is not there, named: one line, exit 2
    out = subprocess.run([str(TARGET), "--model", str(tiny), "--device", "cuda", "--max-seq-len", "64", "--tp", "2",
                          "--tp-devices", "0,5"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "aerie-target: --tp 2: --tp-devices: --device cuda:5: cuda:5 does not exist: this machine has 2 GPU(s)")
    # a second GPU too small for rank 1's part: asked for, refused at start
    # with its plan; under auto, every rank on the first GPU, and why
    env["AERIE_SHIM_GPU_MIB"] = "4096,2"
    out = subprocess.run([str(TARGET), "--model", str(tiny), "--device", "cuda", "--max-seq-len", "64", "--tp", "2",
                          "--tp-devices", "0,1"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 2
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("aerie-target: --tp 2: memory plan of cuda:1 (1 rank from rank 1): weights "), line
    assert line.endswith(" > 2.00 MiB free at start; would work: fewer KV tokens (--max-kv-tokens), more ranks, "
                         "or a GPU with more memory"), line
    small, log = serve(tiny, "cuda", tmp_path, "--tp", "2", "--max-kv-tokens", "256", env=env)
    assert small == cpu
    assert "tensor parallel: tp-devices 0,0 (auto: every rank on cuda:0; a GPU a rank from cuda:0 did not do: " \
           "memory plan of cuda:1 (1 rank from rank 1): weights " in log
    # nor where the GPUs cannot reach each other's memory
    env["AERIE_SHIM_GPU_MIB"] = "4096"
    env["AERIE_SHIM_NO_PEER"] = "1"
    apart, log = serve(tiny, "cuda", tmp_path, "--tp", "2", "--max-kv-tokens", "512", env=env)
    assert apart == cpu
    assert "tensor parallel: tp-devices 0,0 (auto: every rank on cuda:0; a GPU a rank from cuda:0 did not do: " \
           "no peer access from cuda:0 to cuda:1)" in log


def test_a_type_with_no_cuda_kernel_is_refused_by_name_not_widened(tmp_path):
    # llama.cpp's Q4_K_M mix on the 135M shape: the 576-wide rows fall back
    # to Q5_0 and Q8_0, the 1536-wide down projections are Q4_K and Q6_K.
    # The CUDA backend has kernels for none of Q5_0 and the K-quants yet.
    path = tmp_path / "tiny-q4_k_m.gguf"
    r = run_aerie("make-model", "--shape", "smollm2-135m", "--layers", "2", "--vocab", "512", "--type", "q4_k_m",
                  "--out", path)
    assert r.rc == 0, r.err
    r = subprocess.run([str(ROOT / "build" / "aerie"), "bench", "--model", str(path), "--device", "cuda",
                        "--prompt-tokens", "4", "--gen-tokens", "2", "--repeat", "1"],
                       capture_output=True, text=True, env=env_with_shim(), cwd=ROOT, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"aerie bench: {path}: tensor token_embd.weight has type Q5_0, which the cuda backend has no kernel "
        "for yet: run it with --device cpu")
    # the same file on the CPU: every matrix in its own type
    r = subprocess.run([str(ROOT / "build" / "aerie"), "bench", "--model", str(path), "--device", "cpu",
                        "--prompt-tokens", "4", "--gen-tokens", "2", "--repeat", "1", "--bandwidth-mib", "16"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["weight_bytes_per_step"] == 5239296


def test_bench_on_the_cuda_backend_measures_the_device_copy_bandwidth(tiny):
    # The release aerie, as the services here: the shim's fibers switch
    # with swapcontext under a sanitizer runtime, several times slower.
    r = subprocess.run([str(ROOT / "build" / "aerie"), "bench", "--model", str(tiny), "--device", "cuda",
                        "--prompt-tokens", "8", "--gen-tokens", "2", "--repeat", "1", "--bandwidth-mib", "16"],
                       capture_output=True, text=True, env=env_with_shim(), cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["device"] == "cuda shim (CPU)"
    assert out["bandwidth_mib"] == 16
    assert out["bandwidth_gb_per_s"] > 0 and out["decode_tok_per_s"] > 0
    assert out["weight_bytes_per_step"] == 4619520
    # every decode and verify step a graph: captured once per shape, then replayed
    assert out["cuda_graphs"] == 32
    assert out["graph_captures"] >= 1 and out["graph_replays"] >= 1
    assert 0 < out["graph_max_nodes"] <= 59
    r = subprocess.run([str(ROOT / "build" / "aerie"), "bench", "--model", str(tiny), "--device", "cuda",
                        "--prompt-tokens", "8", "--gen-tokens", "2", "--repeat", "1", "--bandwidth-mib", "16",
                        "--cuda-graphs", "0"], capture_output=True, text=True, env=env_with_shim(), cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    off = json.loads(r.stdout.strip().splitlines()[-1])
    assert off["cuda_graphs"] == 0 and off["graph_captures"] == 0 and off["graph_replays"] == 0


def start(binary, args, tag, tmp_path, env=None):
    log = open(tmp_path / f"{tag}.log", "w")
    p = subprocess.Popen([str(binary), *map(str, args)], stdout=log, stderr=subprocess.STDOUT,
                         env=env or env_with_shim(), cwd=ROOT)
    return p, log


def stop(p, log):
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 0
    log.close()


def generate(addr, prompts, n):
    c = rpc.Conn(addr)
    try:
        ids = [rpc.start_generate(c, prompt, n, ignore_eos=True) for prompt in prompts]
        streams = rpc.collect(c, ids)
    finally:
        c.close()
    for cid in ids:
        assert streams[cid].status == "OK", streams[cid].error
    return [streams[cid] for cid in ids]


def default_layer_head(tmp_path):
    """The tiny head, reading the layers the target service captures (its
    defaults) rather than the ones it was made for: its trees are then
    poor, but every one is drafted on the device and verified."""
    head = tmp_path / "head"
    head.mkdir()
    cfg = json.loads((EAGLE / "head" / "config.json").read_text())
    del cfg["eagle_config"]
    (head / "config.json").write_text(json.dumps(cfg))
    (head / "model.safetensors").symlink_to(EAGLE / "head" / "model.safetensors")
    return head


def test_draft_on_the_cuda_backend_drafts_for_a_cpu_target_and_output_is_plain(tmp_path):
    model = EAGLE / "target.gguf"
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [27, 18, 28, 18, 28]]
    n = 12
    common = ["--model", model, "--max-batch", "4", "--max-seq-len", "64", "--threads", "2", "--log-interval-s", "0",
              "--device", "cpu"]
    plain_addr = f"unix:{tmp_path}/plain.sock"
    p, log = start(TARGET, common + ["--listen", plain_addr, "--draft-addr", "none"], "plain", tmp_path)
    try:
        rpc.wait_for_socket(plain_addr, p)
        want = [s.tokens for s in generate(plain_addr, prompts, n)]
    finally:
        stop(p, log)
    assert all(len(t) == n for t in want)

    draft_addr, target_addr = f"unix:{tmp_path}/draft.sock", f"unix:{tmp_path}/target.sock"
    d, dlog = start(DRAFT, ["--model", model, "--draft", default_layer_head(tmp_path), "--device", "cuda", "--listen", draft_addr,
                            "--max-seqs", "64", "--max-seq-len", "128", "--threads", "2"], "draft", tmp_path)
    try:
        rpc.wait_for_socket(draft_addr, d)
        t, tlog = start(TARGET, common + ["--listen", target_addr, "--draft-addr", draft_addr, "--no-spec-adaptive",
                                          "--draft-deadline-ms", "60000"], "target", tmp_path)
        try:
            rpc.wait_for_socket(target_addr, t)
            streams = generate(target_addr, prompts, n)
            stats = rpc.info(target_addr)[1]
        finally:
            stop(t, tlog)
    finally:
        stop(d, dlog)
    assert [s.tokens for s in streams] == want
    steps = sum(s.events[-1].spec.steps for s in streams)
    assert steps > 0, "no drafted tree was verified"
    assert stats["draft"]["failures"] == 0 and stats["spec"]["bad_trees"] == 0
    text = (tmp_path / "draft.log").read_text()
    assert "device cuda:0: cuda shim (CPU), compute capability 0.0, 4096 MiB of 4096 MiB free" in text
    assert "memplan budget = mem-fraction 0.750 x free on cuda:0 at start 4 GiB = 3 GiB" in text
    assert "memplan host memory besides = " in text  # the probabilities it downloads, outside the GPU budget


def test_an_impossible_draft_plan_on_the_gpu_exits_2_with_the_arithmetic():
    env = env_with_shim()
    env["AERIE_SHIM_GPU_MIB"] = "2"
    out = subprocess.run([str(DRAFT), "--model", str(EAGLE / "target.gguf"), "--draft", str(EAGLE / "head"),
                          "--device", "cuda", "--max-seqs", "4096", "--max-seq-len", "4096"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("aerie-draft: memory plan does not fit: budget = mem-fraction ")
    assert "x free on cuda:0 at start 2 MiB" in line
    assert line.endswith("Lower --max-seqs (about 0 fit) or --max-seq-len, or raise --mem-fraction")
