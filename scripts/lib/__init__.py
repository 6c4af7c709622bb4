"""The library the three jobs share, at the bottom: imports nothing above it.

`errors` (ForkError), `paths` (where the fork's files are), `proc` (running
commands and git), `cli` (messages, the argument parser, the entry point);
`series` (a series directory and its patches); `venv` (the Python
environments) and `testenv` (the environment a vLLM tree is tested in).
"""
