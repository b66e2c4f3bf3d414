"""The workload every system trains: one GPT model file, its configs, the data, FLOP counts."""
