"""Known gaps found by the differential oracle on seeds it had never run:
`scripts/prove/differential.py --seeds 1600 --first-seed 31337` on the
0.20.2 series (2026-11-28; 6,400 traces: 3 failed; stalls base 1,025,
series 16). Each is a test now.

mixed 31958 (lazy CPU offload, sync, sliding-window hybrid, FCFS) and
mixed 32693 (eager, priority): the series ended with nothing running, a
request at the head of the waiting queues that does not fit (in 31958
r10, promoted from a CPU load, in skipped_waiting ahead of every waiting
request under FCFS), and behind it a streaming session that was given its
last chunk and the end of the session while it held its blocks (r7: 30 of
37 blocks, and 6 would finish it). 0009 went on only to finished loads
and requests promoted from one, never to a session (sessions keep the
release's order: run early they went back to idling on their blocks,
mixed trace 178), and 0010 may not free a session that was ever
preempted when a connector is configured (it would reach the worker as
resumed with its old prompt). So nothing ran again, where the release,
which loaded less (0003 pins the CPU hits it loads), finishes them.

0009 now goes on, with a connector, to a session whose end is queued
(it does not go back to idling): 31958 drains. In 32693 that was not
enough: the head r5 (priority 1) holds 12 blocks and needs 4 more, with
1 free; the session r1 (priority 2, its end queued, preempted once) holds
20 and needs 3 to finish. Neither fits, and 0010 may not take r1; 0010
now frees the head in that case, and 32693 drains too. Its replay is in
test_kv_holders_go_first.py, with the reproducer files the fast suite of
`make mutate` runs.

async-mixed 32038 (no connector, async scheduling, full attention): the
series failed with "Invalid request status: RUNNING" where the release
stalls, the class of async-mixed 5968 in test_waiting_requests_queued_once
(the ledger's preempted-gets-stale-output, fixed by 0017).
"""

from __future__ import annotations

from harness.trace_replay import replay


def test_a_session_given_its_last_chunk_is_not_left_behind():
    record = replay(31958, "mixed", hash_seed=31337)
    assert record["crash"] is None, record["crash"]
    assert "r10" in record["completed"], "the release completes it"
    assert not record["stalled"]


def test_async_mixed_32038_does_not_crash():
    record = replay(32038, "async-mixed", hash_seed=31337)
    assert record["crash"] is None, record["crash"]
