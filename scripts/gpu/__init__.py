"""The GPU suite: `python -m scripts.gpu <sub-command>` (__main__.py lists them; `all` runs every
check and table). `environment` is how each finds the wheels carried to a host without a package
index (`--site DIR`) and sets up the environment of the processes it starts."""
