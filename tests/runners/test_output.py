"""What of a run's output the terminal is spared (issue #54 item 22: a killed or timed-out run printed
torchrun's traceback before the clean verdict): ``runners.output.Withheld`` on the lines such runs print."""
from __future__ import annotations

import io

from runners.output import Withheld

PEER = """Traceback (most recent call last):
  File "/repo/runners/worker.py", line 133, in main
    m = spec.load()(cfg, ctx)
RuntimeError: [/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9629. GLHF!
"""
TORCHRUN = "".join(line + "\n" for line in [
    "E1127 20:41:11.669000 15120 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/"
    "api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 15128)",
    "Traceback (most recent call last):",
    '  File "<frozen runpy>", line 198, in _run_module_as_main',
    "    raise ChildFailedError(",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",  # torchrun's own line ends in a space
    "=" * 60, "runners.worker FAILED", "-" * 60, "Failures:", "  <NO_OTHER_FAILURES>", "=" * 60])
OWN = """Traceback (most recent call last):
  File "/repo/ours/train.py", line 10, in train
    raise ValueError("a bug of the system's")
ValueError: a bug of the system's
"""
STACKS = """[rank 0] still running 252 s after its start (0.7 of --timeout 360 s): every thread's stack follows
Thread 0x00007f (most recent call first):
  File "/repo/contract/rank.py", line 164 in wait

Current thread 0x00007e (most recent call first):
  File "/repo/runners/worker.py", line 20 in main
"""


def _through(*streams: str, mute_after: int | None = None) -> tuple[str, str]:
    terminal = io.StringIO()
    withheld = Withheld(terminal)
    for i, text in enumerate(streams):
        sink = withheld.sink()
        if mute_after is not None and i == mute_after:
            withheld.mute()
        for line in text.splitlines(keepends=True):
            sink.write(line)
    return terminal.getvalue(), withheld.text()


def test_peers_tracebacks_and_torchruns_report_go_to_the_record_not_the_terminal():
    step = "[ours] step 3/5 0.080 s\n"
    shown, kept = _through(step + PEER + TORCHRUN + "[ours] step 4/5 0.070 s\n")
    assert shown == step + "[ours] step 4/5 0.070 s\n"
    assert kept == PEER + TORCHRUN


def test_a_ranks_own_error_still_shows_and_a_hangs_stacks_are_kept():
    shown, kept = _through(OWN, STACKS)
    assert shown == OWN + STACKS.splitlines(keepends=True)[0]  # the line announcing the stacks stays
    assert kept == "".join(STACKS.splitlines(keepends=True)[1:])


def test_once_muted_everything_is_kept():
    """A timed-out or interrupted run: what its ranks print while they are stopped is the record's."""
    shown, kept = _through("[ours] step 1/5 0.1 s\n", OWN + "anything\n", mute_after=1)
    assert shown == "[ours] step 1/5 0.1 s\n" and kept == OWN + "anything\n"
