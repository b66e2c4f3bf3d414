"""Node set-up without nodes: what is copied and its stamp, a node that does not answer, bad requests.
(The set-up over real ssh, and a second one that copies nothing, are in tests/network/test_rehearsal.py.)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runners.sweep.setup_nodes import suite_files

REPO = Path(__file__).resolve().parents[2]


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_copied_files_and_stamp(tmp_path: Path) -> None:
    root = tmp_path / "suite"
    (root / "pkg").mkdir(parents=True)
    (root / "results").mkdir()
    (root / "pkg" / "a.py").write_text("A = 1\n")
    (root / "results" / "r.jsonl").write_text("{}\n")
    (root / ".gitignore").write_text("*.log\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    (root / "pkg" / "new.py").write_text("B = 2\n")             # untracked: copied
    (root / "x.log").write_text("log\n")                        # ignored: not copied
    first = suite_files(root)
    assert first.files == (".gitignore", "pkg/a.py", "pkg/new.py")  # results/ is output, not the suite
    assert first.stamp.startswith(first.commit + "-") and len(first.commit) == 12
    assert suite_files(root).stamp == first.stamp
    (root / "results" / "r.jsonl").write_text("{}\n{}\n")      # outputs do not change what a node holds
    assert suite_files(root).stamp == first.stamp
    (root / "pkg" / "a.py").write_text("A = 3\n")               # an edit does
    assert suite_files(root).stamp != first.stamp


def test_a_node_that_does_not_answer_is_named(tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text("Host *\n  HostName 127.0.0.1\n  Port 1\n  BatchMode yes\n  ConnectTimeout 5\n")
    hosts = tmp_path / "hosts"
    hosts.write_text("down01 slots=1\n")
    p = subprocess.run([sys.executable, "-m", "runners.sweep.setup_nodes", "--hostfile", str(hosts), "--ssh-config",
                        str(config), "--remote-dir", str(tmp_path / "{host}" / "suite")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "down01: FAILED: check: the node did not answer ssh" in p.stdout
    assert p.stderr.count("\n") == 1 and "failed on down01: check: the node did not answer ssh" in p.stderr


@pytest.mark.parametrize("args, message", [
    (["--share-venv", "/nonexistent"], "--share-venv /nonexistent: not a venv set up by scripts/setup_env.sh"),
    (["--ssh-config", "/nonexistent"], "--ssh-config /nonexistent: no such file"),
])
def test_bad_requests_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("n1\n")
    p = subprocess.run([sys.executable, "-m", "runners.sweep.setup_nodes", "--hostfile", str(hosts), *args],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and message in p.stderr, p.stderr


@pytest.mark.parametrize("args, message", [
    (["--rehearse", "2", "--iface", "eth1"], "--iface is set by --rehearse itself"),
    (["--rehearse", "2", "--share-venv", "v"], "--share-venv is set by --rehearse itself"),
    (["--rehearse", "2", "--hostfile", "h"], "--rehearse makes its own nodes; leave out --hostfile"),
    (["--rehearse", "2", "--setup-nodes"], "--rehearse sets up its nodes itself; leave out --setup-nodes"),
    (["--setup-nodes"], "--setup-nodes needs --hostfile"),
    (["--ssh-config", "c"], "--ssh-config needs --hostfile"),
    (["--hostfile", "h", "--share-venv", "v"], "--share-venv goes with --setup-nodes"),
])
def test_run_all_sh_refuses_mixed_modes(args: list[str], message: str) -> None:
    p = subprocess.run(["bash", "runners/run_all.sh", *args], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert p.returncode == 2 and p.stderr == f"run_all.sh: {message}\n", p.stderr


def test_setup_nodes_dry_run_copies_nothing(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("n0 slots=2\nn1 slots=2\n")
    p = subprocess.run(["bash", "runners/run_all.sh", "--hostfile", str(hosts), "--setup-nodes", "--remote-dir",
                        "/srv/{host}/suite", "--sweep", "rehearsal-4.toml", "--dry-run", "--out",
                        str(tmp_path / "o.jsonl")], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert p.returncode == 0, p.stderr
    assert "# would set up the nodes first:" in p.stdout and "--remote-dir /srv/{host}/suite" in p.stdout
    runs = [l for l in p.stdout.splitlines() if "runners.run" in l]
    assert len(runs) == 6                                          # 3 runs x 2 nodes of 2 ranks
    for host in ("n0", "n1"):                                       # each node runs from its own directory
        mine = [r for r in runs if f" {host} -- " in r]
        assert len(mine) == 3 and all(f"cd /srv/{host}/suite" in r and f"/srv/{host}/suite/.venv/bin/python" in r
                                      for r in mine), mine
    assert not (tmp_path / "o.jsonl").exists()


def test_an_interruption_while_the_nodes_threads_start_stops_what_they_launched(monkeypatch) -> None:
    """Ctrl-C as the second node's thread starts, the first node's step already running: run() raises
    and that step's process (an ssh client on a real cluster) is killed, not left behind."""
    import io
    import threading
    import time
    import uuid

    from runners.sweep import setup_nodes as sn
    from tests.network._node_checks import live_processes

    marker = f"pipebench-setup-test-{uuid.uuid4().hex}"

    def running() -> list[int]:
        return live_processes(marker)

    class InterruptedStart(threading.Thread):
        started = 0

        def start(self) -> None:
            super().start()
            InterruptedStart.started += 1
            if InterruptedStart.started == 2:
                end = time.monotonic() + 20
                while not running() and time.monotonic() < end:
                    time.sleep(0.02)
                raise KeyboardInterrupt

    class Setup(sn.NodeSetup):
        def ssh(self, host: str, argv: list[str]) -> list[str]:
            return [sys.executable, "-c", "import time; time.sleep(60)", marker]

    monkeypatch.setattr(sn.threading, "Thread", InterruptedStart)
    setup = Setup(["a", "b", "c"], suite_files(REPO), out=io.StringIO())
    with pytest.raises(KeyboardInterrupt):
        setup.run()
    end = time.monotonic() + 5
    while running() and time.monotonic() < end:
        time.sleep(0.05)
    assert running() == []
