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
