"""deploy/: the systemd units, and the readiness and watchdog protocol the
services speak to systemd (Type=notify, WatchdogSec=).

The units are checked with `systemd-analyze verify`, which needs no
systemd as PID 1; each service is run with NOTIFY_SOCKET pointed at a
datagram socket this test reads, as systemd would.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest

from conftest import ROOT
from test_services import SERVICE_DIR

# The watchdog's pings are timed to the tenth of a second: alone
# (conftest.py's serial mark).
pytestmark = pytest.mark.serial

DEPLOY = ROOT / "deploy"
UNITS = {"aerie-gateway.service": "aerie-gateway.service", "aerie-target@.service": "aerie-target@0.service",
         "aerie-draft@.service": "aerie-draft@gpu7.service"}
ENV_FILES = {"aerie-target": "target-0.env", "aerie-draft": "draft-0.env", "aerie-gateway": "gateway.env"}


def unit_copies(tmp):
    """The units with ExecStart pointed at this checkout's build/, in tmp."""
    for name in UNITS:
        text = (DEPLOY / name).read_text()
        binary = re.match(r"aerie-[a-z]+", name).group(0)
        assert f"ExecStart=/usr/local/bin/{binary}" in text
        (tmp / name).write_text(text.replace(f"/usr/local/bin/{binary}", str(ROOT / "build" / binary)))


@pytest.mark.parametrize("template", sorted(UNITS))
def test_unit_verifies_without_a_word(tmp_path, template):
    if not shutil.which("systemd-analyze"):
        pytest.fail("systemd-analyze is missing: tools/deps.sh test installs it")
    binary = re.match(r"aerie-[a-z]+", template).group(0)
    if not (ROOT / "build" / binary).exists():
        pytest.fail(f"build/{binary} is missing: run `make all` first")
    unit_copies(tmp_path)
    # It exits 0 on a misspelt key, so any output at all is a failure.
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / UNITS[template])],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert (r.returncode, r.stdout + r.stderr) == (0, "")


def unit_keys(name):
    """{key: [value, ...]} of a unit file, in the order written."""
    kv = {}
    for line in (DEPLOY / name).read_text().splitlines():
        if re.match(r"^[A-Za-z]+=", line):
            k, v = line.split("=", 1)
            kv.setdefault(k, []).append(v)
    return kv


