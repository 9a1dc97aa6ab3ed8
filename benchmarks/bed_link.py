"""The cluster bed's shaped link itself: does bulk TCP get the rate `launch/cluster.sh shape` sets,
one stream alone and two at once, one each way (what an all-to-all or a two-rank reduce sends)?

Without netem the bed shapes with tbf: a token bucket at the rate before a queue as long in time
as `queue=` says (100 ms by default). Each direction has its own queue, and each carries one
stream's data and the other stream's acknowledgements; this measures, per rate and queue length
and a few times over, whether two opposite streams both get the rate that one alone gets
(benchmarks/README.md §12: what the 200 Mbit/s condition loses beyond its wire time). Needs root
and iproute2 and a kernel without netem (tbf shapes the queue); the bed is `tknode0`/`tknode1` at
10.214.0.1-2 and every byte goes between those two addresses, nowhere else.

    python benchmarks/bed_link.py                      # 1 Gbit and 200 Mbit, queues 100 ms and 5 ms
    python benchmarks/bed_link.py --rates 200mbit --queues 100ms,20ms,5ms
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from trinity_harness.cluster_bed import ClusterBed, bed_unavailable
from trinity_harness.jobs import loadavg
from trinity_harness.table import markdown_table

ROOT = Path(__file__).resolve().parents[1]
PREFIX, SUBNET, PORT = "tk", "10.214.0", 5999  # a prefix and /24 no test bed uses
TIMEOUT_S = 120  # any one transfer; a stalled one stops the script with the error, it does not hang

RECEIVE = """
import socket, sys
server = socket.create_server((sys.argv[1], {port}))
server.settimeout({timeout})
conn, _ = server.accept()
conn.settimeout({timeout})
while conn.recv(1 << 20):
    pass
conn.close()
"""

SEND = """
import socket, sys, time
mib = int(sys.argv[2])
conn = socket.create_connection((sys.argv[1], {port}), timeout={timeout})
chunk = bytes(1 << 20)
start = time.perf_counter()
for _ in range(mib):
    conn.sendall(chunk)
conn.shutdown(socket.SHUT_WR)
conn.recv(1)  # the receiver's close: every byte arrived
print(f"{{mib * 2 ** 20 / (time.perf_counter() - start) / 1e6:.2f}}")
"""


def rate_mb_s(rate: str) -> float:
    """tc's rate ('200mbit', '1gbit') in MB/s (1e6 B)."""
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate).groups()
    return float(number) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[unit] / 8 / 1e6


def streams(bed: ClusterBed, pairs: list[tuple[int, int]], mib: int) -> list[float]:
    """MB/s of each (sender, receiver) stream, all started together."""
    script = str(ROOT / "launch" / "cluster.sh")
    receive = RECEIVE.format(port=PORT, timeout=TIMEOUT_S)
    send = SEND.format(port=PORT, timeout=TIMEOUT_S)
    receivers = [subprocess.Popen([script, "exec", bed.host(dst), sys.executable, "-c", receive, bed.addr(dst)],
                                  env=bed.env) for _, dst in pairs]
    try:
        time.sleep(1.0)  # listening
        senders = [subprocess.Popen([script, "exec", bed.host(src), sys.executable, "-c", send, bed.addr(dst), str(mib)],
                                    env=bed.env, stdout=subprocess.PIPE, text=True) for src, dst in pairs]
        return [float(p.communicate(timeout=TIMEOUT_S)[0]) for p in senders]
    finally:
        for p in receivers:
            try:
                p.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1gbit,200mbit", help="tc rates, comma-separated")
    parser.add_argument("--queues", default="100ms,5ms", help="tbf queue lengths in time, comma-separated")
    parser.add_argument("--seconds", type=float, default=2.0, help="about how long each stream sends at the rate")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each rate and queue")
    args = parser.parse_args()
    reason = bed_unavailable()
    if reason:
        print(f"error: the cluster bed cannot run here: {reason}", file=sys.stderr)
        return 1
    bed = ClusterBed(2, PREFIX, SUBNET)
    print(f"# load: {loadavg()}")
    rows = []
    try:
        bed.up()
        for rate in args.rates.split(","):
            mib = max(8, round(rate_mb_s(rate) * args.seconds * 1e6 / 2 ** 20))
            for queue in args.queues.split(","):
                done = bed.shape(1, f"rate={rate}", f"queue={queue}")
                if done.returncode != 0:
                    raise RuntimeError(done.stderr.strip())
                for _ in range(args.repeats):
                    one = streams(bed, [(0, 1)], mib)[0]
                    both = streams(bed, [(0, 1), (1, 0)], mib)
                    rows.append([rate, queue, f"{one:.1f}", f"{both[0]:.1f}, {both[1]:.1f}",
                                 f"{min(both) / rate_mb_s(rate):.2f}"])
                    print(f"rate {rate}, queue {queue}: one stream {rows[-1][2]} MB/s, two {rows[-1][3]} MB/s",
                          flush=True)
                bed.shape(1, "off")
    finally:
        bed.down()
    print(f"# load after: {loadavg()}")
    print(markdown_table(["rate", "queue", "one stream, MB/s", "two streams, one each way, MB/s",
                          "share of the rate (worse of the two)"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
