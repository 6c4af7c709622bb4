"""The library the three jobs share, at the bottom: imports nothing above it.

Paths, errors, running commands and git, the command line (`common`); a
series directory and its patches (`series`); the Python environments
(`venv`) and the environment a vLLM tree is tested in (`testenv`).
"""
