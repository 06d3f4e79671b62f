"""Multi-node for real: two "hosts" as Linux network namespaces joined by a veth pair.

Each namespace runs `torchrun --nnodes 2 --nproc-per-node 2` (c10d rendezvous on 10.231.0.1, an
address that exists only inside the namespaces made here) with a /dev/shm of its own, as two
machines have (so the gradient buckets' shared-memory slots, dist/host_slots.py, find that the group
spans two hosts and leave the reduction to gloo); gloo is pinned to the veth. Checks:
the four ranks train to exactly the weights of `ndtrain train --nproc 4` through gloo (torch.equal); with
delay and loss on the link (`tc netem`, or a small `tbf` queue where the kernel lacks netem) they
still do; with the link cut every rank exits with the watchdog's message.
Skips (with the reason) only where namespaces cannot be made: not root, or no `ip`/`tc` (iproute2).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import torch

from ndtrain.checkpoint.run_model import load_run
from tests.helpers.processes import no_restarts, wait_for
from tests.helpers.runs import corpus_file

ADDRESSES = ("10.231.0.1", "10.231.0.2")
PORT = 29400  # free by construction: the namespaces are new
WATCHDOG_S = 10
TRAIN = ["--model", "tiny", "--set", "schedule.global_batch=8", "--set", "schedule.micro_batch=2",
         "--set", "log.progress=false", "--set", "log.log_every=1", "--set", "data.eval_samples=8"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass(frozen=True)
class Hosts:
    namespaces: tuple[str, str]
    links: tuple[str, str]

    def link_bytes(self) -> int:
        """Bytes received on host 0's end of the link."""
        path = f"/sys/class/net/{self.links[0]}/statistics/rx_bytes"
        out = subprocess.run(["ip", "netns", "exec", self.namespaces[0], "cat", path],
                             check=True, capture_output=True, text=True, timeout=30)
        return int(out.stdout)


def _cannot_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (the CI machine runs as root)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: install iproute2 to run the two-host test"
    return None


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    """Two namespaces joined by a veth pair (10.231.0.1/24 ↔ 10.231.0.2/24); removed afterwards."""
    reason = _cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    namespaces, links = (f"ndt-{tag}-a", f"ndt-{tag}-b"), (f"ndt{tag}a", f"ndt{tag}b")
    made: list[str] = []
    try:
        for ns in namespaces:
            try:
                _ip("netns", "add", ns)
            except subprocess.CalledProcessError as e:
                pytest.skip(f"cannot create a network namespace: {e.stderr.strip()}")
            made.append(ns)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for ns, link, address in zip(namespaces, links, ADDRESSES):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", link, "up")
        yield Hosts(namespaces, links)
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@dataclass
class Node:
    proc: subprocess.Popen
    log: Path  # stdout and stderr together: a pipe nobody reads could fill up and block a rank

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_nodes(hosts: Hosts, tmp_path: Path, out: Path, *args: str) -> list[Node]:
    """`torchrun --nnodes 2 --nproc-per-node 2 -m ndtrain train ...` in each namespace (node 0 hosts the store)."""
    data = corpus_file(tmp_path)
    nodes = []
    for node, (ns, link, address) in enumerate(zip(hosts.namespaces, hosts.links, ADDRESSES)):
        cmd = [
            # a /dev/shm of the host's own, as separate machines have (`ip netns exec` runs in a mount
            # namespace of its own): the ranks' shared-memory slots cannot span the two hosts
            "ip", "netns", "exec", ns, "sh", "-c", 'mount -t tmpfs -o size=1g ndtrain-host /dev/shm && exec "$@"', "sh",
            "env", f"GLOO_SOCKET_IFNAME={link}",
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDRESSES[0]}:{PORT}", "--rdzv-id", "ndtrain-2hosts",
            "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", address,
            "-m", "ndtrain", "train", "--data", data, "--out", str(out), *TRAIN, *args,
        ]
        log = tmp_path / f"{out.name}-node{node}.log"
        with log.open("w") as sink:
            nodes.append(Node(subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT), log))
    return nodes


def finish(nodes: list[Node], timeout: float) -> str:
    """Wait for every node (bounded in all), killing what is left; return their output."""
    deadline = time.monotonic() + timeout
    try:
        for node in nodes:
            try:
                node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait()
    return "\n".join(node.output() for node in nodes)


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_run(out)[1].state_dict()


