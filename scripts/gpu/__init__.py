"""Checks and figures on a GPU host: `run_all` (the whole report), attention backends, PD and TP on
GPUs, KV transfer between GPUs. `environment` is how each finds the wheels carried to a host
without a package index (`--site DIR`) and sets up the environment of the processes it starts."""
