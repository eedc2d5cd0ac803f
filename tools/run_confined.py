#!/usr/bin/python3
"""Runs a command confined as a systemd unit's SystemCallFilter=,
MemoryDenyWriteExecute= and UMask= would confine it, without systemd: the
integration tests serve requests this way (tests/integration/
test_syscall_filter.py), and tests/gpu/run.sh runs the CUDA path so.

    /usr/bin/python3 tools/run_confined.py [--unit FILE] [--filter EXPR]...
        [--mdwe] [--umask 0007] [--refuse eperm|kill] [--list] -- COMMAND ARG...

--unit FILE takes the unit's SystemCallFilter= lines, SystemCallErrorNumber=
(EPERM: --refuse eperm), MemoryDenyWriteExecute=yes (--mdwe) and UMask=;
the other options add to them. --list prints the system calls the filter
allows, one a line, and runs nothing.

The filter is built as systemd builds it: each --filter is one
SystemCallFilter= value, names and @groups, whole value inverted by a
leading "~". When the first is not inverted it is an allow-list, which
starts from @default; an inverted value then takes its calls out again.
The groups come from `systemd-analyze syscall-filter`, nested groups
resolved; names this architecture has no call for are skipped, as systemd
skips them. Only the native ABI is allowed (SystemCallArchitectures=native).

A call outside the filter is not answered by the kernel alone: it goes to
a supervisor process (seccomp's user notification), which writes
"run_confined: refused NAME ..." to the command's stderr and then answers
it with EPERM, as a unit with SystemCallErrorNumber=EPERM would, or kills
the command (SIGKILL), as systemd's default action would. Either way the
refused call is named: a plain SIGSYS kill would say only that one was.

python3-seccomp is Debian's package for Debian's python3: run this with
/usr/bin/python3. --mdwe alone (no filter) needs only the standard library.
"""
import argparse
import ctypes
import errno
import fcntl
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import traceback

PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1

# <linux/seccomp.h>: struct seccomp_notif (id, pid, flags, and seccomp_data:
# nr, arch, instruction pointer, six arguments) and seccomp_notif_resp
# (id, val, error, flags), and their ioctls, _IOWR('!', 0 and 1, ...) in
# the generic encoding (x86-64, arm64, riscv64).
NOTIF = struct.Struct("=QIIiIQ6Q")
NOTIF_RESP = struct.Struct("=QqiI")


def _iowr(nr, size):
    return (3 << 30) | (size << 16) | (ord("!") << 8) | nr


NOTIF_RECV, NOTIF_SEND = _iowr(0, NOTIF.size), _iowr(1, NOTIF_RESP.size)


def say(msg):
    os.write(2, f"run_confined: {msg}\n".encode())


def unit_settings(path):
    """{key: [value, ...]} of the unit's [Service] lines that matter here."""
    kv = {}
    for line in open(path):
        line = line.strip()
        k, sep, v = line.partition("=")
        if sep and k in ("SystemCallFilter", "SystemCallErrorNumber", "MemoryDenyWriteExecute", "UMask"):
            kv.setdefault(k, []).append(v)
    return kv


def syscall_groups():
    """{"@group": [member, ...]} as `systemd-analyze syscall-filter` lists them."""
    out = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager"], capture_output=True, text=True,
                         check=True).stdout
    groups, cur = {}, None
    for line in out.splitlines():
        item = line.strip()
        if not item or item.startswith("#"):
            continue
        if not line[0].isspace():
            cur = groups.setdefault(item, []) if item.startswith("@") else None
        elif cur is not None:
            cur.append(item)
    return groups


def expand(item, groups, seen=None):
    """The call names of a name or @group, nested groups resolved."""
    if not item.startswith("@"):
        return {item}
    if item not in groups:
        sys.exit(f"run_confined: no system call group {item} in `systemd-analyze syscall-filter`")
    seen = seen if seen is not None else set()
    names = set()
    if item not in seen:
        seen.add(item)
        for m in groups[item]:
            names |= expand(m, groups, seen)
    return names


def build_filter(values):
    """(allow-list?, {nr: name}) from SystemCallFilter= values."""
    import seccomp
    groups = syscall_groups()
    allow = not values[0].startswith("~")
    chosen = expand("@default", groups) if allow else set()
    for v in values:
        inverted = v.startswith("~")
        items = v[1:].split() if inverted else v.split()
        for item in items:
            if ":" in item:
                sys.exit(f"run_confined: {item}: per-call error numbers are not supported")
        names = set().union(*(expand(i, groups) for i in items)) if items else set()
        # Not inverted adds to an allow-list and takes out of a deny-list.
        chosen = (chosen | names) if inverted != allow else (chosen - names)
    calls = {}
    for name in chosen:
        nr = seccomp.resolve_syscall(seccomp.Arch.NATIVE, name)
        if nr >= 0:  # -1: unknown to libseccomp; below: not a call on this architecture
            calls[nr] = name
    return allow, calls


