"""The node side of shaping over ssh: applies one node's shaping and holds it while its stdin is open.

Started on each node by ``ssh_shaping.SshShapingSession`` (from the suite's directory there):

    ssh node01 -- env -C REMOTE_DIR PYTHON -m network_emulation.shaping_agent

Protocol (one JSON object per line):
1. reads the plan on stdin: ``{"iface", "backend": "auto"|"netem"|"tbf+delayer"|"none",
   "netem": [tc argv...], "tbf": [tc argv...], "delays": [[queue, delay_ms, source or null, jitter_ms, loss_pct]...]}``;
2. takes the node's shaping lock for the interface (a second live session on it is refused), and
   clears what a killed earlier session left there: its tagged iptables rules and its root qdisc;
3. picks the backend: netem when ``tc qdisc ... netem`` works on this node, otherwise tbf (rate) on
   the interface plus the NFQUEUE delayer (delayer.py) holding every packet that arrives on the
   interface (raw PREROUTING) for the delay; the sshd port is left out of the delay, so that a
   node whose delayer died stays reachable over ssh (the queue rules have no --queue-bypass:
   without a delayer they drop, rather than let packets through undelayed);
4. answers ``{"ok": true, "backend", "address", "hostname", "boot_id", "pid", "leftovers"}`` (or
   ``{"ok": false, "error"}``, after clearing);
5. holds until stdin reaches EOF: the session ended, or its ssh connection closed, whatever way the
   launcher died; SIGTERM/SIGINT/SIGHUP likewise. Then it removes its rules, stops the delayer
   (whose stdin is a pipe from this agent: it exits with the agent, even after SIGKILL), deletes the
   root qdisc and answers ``{"cleared": bool, "errors": [...]}``.
Every command is an argument list; only ``tc`` commands are taken from the plan.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from .delayer import queue_arg
from .probe import boot_id
from .signals import Terminated, end_by_stdin, signals_deferred, signals_raise

TAG = "pipebench-shaping"  # iptables comment on every rule of ours
DELAYER = Path(__file__).with_name("delayer.py")
OUR_QDISCS = ("netem", "tbf", "htb")
BACKENDS = ("auto", "netem", "tbf+delayer", "none")
LOCK_DIR = Path("/run/lock") if Path("/run/lock").is_dir() else Path("/tmp")
_NOTHING_TO_CLEAR = ("Cannot delete qdisc with handle of zero", "No such file or directory", "Invalid handle")


class PlanError(ValueError):
    pass


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if check and p.returncode != 0:
        err = (p.stderr or p.stdout).strip().splitlines()
        raise RuntimeError(f"{shlex.join(argv)} failed: {err[0] if err else p.returncode}")
    return p


def read_line(fd: int) -> str:
    """One line from ``fd`` without reading past it (the rest of stdin is the lifeline)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        data += chunk
    return data.decode()


def reply(obj: dict[str, Any]) -> None:
    try:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, OSError):
        pass  # the session is gone; clearing goes on regardless


def check_plan(plan: Any) -> dict[str, Any]:
    if not isinstance(plan, dict) or not isinstance(plan.get("iface"), str) or not plan["iface"]:
        raise PlanError("the plan needs an interface")
    if plan.get("backend", "auto") not in BACKENDS:
        raise PlanError(f"backend must be one of {BACKENDS}")
    for key in ("netem", "tbf"):
        for argv in plan.get(key, []):
            if not (isinstance(argv, list) and argv and argv[0] == "tc" and all(isinstance(a, str) for a in argv)):
                raise PlanError(f"only tc commands may be in the plan, got {argv!r}")
    for d in plan.get("delays", []):
        if not (isinstance(d, list) and len(d) in (3, 5) and isinstance(d[0], int) and 0 <= d[0] < 65536
                and all(isinstance(v, (int, float)) and v >= 0 for v in (d[1], *d[3:]))
                and (d[2] is None or isinstance(d[2], str))):
            raise PlanError(f"bad delay entry {d!r}")
    return plan


