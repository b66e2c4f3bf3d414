"""The reference: single-process training of the whole model on the global batch, accumulated over
micro-batches. Every system's --verify and every parity test compares against it."""
from contract import SystemSpec

SPEC = SystemSpec(
    name="reference",
    train="baselines.reference.train:train",
    description="single-process training of the whole model: the reference every system is verified against",
    processes=lambda config: 1,
    role="reference",
)
