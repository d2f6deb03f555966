"""Step threads that give way to other work on the cores (vivace.engine.core_share)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from vivace import LLM, SamplingParams
from vivace.engine.core_share import (GROW_HOLD_S, IDLE_TO_GROW, MAX_GROW_HOLD_S, REGRET_S, WAITING_TO_SHRINK,
                                      CoreShare, IdleCores, ThreadWaits)


def test_waiting_threads_drop_step_threads_and_idle_cores_bring_them_back():
    share = CoreShare(4)
    share.enabled = True
    assert share.decide(waiting=0.05, idle_cores=0.0, busy=4.0, now=0.0) is None  # alone: nothing waits
    assert share.decide(waiting=WAITING_TO_SHRINK + 0.2, idle_cores=0.0, busy=3.0, now=1.0) == 3  # one busy process
    assert share.decide(waiting=2.5, idle_cores=0.0, busy=2.0, now=2.0) == 1  # many: down to one, never below
    assert share.decide(waiting=3.0, idle_cores=0.0, busy=1.0, now=3.0) is None
    assert share.decide(waiting=0.0, idle_cores=IDLE_TO_GROW - 0.1, busy=1.0, now=10.0) is None  # still there
    assert share.decide(waiting=0.0, idle_cores=3.0, busy=0.1, now=10.0) is None  # idle, but so were the steps
    assert share.decide(waiting=0.0, idle_cores=1.0, busy=1.0, now=10.0) == 2  # one core came free
    assert share.decide(waiting=0.0, idle_cores=5.0, busy=2.0, now=11.0) == 4  # never above the configured count
    assert share.decide(waiting=0.0, idle_cores=5.0, busy=4.0, now=12.0) is None


def test_a_return_the_other_work_answers_at_once_doubles_the_wait_before_the_next():
    share = CoreShare(2)
    share.enabled = True
    now = 100.0
    assert share.decide(waiting=1.0, idle_cores=0.0, busy=1.0, now=now) == 1
    holds = []
    for _ in range(4):
        # Idle cores while the steps ran, but too soon after the drop: no return yet.
        assert share.decide(waiting=0.0, idle_cores=1.0, busy=1.0, now=now + 0.5) is None
        start = now
        while share.decide(waiting=0.0, idle_cores=1.0, busy=1.0, now=now) is None:
            now += 0.25
        holds.append(now - start)
        now += 0.25
        assert share.decide(waiting=1.0, idle_cores=0.0, busy=1.0, now=now) == 1  # the other work is back
    assert holds == sorted(holds) and holds[-1] >= 4 * holds[0]
    # A drop long after the last return starts again from the shortest wait.
    now += 2 * MAX_GROW_HOLD_S
    assert share.decide(waiting=0.0, idle_cores=1.0, busy=1.0, now=now) == 2
    now += REGRET_S + 1
    assert share.decide(waiting=1.0, idle_cores=0.0, busy=1.0, now=now) == 1
    assert share.decide(waiting=0.0, idle_cores=1.0, busy=1.0, now=now + GROW_HOLD_S) == 2


# Two torch threads on one core, multiplying: one always waits for the core while the other runs.
CROWDED = """
import os, time, torch
from vivace.engine.core_share import IdleCores, ThreadWaits
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
torch.set_num_threads(2)
a = torch.randn(768, 768)
waits = ThreadWaits()
start, (_, waited) = time.perf_counter(), waits.read()
while time.perf_counter() - start < 1.0:
    a = torch.tanh(a @ a)
print((waits.read()[1] - waited) / (time.perf_counter() - start))
"""


@pytest.mark.skipif(ThreadWaits().read() is None or IdleCores().read() is None,
                    reason="needs Linux's per-thread schedstat and /proc/stat")
def test_thread_waits_sees_threads_waiting_for_a_core():
    crowded = float(subprocess.run([sys.executable, "-c", CROWDED], capture_output=True, text=True,
                                   check=True, timeout=120).stdout)
    assert crowded > 0.3  # ~1: a thread's worth waits the whole time

    # A thread that ends leaves what it ran counted (without that, the sums would go back).
    worked, go = threading.Event(), threading.Event()

    def work() -> None:
        sum(range(5 * 10**6))
        worked.set()
        go.wait()

    worker = threading.Thread(target=work)
    worker.start()
    worked.wait()
    waits = ThreadWaits()
    before = waits.read()
    go.set()
    worker.join()
    after = waits.read()
    assert before is not None and after is not None
    assert after[0] >= before[0] and after[1] >= before[1]
    waits.close()


def test_results_do_not_depend_on_the_thread_count(tiny_model_dir):
    """What lets the step threads change mid-stream: every kernel sums in its own order,
    whatever the threads (a long prompt through the prefill path, then decode steps)."""
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True)
    prompts = ["The quick brown fox " * 40, "Once upon a time"]
    threads = torch.get_num_threads()
    try:
        runs = []
        for count in (1, 2):
            torch.set_num_threads(count)
            outputs = LLM(str(tiny_model_dir), num_kv_blocks=128, block_size=4).generate(prompts, params)
            runs.append([(o.outputs[0].token_ids, [(p.logprob, p.top) for p in o.outputs[0].logprobs])
                         for o in outputs])
    finally:
        torch.set_num_threads(threads)
    assert runs[0] == runs[1]
