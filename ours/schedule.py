"""The order in which one stage of ours' token pipeline runs its units (``--schedule``).

A unit is (batch slice b, token slice i); a batch slice's units run forward in token order and
backward in reverse token order (a slice's keys and values get their gradient from the later
slices' backward). Between batch slices the order is free:

- ``gpipe``: every unit's forward, then every backward (batch slices in reverse). A stage holds the
  activations of the whole batch until its backward, and the first stage idles at the turn while
  the last stage runs the last unit's forward and backward (nothing of this step's weight
  gradients exists yet to fill that wait).
- ``1f1b``: 1F1B over batch slices. Stage s of P first runs the forwards of P - s - 1 batch slices,
  then alternates one batch slice's forwards with the oldest pending batch slice's backwards, and
  ends with the remaining backwards. The last stage starts a batch slice's backward as soon as
  its last token slice is through, so the first stage gets gradients while it still has forwards
  to run; a stage holds at most P - s batch slices' activations. With one batch slice both orders
  are the same.

Across steps (``--prefetch``, ``ahead``): every stage but the last runs the next step's first
forwards at the end of a step, once its optimizer has stepped: stage s the first N - s of them (N:
the first stage's count; ``auto``: P - 1, the skew of a full pipeline, so that stage s + 1 finds its
first input waiting when the step begins), never beyond the forwards it runs before its first
backward (``leading_forwards``). A stage then never waits for a unit its predecessor runs only in the
next step (the counts fall by at least one a stage), and what it holds ahead is part of what its
order holds at its peak anyway.
"""
from __future__ import annotations

SCHEDULES = ("1f1b", "gpipe")

Action = tuple[str, int, int]  # ("F" | "B", batch slice, token slice)


def unit_order(schedule: str, n_rows: int, n_slices: int, stage: int, n_stages: int) -> list[Action]:
    """Stage ``stage`` of ``n_stages``: its forward and backward of every unit, in the order it runs them."""
    def forward(b: int) -> list[Action]:
        return [("F", b, i) for i in range(n_slices)]

    def backward(b: int) -> list[Action]:
        return [("B", b, i) for i in reversed(range(n_slices))]

    if schedule == "gpipe":
        return ([a for b in range(n_rows) for a in forward(b)]
                + [a for b in reversed(range(n_rows)) for a in backward(b)])
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r} (one of {', '.join(SCHEDULES)})")
    warm = min(n_rows, n_stages - stage - 1)
    order = [a for b in range(warm) for a in forward(b)]
    for b in range(n_rows - warm):
        order += forward(b + warm) + backward(b)
    for b in range(n_rows - warm, n_rows):
        order += backward(b)
    return order


def leading_forwards(schedule: str, n_rows: int, n_slices: int, stage: int, n_stages: int) -> int:
    """The forwards stage ``stage`` runs before its first backward: at most what it can run of the next
    step at the end of a step (``ahead``). In forward (unit) order; min(n_rows, P - s) batch slices'
    worth under 1f1b, every unit under gpipe: the batch slices the stage holds at its peak."""
    order = unit_order(schedule, n_rows, n_slices, stage, n_stages)
    return next((k for k, (kind, _, _) in enumerate(order) if kind != "F"), len(order))


def ahead(prefetch: int, schedule: str, n_rows: int, n_slices: int, stage: int, n_stages: int) -> int:
    """The next step's forwards stage ``stage`` runs at the end of a step under ``--prefetch`` N (the
    first stage's count): N - stage, at most its ``leading_forwards``, none on the last stage (nothing
    after it waits). Never more than the previous stage's count, so each prefetched forward's input
    was sent in the same step."""
    if stage >= n_stages - 1:
        return 0
    return max(0, min(prefetch - stage, leading_forwards(schedule, n_rows, n_slices, stage, n_stages)))
