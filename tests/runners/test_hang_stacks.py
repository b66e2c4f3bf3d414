"""A rank still running late in its run prints every thread's stack (runners.hang_stacks)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_rank_still_running_prints_where_it_waits_and_goes_on():
    code = textwrap.dedent("""
        import time
        from runners.hang_stacks import stacks_if_still_running
        def waiting_for_a_message():
            time.sleep(1.0)
        stacks_if_still_running(0.5, rank=3)
        waiting_for_a_message()
        done = stacks_if_still_running(0.5, rank=4)
        done.cancel()
        time.sleep(0.8)
        print("went on")
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "[rank 3] still running 0 s after its start" in p.stderr
    assert "waiting_for_a_message" in p.stderr
    assert "[rank 4]" not in p.stderr  # cancelled: nothing printed
    assert p.stdout.strip() == "went on"