def train_local(tmp_path: Path, out: Path) -> None:
    """The same 4 ranks on this host, reducing through gloo as the two hosts must (not through shared
    memory, whose summation order differs in the last bits)."""
    cmd = [sys.executable, "-m", "ndtrain", "train", "--nproc", "4", "--data", corpus_file(tmp_path),
           "--out", str(out), *TRAIN, "--steps", "4", "--set", "parallel.host_shared_memory=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_two_hosts_train_exactly_like_four_local_workers(hosts: Hosts, tmp_path: Path) -> None:
    train_local(tmp_path, tmp_path / "local")
    nodes = start_nodes(hosts, tmp_path, tmp_path / "two-hosts", "--steps", "4")
    output = finish(nodes, timeout=240)
    assert [n.proc.returncode for n in nodes] == [0, 0], output[-4000:]
    assert_same_weights(final_weights(tmp_path / "two-hosts"), final_weights(tmp_path / "local"))
    assert hosts.link_bytes() > 4 * 100_000  # the gradients (≈137 KB per all-reduce) crossed the veth


NETEM = ["netem", "delay", "20ms", "5ms", "loss", "2%"]
# Where the kernel has no sch_netem (as here: "Specified qdisc kind is unknown"), a token bucket
# with a queue of a few packets: 20 Mbit/s, so a 137 KB all-reduce queues (delay), and a 16 KB
# queue that overflows on every burst (loss: tail drops that TCP must retransmit).
TBF = ["tbf", "rate", "20mbit", "burst", "8kb", "limit", "16kb"]


def impair(hosts: Hosts) -> str:
    """Put delay and loss on both ends of the link: netem if the kernel has it, else a small token bucket."""
    for qdisc in (NETEM, TBF):
        done = [subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", link, "root", *qdisc],
                               capture_output=True, timeout=30).returncode == 0
                for ns, link in zip(hosts.namespaces, hosts.links)]
        if all(done):
            return qdisc[0]
    pytest.fail("neither netem nor tbf can be put on the link")


def dropped(hosts: Hosts) -> int:
    """Packets the impaired link dropped, summed over both ends (from `tc -s qdisc`)."""
    total = 0
    for ns, link in zip(hosts.namespaces, hosts.links):
        stats = subprocess.run(["tc", "-s", "-n", ns, "qdisc", "show", "dev", link],
                               check=True, capture_output=True, text=True, timeout=30).stdout
        total += sum(int(n) for n in re.findall(r"dropped (\d+)", stats))
    return total


@pytest.mark.slow  # ≈ 40 s; the two-host exactness and cut-link tests keep the namespaces' path in CI
def test_delay_and_loss_on_the_link_still_train_exactly(hosts: Hosts, tmp_path: Path) -> None:
    impair(hosts)
    train_local(tmp_path, tmp_path / "local")
    nodes = start_nodes(hosts, tmp_path, tmp_path / "lossy", "--steps", "4")
    output = finish(nodes, timeout=300)
    assert [n.proc.returncode for n in nodes] == [0, 0], output[-4000:]
    assert dropped(hosts) > 0  # the loss was real: TCP retransmitted under gloo
    assert_same_weights(final_weights(tmp_path / "lossy"), final_weights(tmp_path / "local"))


def _workers_of(nodes: list[Node]) -> list[int]:
    """PIDs of the training workers: the ndtrain processes under the nodes' torchrun agents."""
    found = []
    for node in nodes:
        stack = [node.proc.pid]
        while stack:
            pid = stack.pop()
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"ndtrain" in cmdline and b"torch.distributed.run" not in cmdline:
                found.append(pid)
            stack.extend(int(c) for c in children)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in "ZX"


@pytest.mark.slow  # ≈ 40 s; CI keeps the namespaces' path (the two-host exactness above) and the watchdog's own tests
def test_cut_link_ends_every_rank_with_the_watchdog_message(hosts: Hosts, tmp_path: Path) -> None:
    out = tmp_path / "cut"
    nodes = start_nodes(hosts, tmp_path, out, "--steps", "100000", "--set", f"parallel.watchdog_s={WATCHDOG_S}",
                        *no_restarts())
    try:
        wait_for(out / "metrics.jsonl", nodes[0].proc, timeout=180)
        workers = _workers_of(nodes)
        assert len(workers) == 4, workers
        _ip("-n", hosts.namespaces[0], "link", "set", hosts.links[0], "down")
        cut = time.monotonic()
        while any(_alive(pid) for pid in workers) and time.monotonic() - cut < WATCHDOG_S + 15:
            time.sleep(0.2)
        running = [pid for pid in workers if _alive(pid)]
    finally:
        # The agent on the cut-off host blocks on the unreachable rendezvous store (even after
        # SIGTERM): torchrun's behaviour, not the ranks'; it is killed here.
        output = finish(nodes, timeout=10)
    assert not running, f"ranks {running} still running watchdog + 15 s after the cut"
    lines = [re.sub(r"^\[rank\d+\] ", "", line) for line in output.splitlines()]  # other ranks' lines are prefixed
    lines = [line for line in lines if line.startswith("ndtrain: error: rank ")]
    assert sorted(int(line.split()[3]) for line in lines) == [0, 1, 2, 3], output[-4000:]
    for line in lines:
        rank = int(line.split()[3])
        # Where the cut lands depends on timing: the step's gradient all-reduce (axis dp_cp) or the
        # trainer's per-step stop agreement (axis world); both span all 4 ranks.
        assert re.match(rf"ndtrain: error: rank {rank} waited \d+ s in collective #\d+ all_reduce on axis "
                        r"'(dp_cp|world)' \(ranks \[0, 1, 2, 3\]\); ", line), line
        if rank < 2:  # the store's side asks the store: the other host's ranks did not arrive
            assert "; ranks [2, 3] did not arrive (rank 2: last seen " in line, line
        else:
            peers = [r for r in range(4) if r != rank]
            assert line.endswith(f"; the rendezvous store does not answer, so the peers {peers} cannot be asked "
                                 "(is this host cut off from the store's host?)"), line
