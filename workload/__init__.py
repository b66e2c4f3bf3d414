"""The workload every system trains: one model file (the gpt and llama families), its configs, the data, FLOP counts."""
