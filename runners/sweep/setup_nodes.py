"""Setting up a cluster's nodes: the suite copied to each node's remote directory and its
environment built there with scripts/setup_env.sh, all nodes in parallel.

    python -m runners.sweep.setup_nodes --hostfile HOSTS [--ssh-config FILE] [--ssh-user USER]
                                        [--remote-dir DIR] [--share-venv VENV]

What is copied: this checkout's files as they are now (tracked and untracked, without what git
ignores and without results/), through ``tar`` over ssh into REMOTE_DIR (``{host}`` in it: the
host's name). A node records what it holds in REMOTE_DIR/.pipebench-setup (the commit and a hash of
the copied files); a node that already holds the same is left alone. The environment is built by
the copied scripts/setup_env.sh on the node (a .venv with the pinned packages: minutes per node).
``--share-venv VENV`` is for nodes that share this machine's file system (virtual nodes): each
node's REMOTE_DIR/.venv becomes a link to VENV, which must already be set up for this
pyproject.toml (setup_env.sh then finds it complete and installs nothing).

One progress line per node; a node that fails is named with its last line of output. Exit status:
0 all set up, 1 a node failed, 2 a bad request, 130 interrupted (the copies in flight are stopped).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import posixpath
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from network_emulation.netem import ssh_argv, ssh_base
from network_emulation.signals import cli_status, signals_deferred, signals_raise
from network_emulation.ssh_shaping import for_host
from runners.sweep.hostfile import parse_hostfile
from runners.sweep.plan import REPO, SweepError

STAMP = ".pipebench-setup"
EXCLUDED = ("results/",)  # outputs, not the suite
STEP_TIMEOUT_S = 1800.0  # one node's environment build (pip from scratch takes minutes)
# The remote scripts are constant; every value arrives as a positional argument.
EXTRACT = 'mkdir -p -- "$1" && exec tar -x -f - -C "$1"'
BUILD = ('cd -- "$1" && if [ -n "$2" ] && { [ ! -e .venv ] || [ -L .venv ]; }; then ln -sfn -- "$2" .venv; fi '
         '&& bash scripts/setup_env.sh && printf "%s\\n" "$3" > "$4"')


class SetupError(RuntimeError):
    """A node that could not be set up; the message names it."""


@dataclass(frozen=True)
class Suite:
    """What is copied: the files (relative paths), the commit and the stamp naming the contents."""

    root: Path
    files: tuple[str, ...]
    commit: str
    stamp: str
    size: int


def suite_files(root: Path = REPO) -> Suite:
    """This checkout's files as they are (tracked and untracked, not ignored, not results/), with a
    stamp: the commit, and a hash of every copied path and its contents."""
    def git(*args: str) -> bytes:
        p = subprocess.run(["git", "-C", str(root), *args], capture_output=True)
        if p.returncode != 0:
            raise SweepError(f"setting up nodes copies a git checkout; {root}: "
                             f"{p.stderr.decode(errors='replace').strip().splitlines()[-1:]}")
        return p.stdout

    names = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").decode().split("\0")
    files = sorted({n for n in names if n and not n.startswith(EXCLUDED) and (root / n).is_file()})
    commit = git("rev-parse", "--short=12", "HEAD").decode().strip()
    digest, size = hashlib.sha1(), 0
    for name in files:
        data = (root / name).read_bytes()
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
        size += len(data)
    return Suite(root, tuple(files), commit, f"{commit}-{digest.hexdigest()[:12]}", size)


def venv_ready(venv: Path, root: Path = REPO) -> bool:
    """``venv`` was set up by scripts/setup_env.sh for this pyproject.toml (its stamp file)."""
    digest = hashlib.sha1((root / "pyproject.toml").read_bytes()).hexdigest()[:12]
    return (venv / f".installed-{digest}").exists() and (venv / "bin" / "python").exists()


@dataclass
class NodeSetup:
    """Sets up the nodes; ``run()`` returns one line per node. Child processes are tracked so that
    an interruption stops them."""

    hosts: Sequence[str]
    suite: Suite
    remote_dir: str = str(REPO)
    ssh_config: str | None = None
    ssh_user: str | None = None
    share_venv: str | None = None
    out: IO = sys.stdout
    _procs: set[subprocess.Popen] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: threading.Event = field(default_factory=threading.Event)

    def ssh(self, host: str, argv: list[str]) -> list[str]:
        return ssh_argv(f"{self.ssh_user}@{host}" if self.ssh_user else host, argv, ssh_base(self.ssh_config))

    def run(self) -> dict[str, str | None]:
        """Set up every node in parallel: host -> None (set up) or the error. Prints a line per node."""
        results: dict[str, str | None] = {}
        threads = [threading.Thread(target=self._one, args=(h, results), daemon=True) for h in self.hosts]
        try:
            # started inside the try: an interruption between two starts still stops what the
            # started ones launched (their ssh clients would otherwise outlive this process)
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                time.sleep(0.1)
        except BaseException:
            with signals_deferred():
                self._stopping.set()
                # kill until every thread has ended: a step a thread started as the interruption came
                # (past its check of _stopping, not yet in _procs) is killed on a later round
                end = time.monotonic() + 10
                while any(t.is_alive() for t in threads) and time.monotonic() < end:
                    with self._lock:
                        procs = list(self._procs)
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
                    time.sleep(0.02)
                for t in threads:
                    if t.ident is not None:  # started
                        t.join(timeout=1)
            raise
        return results

    def _say(self, line: str) -> None:
        with self._lock:
            print(line, file=self.out, flush=True)

    def _one(self, host: str, results: dict[str, str | None]) -> None:
        t0 = time.monotonic()
        try:
            line = self._setup(host)
            results[host] = None
            self._say(f"{host}: {line} ({time.monotonic() - t0:.1f} s)")
        except SetupError as e:
            results[host] = str(e)
            if not self._stopping.is_set():
                self._say(f"{host}: FAILED: {e}")

    def _setup(self, host: str) -> str:
        d = for_host(self.remote_dir, host)
        stamp_path = posixpath.join(d, STAMP)
        held = self._call(host, "check", self.ssh(host, ["sh", "-c", 'cat -- "$1" 2>/dev/null || true', "sh",
                                                         stamp_path]))
        if held.strip() == self.suite.stamp:
            return f"already holds {self.suite.commit} (same files): nothing to do"
        with tempfile.NamedTemporaryFile("wb", prefix="setup-files-") as listing:
            listing.write(b"\0".join(f.encode() for f in self.suite.files) + b"\0")
            listing.flush()
            self._copy(host, d, listing.name)
        self._call(host, "environment",
                   self.ssh(host, ["sh", "-c", BUILD, "sh", d, self.share_venv or "", self.suite.stamp, stamp_path]))
        venv = f"linked to {self.share_venv}" if self.share_venv else "built by scripts/setup_env.sh"
        return (f"copied {len(self.suite.files)} files ({self.suite.size / 1e6:.1f} MB) of {self.suite.commit} "
                f"to {d}; environment ready (.venv {venv})")

    def _copy(self, host: str, directory: str, listing: str) -> None:
        tar = self._start(["tar", "-c", "-f", "-", "-C", str(self.suite.root), "--null", "-T", listing],
                          stdout=subprocess.PIPE)
        try:
            self._call(host, "copy", self.ssh(host, ["sh", "-c", EXTRACT, "sh", directory]), stdin=tar.stdout)
        finally:
            if tar.stdout:
                tar.stdout.close()
            tar.wait()
            self._forget(tar)
        if tar.returncode != 0:
            raise SetupError(f"copy: tar exited with status {tar.returncode}")

    def _start(self, argv: list[str], **kw) -> subprocess.Popen:
        if self._stopping.is_set():
            raise SetupError("interrupted")
        p = subprocess.Popen(argv, **kw)
        with self._lock:
            self._procs.add(p)
        return p

    def _forget(self, p: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(p)

    def _call(self, host: str, step: str, argv: list[str], stdin: IO | int | None = subprocess.DEVNULL) -> str:
        """Run one step's command; its stdout, or SetupError naming the step and the last line."""
        p = self._start(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            output, _ = p.communicate(timeout=STEP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            output, _ = p.communicate()
            raise SetupError(f"{step}: no end after {STEP_TIMEOUT_S:g} s") from None
        finally:
            self._forget(p)
        text = output.decode(errors="replace")
        if p.returncode != 0:
            last = [l for l in text.splitlines() if l.strip()][-1:]
            how = "the node did not answer ssh" if p.returncode == 255 else f"exit status {p.returncode}"
            raise SetupError(f"{step}: {how}" + (f": {last[0].strip()}" if last else ""))
        return text


def setup_nodes(hosts: Sequence[str], *, remote_dir: str = str(REPO), ssh_config: str | None = None,
                ssh_user: str | None = None, share_venv: str | None = None, out: IO = sys.stdout) -> None:
    """Set up every node (see the module's docstring); raises SetupError naming the nodes that failed,
    SweepError for a bad request."""
    if share_venv is not None:
        venv = Path(share_venv)
        if not venv_ready(venv):
            raise SweepError(f"--share-venv {share_venv}: not a venv set up by scripts/setup_env.sh for this "
                             "pyproject.toml (run scripts/setup_env.sh here first)")
        share_venv = os.path.realpath(venv)
    suite = suite_files()
    print(f"setup: {len(hosts)} node(s), {suite.commit} ({len(suite.files)} files) into {remote_dir}", file=out,
          flush=True)
    results = NodeSetup(hosts, suite, remote_dir, ssh_config, ssh_user, share_venv, out).run()
    failed = {h: e for h, e in results.items() if e}
    if failed:
        raise SetupError("; ".join(f"{h}: {e}" for h, e in failed.items()))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m runners.sweep.setup_nodes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hostfile", required=True, help="the cluster's hostfile (see runners.sweep.hostfile)")
    ap.add_argument("--ssh-config", default=None, help="ssh -F FILE")
    ap.add_argument("--ssh-user", default=None)
    ap.add_argument("--remote-dir", default=str(REPO),
                    help="the suite's directory on the nodes ('{host}': the host's name)")
    ap.add_argument("--share-venv", default=None, metavar="VENV",
                    help="nodes that share this file system: link each node's .venv to VENV instead of building one")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)

    def setup() -> None:
        hosts = [h.name for h in parse_hostfile(args.hostfile)]
        if args.ssh_config and not Path(args.ssh_config).is_file():
            raise SweepError(f"--ssh-config {args.ssh_config}: no such file")
        with signals_raise():
            setup_nodes(hosts, remote_dir=args.remote_dir, ssh_config=args.ssh_config, ssh_user=args.ssh_user,
                        share_venv=args.share_venv)

    return cli_status(ap.prog, setup, (SweepError,), failed=(SetupError,), said=("error: ", "failed on "),
                      interrupted="setup")


if __name__ == "__main__":
    sys.exit(main())