def supervise(sock, refuse):
    """In a process of its own, outside the filter: answers the refused
    calls until the filtered process and all its children are gone."""
    import seccomp
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    sock.close()
    if not fds:
        return  # the launcher failed before loading the filter
    fd = fds[0]
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    while True:
        for _, ev in poll.poll():
            if not ev & select.POLLIN:
                return  # POLLHUP: no process is left under the filter
            buf = bytearray(NOTIF.size)
            try:
                fcntl.ioctl(fd, NOTIF_RECV, buf, True)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EINTR):
                    continue  # the caller died meanwhile
                raise
            nid, pid, _flags, nr, _arch, _ip, *_args = NOTIF.unpack(buf)
            try:
                name = seccomp.resolve_syscall(seccomp.Arch.NATIVE, nr).decode()
            except (ValueError, TypeError):
                name = "?"
            say(f"refused {name} (nr {nr}) to pid {pid}; " + ("killed it" if refuse == "kill" else "answered EPERM"))
            if refuse == "kill":
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                fcntl.ioctl(fd, NOTIF_SEND, NOTIF_RESP.pack(nid, 0, -errno.EPERM, 0))
            except OSError:
                pass  # killed, or gone


def start_supervisor(refuse):
    """Forks the supervisor before the filter is loaded (a child would
    inherit it), twice so that it is no child of the command; returns the
    socket that takes it the filter's notification descriptor."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        ours.close()
        try:
            if os.fork() == 0:
                supervise(theirs, refuse)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(0)
    theirs.close()
    os.waitpid(pid, 0)
    return ours


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--unit")
    ap.add_argument("--filter", action="append", default=[])
    ap.add_argument("--mdwe", action="store_true")
    ap.add_argument("--umask")
    ap.add_argument("--refuse", choices=["eperm", "kill"])
    ap.add_argument("--list", action="store_true")
    ap.add_argument("command", nargs="*")
    a = ap.parse_args()
    values, refuse, mdwe, umask = [], "kill", a.mdwe, a.umask
    if a.unit:
        kv = unit_settings(a.unit)
        values = [v for v in kv.get("SystemCallFilter", []) if v]
        if kv.get("SystemCallErrorNumber", [""])[-1] == "EPERM":
            refuse = "eperm"
        elif kv.get("SystemCallErrorNumber", [""])[-1]:
            sys.exit(f"run_confined: SystemCallErrorNumber={kv['SystemCallErrorNumber'][-1]} is not supported")
        mdwe = mdwe or kv.get("MemoryDenyWriteExecute", ["no"])[-1] == "yes"
        umask = umask or kv.get("UMask", [None])[-1]
    values += a.filter
    refuse = a.refuse or refuse
    if not a.command and not a.list:
        ap.error("no command")

    filt = None
    if values:
        import seccomp
        allow, calls = build_filter(values)
        if a.list:
            print("\n".join(sorted(calls.values())))
            return
        # Between loading the filter and exec, this process closes,
        # sends the descriptor and execs: refused, they would wait forever
        # on a supervisor that has no descriptor yet.
        for need in ("close", "sendmsg", "execve"):
            nr = seccomp.resolve_syscall(seccomp.Arch.NATIVE, need)
            if (nr in calls) != allow:
                sys.exit(f"run_confined: the filter must let {need} through")
        filt = seccomp.SyscallFilter(defaction=seccomp.ALLOW if not allow else seccomp.NOTIFY)
        for nr in calls:
            filt.add_rule(seccomp.NOTIFY if not allow else seccomp.ALLOW, nr)
        sock = start_supervisor(refuse)
    elif a.list:
        sys.exit("run_confined: --list needs a filter")

    what = []
    if filt:
        how = f"refused with {'EPERM' if refuse == 'eperm' else 'SIGKILL'} and named here"
        what.append(f"{len(calls)} system calls allowed ({' '.join(values)}), others {how}" if allow else
                    f"{len(calls)} system calls ({' '.join(values)}) {how}")
    if umask:
        os.umask(int(umask, 8))
        what.append(f"umask {umask}")
    if mdwe:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
            sys.exit(f"run_confined: prctl(PR_SET_MDWE): {os.strerror(ctypes.get_errno())} (Linux 6.3 or later)")
        what.append("memory-deny-write-execute (PR_SET_MDWE)")
    say(f"{os.path.basename(a.command[0])}: " + ("; ".join(what) or "nothing confined"))
    if filt:
        filt.load()
        socket.send_fds(sock, [b"f"], [filt.get_notify_fd()])
        os.close(filt.get_notify_fd())
        sock.close()
    os.execvp(a.command[0], a.command)


if __name__ == "__main__":
    main()
