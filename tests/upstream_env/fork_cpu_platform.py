"""A vLLM platform plugin that selects the CPU platform.

vLLM picks the CPU platform when the installed package's version carries
`+cpu`. A source tree on PYTHONPATH has no installed version, so the tests
register this entry point (see fork_cpu_platform-0.dist-info) instead.

With VLLM_FORK_CPU_HYBRID=1 (the end-to-end run only) it selects a CPU
platform that allows the hybrid KV cache manager, which the real CPU
platform refuses: the model-free worker has no attention kernels to lack.
"""

import os


def activate() -> str:
    if os.environ.get("VLLM_FORK_CPU_HYBRID") == "1":
        return "fork_hybrid_cpu_platform.HybridCpuPlatform"
    return "vllm.platforms.cpu.CpuPlatform"
