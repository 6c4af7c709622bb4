"""The CPU platform, allowing the hybrid KV cache manager (tests only).

Selected by fork_cpu_platform when VLLM_FORK_CPU_HYBRID=1: the end-to-end
run serves full + sliding-window groups with a model-free worker, so the
kernels the real CPU platform lacks for them are never called.
"""

from vllm.platforms.cpu import CpuPlatform


class HybridCpuPlatform(CpuPlatform):
    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return True