class Agent:
    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan
        self.iface: str = plan["iface"]
        self.backend = "none"
        self.delayer: subprocess.Popen[bytes] | None = None
        self.shaped = False
        self._lock: int | None = None

    # ------------------------------------------------------------------ start
    def start(self) -> dict[str, Any]:
        self._take_lock()
        leftovers = self.clear_leftovers()
        self.backend = self._choose_backend()
        if self.backend == "netem":
            self._tc(self.plan.get("netem", []))
        elif self.backend == "tbf+delayer":
            self._tc(self.plan.get("tbf", []))
            if self.plan.get("delays"):
                self._start_delayer()
                self._insert_rules()
        return {"backend": self.backend, "address": self._address(), "hostname": socket.gethostname(),
                "boot_id": boot_id(), "pid": os.getpid(), "leftovers": leftovers}

    def _lock_path(self) -> Path:
        """One lock per network namespace and interface (virtual nodes share /run/lock)."""
        return LOCK_DIR / f"pipebench-shaping-net{os.stat('/proc/self/ns/net').st_ino}-{self.iface}.lock"

    def _take_lock(self) -> None:
        fd = os.open(self._lock_path(), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"another shaping session is active on {socket.gethostname()} {self.iface}") from None
        self._lock = fd

    def release_lock(self) -> None:
        if self._lock is not None:
            self._lock_path().unlink(missing_ok=True)
            os.close(self._lock)
            self._lock = None

    def _choose_backend(self) -> str:
        if not self.plan.get("netem") and not self.plan.get("tbf"):
            return "none"
        if self.plan.get("backend", "auto") != "auto":
            return str(self.plan["backend"])
        probe = _run(["tc", "qdisc", "replace", "dev", self.iface, "root", "netem", "delay", "1ms"], check=False)
        if probe.returncode == 0:
            self.shaped = True
            return "netem"
        return "tbf+delayer"

    def _tc(self, commands: list[list[str]]) -> None:
        for argv in commands:
            self.shaped = True
            _run(argv)

    def _start_delayer(self) -> None:
        argv = [sys.executable, "-I", str(DELAYER), "--owner", str(os.getpid())]
        for queue, delay_ms, _, *rest in self.plan["delays"]:
            argv += ["--queue", queue_arg(queue, delay_ms, *rest)]
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.delayer = p
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], 15)
        if not (ready and p.stdout.readline().strip() == b"ready"):
            raise RuntimeError(f"the packet delayer did not start (exit {p.poll()})")

    def _ssh_port(self) -> str | None:
        """The sshd port this agent was reached on: SSH_CONNECTION (client, client port, server, server
        port) of its own environment or, under sudo (which drops it), of the nearest ancestor's."""
        env, pid = os.environ.get("SSH_CONNECTION", ""), os.getpid()
        for _ in range(8):
            if env or pid <= 1:
                break
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                break
            env = next((e[15:].decode() for e in environ if e.startswith(b"SSH_CONNECTION=")), "")
        words = env.split()
        return words[3] if len(words) == 4 and words[3].isdigit() else None

    def rules(self) -> list[list[str]]:
        """Our raw PREROUTING rules: the sshd port exempt, then one NFQUEUE rule per delay."""
        tag = ["-m", "comment", "--comment", TAG]
        out = []
        port = self._ssh_port()
        if port:
            out += [["-i", self.iface, "-p", "tcp", "--dport", port, *tag, "-j", "ACCEPT"],
                    ["-i", self.iface, "-p", "tcp", "--sport", port, *tag, "-j", "ACCEPT"]]
        for queue, _, source, *_ in self.plan["delays"]:
            out.append(["-i", self.iface, *(["-s", source] if source else []), *tag, "-j", "NFQUEUE",
                        "--queue-num", str(queue)])
        return out

    def _insert_rules(self) -> None:
        if shutil.which("iptables") is None:
            raise FileNotFoundError("iptables missing on this node: apt-get install -y iptables")
        for spec in self.rules():
            _run(["iptables", "-w", "-t", "raw", "-A", "PREROUTING", *spec])

    def _address(self) -> str | None:
        out = _run(["ip", "-o", "-4", "addr", "show", "dev", self.iface], check=False).stdout.split()
        return out[out.index("inet") + 1].split("/")[0] if "inet" in out else None

    # ------------------------------------------------------------------ clear
    def remove_rules(self) -> list[str]:
        """Delete every rule tagged ours from raw PREROUTING; returns them."""
        if shutil.which("iptables") is None:
            return []
        listing = _run(["iptables", "-w", "-t", "raw", "-S", "PREROUTING"], check=False).stdout
        removed = []
        for line in listing.splitlines():
            words = shlex.split(line)
            if words[:2] == ["-A", "PREROUTING"] and TAG in words:
                _run(["iptables", "-w", "-t", "raw", "-D", "PREROUTING", *words[2:]])
                removed.append(line)
        return removed

    def remove_qdisc(self, only_ours: bool) -> str | None:
        """Delete the interface's root qdisc (only if it is a kind this agent sets, when ``only_ours``)."""
        shown = _run(["tc", "qdisc", "show", "dev", self.iface, "root"], check=False).stdout.split()
        kind = shown[1] if len(shown) > 1 and shown[0] == "qdisc" else None
        if only_ours and kind not in OUR_QDISCS:
            return None
        p = _run(["tc", "qdisc", "del", "dev", self.iface, "root"], check=False)
        if p.returncode != 0 and not any(s in p.stderr for s in _NOTHING_TO_CLEAR):
            raise RuntimeError(f"tc qdisc del dev {self.iface} root failed: {p.stderr.strip()}")
        return kind

    def clear_leftovers(self) -> list[str]:
        """What an earlier session that was killed left on this interface, removed."""
        left = [f"iptables rule: {r}" for r in self.remove_rules()]
        kind = self.remove_qdisc(only_ours=True)
        return left + ([f"root qdisc {kind} on {self.iface}"] if kind else [])

    def stop_delayer(self) -> None:
        p, self.delayer = self.delayer, None
        if p is not None:
            end_by_stdin(p, 3.0)

    def clear(self) -> list[str]:
        """Rules first (so no packet is queued to a delayer that is stopping), then the delayer, then
        the qdisc. Returns the errors; every step is tried. Without the lock (another session holds
        the interface) there is nothing of ours to clear."""
        if self._lock is None:
            return []
        errors = []
        for step in (self.remove_rules, self.stop_delayer, lambda: self.remove_qdisc(only_ours=not self.shaped)):
            try:
                step()
            except Exception as e:  # keep clearing
                errors.append(str(e))
        return errors


def main() -> int:
    """First answer: the start's result; last answer: the clearing's. Both always come."""
    with signals_raise():
        try:
            plan = check_plan(json.loads(read_line(0) or "null"))
        except ValueError as e:
            reply({"ok": False, "error": f"bad plan: {e}"})
            reply({"cleared": True, "errors": []})
            return 2
        agent = Agent(plan)
        answered = False
        try:
            info = agent.start()
            reply({"ok": True, **info})
            answered = True
            while os.read(0, 4096):  # until EOF: the session's end, or its connection's
                pass
        except (Terminated, KeyboardInterrupt) as e:
            if not answered:
                reply({"ok": False, "error": f"interrupted ({type(e).__name__})"})
        except Exception as e:
            if answered:
                print(f"shaping_agent: {type(e).__name__}: {e}", file=sys.stderr)
            else:
                reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
        finally:
            with signals_deferred():
                errors = agent.clear()
                agent.release_lock()
            reply({"cleared": not errors, "errors": errors})
    return 0


if __name__ == "__main__":
    sys.exit(main())