def test_units_share_one_static_user_and_are_hardened_for_the_gpu(tmp_path):
    for name in UNITS:
        kv = unit_keys(name)
        assert kv["Type"] == ["notify"] and kv["Restart"] == ["on-failure"]
        assert re.fullmatch(r"\d+s", kv["WatchdogSec"][0])
        assert kv["User"] == ["aerie"] and "DynamicUser" not in kv
        assert (kv["ProtectSystem"], kv["PrivateTmp"], kv["NoNewPrivileges"], kv["CapabilityBoundingSet"]) == \
            (["strict"], ["yes"], ["yes"], [""])
        assert any(v.startswith("/etc/aerie/") for v in kv["EnvironmentFile"])
        if name != "aerie-gateway.service":
            assert "PrivateDevices" not in kv
            assert sorted(kv["DeviceAllow"]) == ["char-nvidia-caps rw", "char-nvidia-frontend rw",
                                                 "char-nvidia-uvm rw"]
            assert "nvidia-persistenced.service" in kv["After"][0].split()
            cache = kv["CacheDirectory"][0]
            assert kv["Environment"] == [f"CUDA_CACHE_PATH=%C/{cache}"]
            # Each instance listens inside its own runtime directory.
            run_dir = kv["RuntimeDirectory"][0]
            assert re.search(rf"--listen unix:/run/{run_dir}/[a-z]+\.sock$", kv["ExecStart"][0])
    # The user, created in an empty root as on a fresh host.
    r = subprocess.run(["systemd-sysusers", "--dry-run", f"--root={tmp_path}", str(DEPLOY / "aerie.sysusers.conf")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Creating user 'aerie' (Aerie inference server)" in r.stdout + r.stderr


# What `systemd-analyze security` asks of a service, in all three units.
# The GPU units leave out what would break CUDA: ProcSubset=pid (hides
# /proc/driver/nvidia, which libcuda reads), PrivateUsers= (the device
# nodes' owners turn into nobody), PrivateDevices= (hides the nodes), and
# MemoryDenyWriteExecute= (not known whether CUDA maps writable-executable
# host memory: tests/gpu/run.sh checks it). UMask=0007 keeps the sockets
# connectable by the aerie group (deploy/README.md).
HARDENING = {
    "SystemCallFilter": ["@system-service"], "SystemCallErrorNumber": ["EPERM"],
    "SystemCallArchitectures": ["native"], "ProtectKernelTunables": ["yes"], "ProtectKernelModules": ["yes"],
    "ProtectKernelLogs": ["yes"], "ProtectControlGroups": ["yes"], "ProtectClock": ["yes"],
    "ProtectHostname": ["yes"], "RestrictNamespaces": ["yes"], "LockPersonality": ["yes"],
    "RestrictRealtime": ["yes"], "RestrictSUIDSGID": ["yes"], "ProtectProc": ["invisible"], "UMask": ["0007"],
}
GPU_BREAKERS = ("ProcSubset", "PrivateUsers", "PrivateDevices", "MemoryDenyWriteExecute")


def exposure(tmp, template):
    """`systemd-analyze security --offline=true`'s overall exposure of the
    unit (its instance, for a template): 0.0 (safe) to 10.0."""
    unit_copies(tmp)
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", UNITS[template]],
                       capture_output=True, text=True, cwd=tmp, timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d) (\w+)", r.stdout)
    assert m, r.stdout + r.stderr
    return float(m.group(1)), m.group(2)


@pytest.mark.parametrize("template", sorted(UNITS))
def test_unit_is_hardened_to_an_exposure_of_3_or_lower(tmp_path, capsys, template):
    if not shutil.which("systemd-analyze"):
        pytest.fail("systemd-analyze is missing: tools/deps.sh test installs it")
    score, level = exposure(tmp_path, template)
    with capsys.disabled():  # the figure belongs in the log whether or not the test passes
        print(f"\n  systemd-analyze security --offline=true {UNITS[template]}: {score} {level}")
    kv = unit_keys(template)
    wrong = [f"{k}={'|'.join(v)} (has {kv[k] if k in kv else 'none'})" for k, v in HARDENING.items() if kv.get(k) != v]
    assert wrong == [], f"{template} lacks {len(wrong)}: {', '.join(wrong)}"
    if template == "aerie-gateway.service":
        assert (kv.get("MemoryDenyWriteExecute"), kv.get("PrivateDevices")) == (["yes"], ["yes"])
    else:
        assert [k for k in GPU_BREAKERS if k in kv] == []
    # The score moves between systemd versions; the directives above do not.
    assert score <= 3.0, f"{template}: exposure {score} {level}"


@pytest.mark.parametrize("binary", sorted(ENV_FILES))
def test_example_environment_files_are_settings_shown_as_source_env(binary, model):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
    keys = []
    for f in ("aerie.env", ENV_FILES[binary]):
        for line in (DEPLOY / "etc" / f).read_text().splitlines():
            if line and not line.startswith("#"):
                k, v = line.split("=", 1)
                env[k] = v
                keys.append(k)
    env["AERIE_MODEL"] = str(model)  # the file names the GPU host's path
    r = subprocess.run([str(ROOT / "build" / binary), "--print-config"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    for k in keys:
        if k.startswith("AERIE_"):
            assert shown[k[6:].lower().replace("_", "-")]["source"] == "env", k


class Notified:
    """A service run as systemd would run it under Type=notify: its
    datagrams to NOTIFY_SOCKET are kept with their arrival times."""

    def __init__(self, tmp, binary, args, watchdog_usec, extra_env=None):
        self.path = str(tmp / "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.msgs = []
        self.done = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
        env.setdefault("ASAN_OPTIONS", "detect_leaks=1")
        env.update(NOTIFY_SOCKET=self.path, WATCHDOG_USEC=str(watchdog_usec), **(extra_env or {}))
        self.log_path = tmp / f"{binary}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([str(SERVICE_DIR / binary), *map(str, args)], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def _read(self):
        while not self.done.is_set():
            try:
                data = self.sock.recv(256)
            except socket.timeout:
                continue
            self.msgs.append((time.monotonic(), data.decode()))

    def wait_for(self, msg, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for t, m in list(self.msgs):
                if m == msg:
                    return t
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.log_path.read_text()[-2000:]}"
            time.sleep(0.05)
        pytest.fail(f"no {msg} in {timeout} s; got {[m for _, m in self.msgs][:10]}")

    def between(self, t0, t1, msg="WATCHDOG=1"):
        return [t for t, m in list(self.msgs) if m == msg and t0 <= t <= t1]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=120)
        time.sleep(0.3)  # the last datagrams
        self.done.set()
        self.reader.join(5)
        self.sock.close()
        self.log.close()
        return rc


def service_args(binary, tmp, model):
    if binary == "aerie-gateway":
        return ["--model", model, "--targets", f"unix:{tmp}/none.sock", "--port", "0", "--log-interval-s", "0"]
    args = ["--model", model, "--listen", f"unix:{tmp}/{binary}.sock"]
    return args + (["--draft-addr", "none", "--max-seq-len", "512"] if binary == "aerie-target" else [])


WATCHDOG_USEC = 1_000_000  # pings every 250 ms; a loop is stale after 500 ms


@pytest.mark.parametrize("binary", ["aerie-draft", "aerie-gateway", "aerie-target"])
def test_service_extends_start_then_ready_then_pings_at_a_quarter_interval_then_stopping(tmp_path, model, binary):
    s = Notified(tmp_path, binary, service_args(binary, tmp_path, model), WATCHDOG_USEC)
    try:
        ready = s.wait_for("READY=1", 120)
        before = [m for t, m in s.msgs if t < ready]
        assert before and set(before) == {"EXTEND_TIMEOUT_USEC=30000000"}
        time.sleep(3.1)
        pings = s.between(ready, ready + 3.0)
        assert 9 <= len(pings) <= 13, pings  # 12 at 250 ms
        assert max(b - a for a, b in zip(pings, pings[1:])) < 0.5
    finally:
        rc = s.stop()
    assert rc == 0
    order = [m for _, m in s.msgs]
    assert "STOPPING=1" in order
    assert "WATCHDOG=1" not in order[order.index("STOPPING=1"):]


@pytest.mark.parametrize("binary,loop", [("aerie-target", "scheduler"), ("aerie-target", "rpc"),
                                         ("aerie-gateway", "rpc"), ("aerie-draft", "rpc"),
                                         ("aerie-draft", "draft-worker")])
def test_one_stalled_loop_stops_the_pings(tmp_path, model, binary, loop):
    # AERIE_TEST_WATCHDOG_STALL (services/core/watchdog.h) drops that
    # loop's beats as if it hung; the other loops keep beating.
    s = Notified(tmp_path, binary, service_args(binary, tmp_path, model), WATCHDOG_USEC,
                 {"AERIE_TEST_WATCHDOG_STALL": loop})
    try:
        ready = s.wait_for("READY=1", 120)
        # Registered as just beaten, the loop turns stale within 500 ms
        # (it may have been registered before READY=1); no ping after.
        time.sleep(2.6)
        assert s.between(ready + 0.6, ready + 2.6) == []
    finally:
        assert s.stop() == 0
    assert f"watchdog_withheld loop={loop} " in s.log_path.read_text()


def test_watchdog_meant_for_another_pid_is_not_answered(tmp_path, model):
    s = Notified(tmp_path, "aerie-gateway", service_args("aerie-gateway", tmp_path, model), WATCHDOG_USEC,
                 {"WATCHDOG_PID": "1"})
    try:
        ready = s.wait_for("READY=1", 120)
        time.sleep(1)
        assert s.between(ready, ready + 1) == []
    finally:
        assert s.stop() == 0


# WATCHDOG_USEC out of range (services/core/watchdog.h): 1 us once made the
# ping thread spin with every loop stale at once (no ping at all), 1e16 us
# overflowed the interval in nanoseconds (no ping ever); both are clamped,
# to a ping every 100 ms and every 15 minutes (the first goes at READY).
@pytest.mark.parametrize("usec,interval_us,lo,hi", [(1, 400000, 16, 22), (10**16, 3600000000, 1, 1)])
def test_watchdog_usec_out_of_range_is_clamped_and_pinged(tmp_path, model, usec, interval_us, lo, hi):
    s = Notified(tmp_path, "aerie-gateway", service_args("aerie-gateway", tmp_path, model), usec)
    try:
        ready = s.wait_for("READY=1", 120)
        time.sleep(2.2)
        pings = s.between(ready, ready + 2.0)
        assert lo <= len(pings) <= hi, pings  # 20 at 100 ms; 1 at 15 min
    finally:
        assert s.stop() == 0
    log = s.log_path.read_text()
    assert f"watchdog_interval_clamped watchdog_usec={usec} interval_us={interval_us} " in log
    assert f"watchdog_on interval_ms={interval_us // 1000} ping_every_ms={interval_us // 4000}\n" in log
    assert "watchdog_withheld" not in log


def test_unparsable_watchdog_usec_is_logged_and_means_no_watchdog(tmp_path, model):
    s = Notified(tmp_path, "aerie-gateway", service_args("aerie-gateway", tmp_path, model), "20s")
    try:
        ready = s.wait_for("READY=1", 120)
        time.sleep(1)
        assert s.between(ready, ready + 1) == []
    finally:
        assert s.stop() == 0
    assert 'warn watchdog_usec_ignored value="20s" reason="not a positive whole number of microseconds: no watchdog"\n' \
        in s.log_path.read_text()
