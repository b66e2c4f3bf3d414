"""fairscale: a Pipe over each process's local devices, FullyShardedDataParallel across processes
(as the seed's dist_fairscale_pipe_fsdp.py): ``--pp`` is the number of devices in each process's
Pipe, ``--dp`` the number of processes. The training code is ``baselines.fairscale_fsdp.train``;
its CPU shim (``cpu_shim``) is active only where CUDA is absent."""
from contract import SystemSpec

SPEC = SystemSpec(
    name="fairscale_fsdp",
    train="baselines.fairscale_fsdp.train:train",
    description="fairscale Pipe over each process's local devices, FullyShardedDataParallel across processes",
    dims=("pp", "dp"),
    processes=lambda config: config.dp,
    devices_per_process=lambda config: config.pp,
)
