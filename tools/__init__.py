"""Tools beside the harness: they use the run command, the sweeps and the network emulation, and the
harness (``runners``) never imports them.

- ``gpu_check``: the checks that prove the CUDA path on one GPU machine (``scripts/gpu_check.sh``);
- ``verify_spread``: ``--verify``'s spread over many seeds, which ``runners.tolerance`` is derived from;
- ``rehearse``, ``rehearse_slurm``: a cluster sweep rehearsed on virtual nodes (``run_all.sh --rehearse N``);
- ``nodes``, ``node_ssh``, ``slurm_nodes``: virtual nodes with their own sshd, and Slurm on them.

Each tool with a command line says what it does in one line: ``python -m tools.<name> --help``.
"""
