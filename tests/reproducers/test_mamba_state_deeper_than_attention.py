"""Reproducer: a Mamba hybrid with a KV connector never skips tokens whose
attention KV is gone.

With a connector on a Mamba hybrid the scheduler looks up each KV cache
group's prefix hit on its own, and 0.24.0-0.26.0 tell the connector the
deepest of them as the local hit. Block pressure can evict a prompt's last
attention blocks from the GPU prefix cache while its Mamba state block
stays: the Mamba group then hits the whole prompt, full attention only its
first blocks, and the request is admitted as if the whole prompt were
computed. The connector loads nothing (the local hit already covers what
it holds), nobody computes the evicted blocks' tokens, and the request
attends to attention blocks that hold zeros, with no error
(vllm-project/vllm#46453, fixed by #48425 in 0.27.0). The fake model
runner checks the content of every block a step reads.
"""

from __future__ import annotations

from harness.mamba import (
    attention_evicted_past_the_mamba_state,
    mamba_engine,
    skip_where_a_load_is_refused,
)


def test_a_prompt_whose_last_attention_blocks_were_evicted_is_not_skipped():
    e = mamba_engine("align")
    prompt = list(range(100, 164))  # four blocks of 16
    attention_evicted_past_the_mamba_state(e, prompt, kept_blocks=2)
    e.add_request(prompt + list(range(900, 917)), max_tokens=2)
    # 0.19.0-0.22.1 refuse a connector's load with an align group (ledger
    # row mamba-align-external-hit-assert): a skip.
    with skip_where_a_load_is_refused("align"):
        e.run()
    read_wrong = "\n".join(str(v) for v in e.runner.violations)
    assert not read_wrong, f"the extension read blocks nobody wrote:\n{read_wrong}"
