"""bench.recovery's ETTR rows count the recoveries the job's log shows, not the signals the
benchmark sent (the lines are from real runs: 5 kills every 10 s on a loaded machine, in
place, and 2 kills, restart)."""

from __future__ import annotations

from bench.recovery import count_recoveries

# kill 1: rank 0, its replacement is cold (not ready); kill 2: the survivor, rank 1, while the
# group waits (generation 2 supersedes 1); kill 3: rank 0's replacement while it joins: no
# survivor is left, the replacements resume from the newest checkpoint; kills 4 and 5: a step
# committed after each
IN_PLACE = """\
10:08:27.698 [rank0] INFO elastic_runner.checkpoint.manager: no checkpoint in /ck: starting from scratch
10:08:38.182 WARNING elastic_runner.agent.inplace_agent: rank(s) [0] exited with code(s) [-9]: \
replaced in place by cold spare(s) pid(s) [14931] (generation 1; 99 restarts left)
10:08:48.106 WARNING elastic_runner.agent.inplace_agent: rank(s) [1] exited with code(s) [-9]: \
replaced in place by cold spare(s) pid(s) [15051] (generation 2; 98 restarts left)
10:08:58.109 WARNING elastic_runner.agent.inplace_agent: rank(s) [0] exited with code(s) [-9]: \
replaced in place by cold spare(s) pid(s) [15063] (generation 3; 97 restarts left)
10:08:58.113 [rank1] WARNING elastic_runner.recovery.inplace: generation 2 was superseded while forming \
(another worker died); joining 3
10:09:04.283 [rank0] WARNING elastic_runner.recovery.inplace: in-place recovery: no survivor holds the \
state; resuming from the newest checkpoint
10:09:04.353 [rank0] INFO elastic_runner.train.session: resumed from /ck/step-00000114: step 114, \
epoch 6, 0 samples into the epoch
10:09:08.202 WARNING elastic_runner.agent.inplace_agent: rank(s) [1] exited with code(s) [-9]: \
replaced in place by cold spare(s) pid(s) [15143] (generation 4; 96 restarts left)
10:09:13.515 [rank0] WARNING elastic_runner.train.loop: in-place recovery 4 done: step 191 committed \
5.390 s after the failure (detection 0.078 s, teardown 0.000 s, group 5.088 s, state 0.145 s)
10:09:18.110 WARNING elastic_runner.agent.inplace_agent: rank(s) [0] exited with code(s) [-9]: \
replaced in place by cold spare(s) pid(s) [15216] (generation 5; 95 restarts left)
10:09:22.962 [rank1] WARNING elastic_runner.train.loop: in-place recovery 5 done: step 260 committed \
4.879 s after the failure (detection 0.029 s, teardown 0.000 s, group 4.684 s, state 0.084 s)
"""

RESTART = """\
10:15:45.214 [rank0] INFO elastic_runner.checkpoint.manager: no checkpoint in /ck: starting from scratch
10:15:55.511 INFO elastic_runner.observe.node_metrics: worker group failed: restarting it
10:16:01.074 [rank0] INFO elastic_runner.train.session: resumed from /ck/step-00000513: step 513, \
epoch 27, 0 samples into the epoch
10:16:05.497 INFO elastic_runner.observe.node_metrics: worker group failed: restarting it
10:16:11.536 [rank0] INFO elastic_runner.train.session: resumed from /ck/step-00000722: step 722, \
epoch 38, 0 samples into the epoch
"""


def test_in_place_kills_failures_and_recoveries_differ():
    assert count_recoveries(IN_PLACE) == {"failures": 5, "recoveries": 3, "settled": True}


def test_a_failure_without_a_recovery_after_it_is_not_settled():
    before_last_done = IN_PLACE[:IN_PLACE.index("10:09:22.962")]
    assert count_recoveries(before_last_done) == {"failures": 5, "recoveries": 2,
                                                  "settled": False}
    before_last_resume = RESTART[:RESTART.index("10:16:11.536")]
    assert count_recoveries(before_last_resume) == {"failures": 2, "recoveries": 1,
                                                    "settled": False}


def test_restarts_are_counted_by_rank_0s_resumes_not_its_first_start():
    assert count_recoveries(RESTART) == {"failures": 2, "recoveries": 2, "settled": True}
    first_start = RESTART[:RESTART.index("10:15:55.511")]
    assert count_recoveries(first_start) == {"failures": 0, "recoveries": 0, "settled": True}
