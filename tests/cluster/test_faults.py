"""Network faults on a namespace cluster of 2 nodes x 2 ranks (issue 25, item 5), each in the middle of a
job that loops one collective, or one training step of MoELayer, under A2A_TIMEOUT_S=5 (fault_job.py):

- node 1's link taken down, in each collective (linear, 2dh, flex, v) and in the layer's step;
- node 1's processes killed (its ranks and its MPI daemon);
- node 1's link slowed to 10 Mbit/s in a large exchange.

Every surviving rank must raise within the timeout plus 10 s, naming the ranks it waited for, every call
that returned must have been exact, and the job must end non-zero; the slowed job must end with status 0,
every result exact, its calls slower. After a kill, mpirun ends the job, and its ranks with it, within
about 0.1 s, ULFM or not: there the test asks it of every survivor that raised before that.

What Open MPI needs for that (docs/benchmarks.md, "Network faults"): its fault tolerance (ULFM, `a2a.cluster
run --ft`), without which its TCP transport aborts the survivors of a killed node before they can raise;
and TCP that gives up on a silent peer in seconds (net.ipv4.tcp_retries2=4 in the nodes: about 6 s, not
about 15 minutes), since Open MPI's runtime has no heartbeat: until TCP gives up, mpirun waits for the
node that cannot answer. Each test writes its records and mpirun's output to build/test-logs/faults/NAME.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

import pytest

from a2a import cluster as cl
from a2a.cluster import nodes

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
JOB = os.path.join(HERE, "fault_job.py")
LOGS = os.path.join(ROOT, "build", "test-logs", "faults")

TIMEOUT_S = 5  # A2A_TIMEOUT_S of the jobs
RAISE_BOUND_S = TIMEOUT_S + 10  # every surviving rank raises within this of the fault
END_BOUND_S = 40  # and the job has ended within this (measured: 8-16 s)
START_BOUND_S = 120  # every rank looping (the layer's imports take longest on a loaded machine)
TCP_RETRIES = 4  # the nodes' net.ipv4.tcp_retries2: TCP gives up on a silent peer after about 6 s
FAULTY_NODE = 1  # node 0 runs mpirun
RANKS = {0: (0, 1), 1: (2, 3)}  # node -> its ranks (--map-by ppr:2:node)
ALL_RANKS = [0, 1, 2, 3]
OPS = ["linear", "2dh", "flex", "v", "layer"]  # fault_job.py's: the collectives, and the layer's step
SLOW_RATE = "10mbit"
# Rows of 16 bytes to each peer: 1 MiB each way over a node's link, about 0.9 s at 10 Mbit/s (the first call
# slowed takes twice that, as TCP recovers the packets the shaper dropped), well within A2A_TIMEOUT_S.
SLOW_ROWS = 16384
PEER = re.compile(r"(?:send to|recv from) rank (\d+)")


@pytest.fixture
def cluster():
    """Two nodes, up for one test and down after it, whatever happens."""
    cluster = cl.current()
    cl.up(len(RANKS), cluster=cluster)
    try:
        for node in RANKS:
            nodes.in_ns(cluster.node(node), "sysctl", "-qw", f"net.ipv4.tcp_retries2={TCP_RETRIES}")
        yield cluster
    finally:
        cl.down(quiet=True, cluster=cluster)


class Job:
    """fault_job.py on every rank, through `python -m a2a.cluster run --ft`, its output in `out`."""

    def __init__(self, name: str, op: str, *options: str):
        self.out = os.path.join(LOGS, name)
        shutil.rmtree(self.out, ignore_errors=True)
        os.makedirs(self.out)
        env = {**os.environ, "A2A_TIMEOUT_S": str(TIMEOUT_S), "PYTHONUNBUFFERED": "1"}
        env.pop("A2A_LOCAL_SIZE", None)  # the nodes are real
        self.command = [sys.executable, "-m", "a2a.cluster", "run", "--ft", "--nodes", str(len(RANKS)),
                        "--ranks-per-node", "2", "--", sys.executable, JOB, "--op", op, "--out", self.out, *options]
        self.env = env
        self.relaunched = False
        self.start()

    def start(self) -> None:
        with open(os.path.join(self.out, "mpirun.log"), "a") as log:
            self.process = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def log(self) -> str:
        """The end of mpirun's output, and how each node's daemon ended (the cluster's agent logs it)."""
        with open(os.path.join(self.out, "mpirun.log"), errors="replace") as log:
            text = log.read()[-3000:]
        with contextlib.suppress(FileNotFoundError), open(cl.current().daemons_log) as daemons:
            text += "\ndaemons ended (node status): " + " ".join(daemons.read().split())
        return text

    def wait_looping(self) -> None:
        """Until every rank's first call has passed its check."""
        deadline = time.monotonic() + START_BOUND_S
        while not all(self.ready()):
            if self.process.poll() is not None and self.launch_failed() and not self.relaunched:
                # Open MPI's runtime lost a node's daemon before it started any rank (seen once in CI, on a
                # loaded machine): not the fault under test, so the job is launched once more.
                print(f"{os.path.basename(self.out)}: a daemon did not report back; launched once more")
                self.relaunched = True
                with contextlib.suppress(ProcessLookupError):  # anything the first launch left behind
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.start()
                deadline = time.monotonic() + START_BOUND_S
                continue
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.end()
                pytest.fail(f"the job did not start looping (status {self.process.returncode}):\n{self.log()}")
            time.sleep(0.1)
        time.sleep(0.5)  # a few calls more: the fault lands in the loop, not at its start

    def ready(self) -> list[bool]:
        """Whether each rank's first call has passed its check (fault_job.py's ready files)."""
        return [os.path.exists(os.path.join(self.out, f"ready{rank}")) for rank in ALL_RANKS]

    def launch_failed(self) -> bool:
        """Whether mpirun ended because a node's daemon failed to start, before any rank was ready."""
        return not any(self.ready()) and "failed to report back" in self.log()

    def wait(self, bound_s: float) -> float | None:
        """Seconds until the job ended, or None if it ran past `bound_s` (then it is ended)."""
        start = time.time()
        try:
            self.process.wait(timeout=bound_s)
        except subprocess.TimeoutExpired:
            self.end()
            return None
        return time.time() - start

    def end(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def records(self) -> dict[int, dict]:
        found = {}
        for rank in ALL_RANKS:
            path = os.path.join(self.out, f"rank{rank}.json")
            if os.path.exists(path):
                with open(path) as src:
                    found[rank] = json.load(src)
        return found

    def summarize(self, fault: float, ended_s: float | None, **figures) -> None:
        """The figures of docs/benchmarks.md, beside the records: seconds from the fault to each raise."""
        raised = {r: rec for r, rec in self.records().items() if rec["error"]}
        summary = {"status": self.process.returncode, "ended_s": ended_s and round(ended_s, 2),
                   "raised_s": {r: round(rec["raised_at"] - fault, 2) for r, rec in raised.items()},
                   "named": {r: f"{rec['error']} {sorted(set(map(int, PEER.findall(rec['message']))))}"
                             for r, rec in raised.items()}, **figures}
        with open(os.path.join(self.out, "summary.json"), "w") as out:
            json.dump(summary, out)


def across(rank: int) -> set[int]:
    """The ranks on the other side of node FAULTY_NODE's link from `rank`."""
    faulty = set(RANKS[FAULTY_NODE])
    return set(ALL_RANKS) - faulty if rank in faulty else faulty


def assert_told(job: Job, fault: float, ended_s: float | None, survivors: list[int], every: bool = True) -> None:
    """Every survivor (not `every`: every survivor that mpirun left time to) raised within RAISE_BOUND_S of
    the fault, naming the ranks it waited for: ranks across the fault, or survivors of its own side, stuck
    themselves (a rank a call or a phase ahead waits for them); on each side of the fault some rank that
    raised names a rank across it."""
    assert ended_s is not None, f"the job was still running {END_BOUND_S} s after the fault:\n{job.log()}"
    assert job.process.returncode != 0, f"the job ended with status 0:\n{job.log()}"
    records = job.records()
    told = sorted(records) == survivors if every else set(records) <= set(survivors)
    assert told, f"records of ranks {sorted(records)}, survivors {survivors}:\n{job.log()}"
    naming_across = set()
    for rank, record in records.items():
        what = f"rank {rank}: {record}"
        assert record["error"] in ("A2ATimeoutError", "TransportError"), what
        assert record["raised_at"] - fault <= RAISE_BOUND_S, what
        assert record["calls"] >= 1 and record["wrong"] == 0, what
        named = {int(peer) for peer in PEER.findall(record["message"])}
        waited_for = across(rank) | set(survivors) - {rank}
        assert named and named <= waited_for, f"{what}: names {sorted(named)}, not ranks of {sorted(waited_for)}"
        if named & across(rank):
            naming_across.add(rank)
    for node, ranks in RANKS.items():
        side = set(ranks) & set(records)
        assert not side or side & naming_across, f"no rank of node {node} names a rank across the fault"


@pytest.mark.parametrize("op", OPS)
def test_a_link_down_tells_every_rank(cluster, op):
    job = Job(f"link-down-{op}", op)
    job.wait_looping()
    fault = time.time()
    cl.set_link(FAULTY_NODE, "down", cluster)
    ended_s = job.wait(END_BOUND_S)
    job.summarize(fault, ended_s)
    assert_told(job, fault, ended_s, survivors=ALL_RANKS)


@pytest.mark.parametrize("op", OPS)
def test_a_killed_node_tells_the_surviving_ranks(cluster, op):
    job = Job(f"node-killed-{op}", op)
    job.wait_looping()
    fault = time.time()
    assert cl.kill_node(FAULTY_NODE, cluster) > 0
    ended_s = job.wait(END_BOUND_S)
    job.summarize(fault, ended_s)
    # The survivors raise 10-60 ms after the kill, but mpirun ends the job as soon as it sees the node's
    # daemon gone (30-130 ms), ULFM or not, its ranks with it, and as soon as a survivor exits non-zero:
    # a survivor not done by then (or waiting for one that is) leaves no record.
    assert_told(job, fault, ended_s, survivors=list(RANKS[0]), every=False)


def test_a_slowed_link_only_slows(cluster):
    job = Job("link-slowed", "linear", "--per-peer", str(SLOW_ROWS), "--until-stop")
    job.wait_looping()
    time.sleep(1.0)  # calls at full speed
    fault = time.time()
    cl.set_rate(FAULTY_NODE, SLOW_RATE, cluster)
    shaped = time.time()
    time.sleep(3 * TIMEOUT_S)  # calls at 10 Mbit/s
    open(os.path.join(job.out, "stop"), "w").close()
    ended_s = job.wait(END_BOUND_S)
    records = job.records()
    assert ended_s is not None and job.process.returncode == 0, job.log()
    assert sorted(records) == ALL_RANKS, job.log()
    for rank, record in records.items():
        assert record["error"] is None and record["wrong"] == 0, f"rank {rank}: {record}"
    calls = [(start, end) for record in records.values() for start, end in record["times"]]
    before = statistics.median(end - start for start, end in calls if end < fault)
    after = statistics.median(end - start for start, end in calls if start > shaped)
    # The ranks with a call in flight while the link was being slowed.
    midway = [rank for rank, record in records.items() if any(start < shaped and end > fault
                                                              for start, end in record["times"])]
    job.summarize(fault, ended_s, call_s_before=round(before, 4), call_s_after=round(after, 3), midway=midway)
    assert midway, "the link was slowed between calls, not in the middle of one"
    assert after > 10 * before, f"calls took {after:.3f} s at {SLOW_RATE}, {before:.4f} s before"
