"""A vLLM platform plugin that selects the CPU platform.

vLLM picks the CPU platform when the installed package's version carries
`+cpu`. A source tree on PYTHONPATH has no installed version, so the tests
register this entry point (see fork_cpu_platform-0.dist-info) instead.
"""


def activate() -> str:
    return "vllm.platforms.cpu.CpuPlatform"
