"""Faults a run can be given beside its network: a straggler (``--slow-rank R:F``) and a replica that
dies (``--kill-replica R@STEP``, ``--rejoin``). Plain text in the config (what the flags hold, in one
canonical form), read here; no torch.

- A straggler: rank R computes F times slower than it would. On a CPU the run command caps its
  process at 1/F of the share of a core each of the run's ranks has here (a CPU quota: cgroup v2
  ``cpu.max`` or v1 ``cpu.cfs_quota_us``), and weighs it 1/F of a process against others; where no
  quota can be set, and on a GPU, the rank pauses after each step for F - 1 times the time it
  computed in it (``runners.faults``). The record says which.
- A replica that dies: the ranks of data-parallel replica R end after STEP steps (warm-up included),
  killed at once (SIGKILL, as a lost machine: their sockets close, nothing is flushed). At
  ``--dp 1`` (nothing replicated) R names a rank. A synchronous system then fails, and the run ends
  as ``error`` naming the rank; a system that tolerates a replica's death (``SystemSpec.fault_tolerant``:
  diloco's torchft) goes on with the others, and with ``--rejoin`` a standby of the replica (started
  with the run, waiting) takes its place and rejoins the others at their next quorum. The record
  says what happened (``environment.faults``: each replica's lives, the steps each ran, how each
  ended, whether the standby rejoined), and counts only the work of the replicas that ran each step
  (``alive_per_step``; the record's ``replicas_per_step``); ``words`` says it for a report.
"""
from __future__ import annotations

from contract.config import ConfigError


def straggler(config) -> tuple[int, float] | None:
    """(rank, factor) of the run's ``--slow-rank``, or None."""
    if config.slow_rank is None:
        return None
    rank, factor = config.slow_rank.split(":")
    return int(rank), float(factor)


def killed(config) -> tuple[int, int] | None:
    """(replica, step) of the run's ``--kill-replica``, or None."""
    if config.kill_replica is None:
        return None
    replica, step = config.kill_replica.split("@")
    return int(replica), int(step)


def replica_ranks(config, replica: int, world: int) -> list[int]:
    """The ranks of ``replica``: its P x T ranks at --dp > 1 (ranks are laid out replica-major), the
    rank itself at --dp 1."""
    if config.dp == 1:
        return [replica]
    per = world // config.dp
    return list(range(replica * per, (replica + 1) * per))


def check_faults(config, world: int, fault_tolerant: bool) -> None:
    """ConfigError (one line) if the run's faults do not fit it: a rank or replica it does not have, a
    step it never reaches, --rejoin without a system that survives the loss."""
    slow = straggler(config)
    if slow is not None and not 0 <= slow[0] < world:
        raise ConfigError(f"--slow-rank {config.slow_rank}: the run has ranks 0..{world - 1}")
    kill = killed(config)
    if kill is None:
        if config.rejoin:
            raise ConfigError("--rejoin restarts the replica --kill-replica ends: give --kill-replica R@STEP")
        return
    replica, step = kill
    what, count = ("replica", config.dp) if config.dp > 1 else ("rank", world)
    if not 0 <= replica < count:
        raise ConfigError(f"--kill-replica {config.kill_replica}: the run has {what}s 0..{count - 1}")
    if not 1 <= step < config.total_steps:
        raise ConfigError(f"--kill-replica {config.kill_replica}: the step must be within 1..{config.total_steps - 1} "
                          f"(the run takes {config.total_steps} steps, warm-up included)")
    if fault_tolerant:
        if config.dp < 2:
            raise ConfigError(f"--kill-replica: {config.system} goes on with the other replicas, and --dp "
                              f"{config.dp} leaves none (use --dp 2 or more)")
        if config.verify:
            raise ConfigError("--kill-replica with --verify: a run that loses a replica follows no reference "
                              "(leave --verify out)")
    elif config.rejoin:
        raise ConfigError(f"--rejoin: {config.system} is synchronous and stops when a rank dies, so there is no "
                          "run left to rejoin (a fault-tolerant system, such as diloco, rejoins)")


class StepHooks:
    """What the harness does around each step of a rank, beside the timing (``run_steps``): nothing
    here; the rank worker's hooks carry out the run's faults (a straggler's pause, a killed replica)
    and mark the run's time 0 (a network trace's). A system calls only ``start_together`` and
    ``take_place``."""

    def started(self) -> None:
        """The first step begins (every rank has left its opening barrier)."""

    def before_step(self, step: int) -> None:
        """Step ``step`` is about to begin (before its opening barrier)."""

    def start_together(self) -> None:
        """In a replica that is a world of its own (``Context.replica``): wait until every replica's
        ranks have come this far, as one world's ranks start together (a fault-tolerant system calls
        it once its quorum members are up, before its first quorum). Nothing otherwise."""

    def take_place(self) -> None:
        """In a replica's standby (--rejoin: its ``Context.first_step`` > 0): wait until the replica it
        stands in for is gone, then return; at once otherwise. A fault-tolerant system calls it once it
        has made all it can without the others (its model, optimizers, code), before it makes itself
        known to them, so that its rejoining costs what the system's does, not the process's start."""

    def after_step(self, step: int, own_s: float, busy_s: float) -> None:
        """This rank finished step ``step`` (before the closing barrier): ``own_s`` seconds since it
        left the opening barrier, ``busy_s`` of CPU time of its process in them."""


def alive_per_step(faults: dict | None, steps: range) -> list[int]:
    """Of a run that lost a replica (its record's ``environment.faults`` with each replica's lives),
    how many replicas ran each of ``steps`` (step indices, warm-up counted); [] where nothing says
    (no replica's lives: every replica ran every step)."""
    replicas = (faults or {}).get("replicas")
    if not replicas:
        return []
    return [sum(any(life.get("steps") and life["steps"][0] <= s <= life["steps"][1] for life in r["lives"])
                for r in replicas) for s in steps]


def words(config: dict, faults: dict | None = None) -> str:
    """A run's faults in words, from its config and (where the record has them) what happened:
    'rank 1 2x slower', 'replica 2 killed after 6 steps, rejoined at step 8', 'replica 1 killed after 3
    steps, did not rejoin (...)'; '' without."""
    parts = []
    if config.get("slow_rank"):
        rank, factor = config["slow_rank"].split(":")
        parts.append(f"rank {rank} {factor}x slower")
    if config.get("kill_replica"):
        replica, step = config["kill_replica"].split("@")
        said = f"replica {replica} killed after {step} steps"
        if config.get("rejoin"):
            lives = next((r["lives"] for r in (faults or {}).get("replicas") or [] if str(r["replica"]) == replica), [])
            second = lives[1] if len(lives) > 1 else None
            if second is None:
                said += ", its rejoining not recorded" if faults else ", rejoin asked"
            elif second.get("rejoined") and second.get("steps"):
                said += f", rejoined at step {second['steps'][0] + 1} (ran steps {second['steps'][0] + 1}-" \
                        f"{second['steps'][1] + 1})"
            else:
                said += f", did not rejoin ({second.get('ended')})"
        parts.append(said)
    return "; ".join(parts)
