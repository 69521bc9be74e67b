"""What one gloo all-reduce costs on this machine: the floor under tensorpar's CPU step at TP > 1.

Each rank all-reduces a float32 tensor ``REPS`` times in a row, idle otherwise (one thread per
rank, as the bench's ranks run); rank 0 reports the wall time and the CPU time of its process per
call (gloo's own threads included), for a small payload and for the bench model's activation
(B4 x T256 x D512 float32: 2 MiB). A TCP loopback round trip between two processes is timed
beside it, as the transport's own floor::

    python benchmarks/gloo_allreduce.py [--tp 2]
"""

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist

from tensorpar.ranks.local import launch

SIZES = {"4 KiB": 1024, "2 MiB (the bench's activation)": 4 * 256 * 512}
REPS = 200


def _time_all_reduce() -> dict[str, tuple[float, float]]:
    out = {}
    for name, numel in SIZES.items():
        x = torch.randn(numel)
        for _ in range(10):
            dist.all_reduce(x)
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(REPS):
            dist.all_reduce(x)
        out[name] = ((time.perf_counter() - wall) / REPS * 1e3,
                     (time.process_time() - cpu) / REPS * 1e3)
    return out


def _loopback_round_trip_ms(trips: int = 2000) -> float:
    server = socket.create_server(("127.0.0.1", 0))
    if os.fork() == 0:  # the echoing peer
        peer = socket.create_connection(server.getsockname())
        peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(trips):
            peer.sendall(peer.recv(1))
        os._exit(0)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    start = time.perf_counter()
    for _ in range(trips):
        conn.sendall(b"x")
        conn.recv(1)
    took = (time.perf_counter() - start) / trips * 1e3
    os.wait()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    tp = parser.parse_args().tp
    results = launch(_time_all_reduce, tp)[0]
    print(f"gloo all-reduce, {tp} ranks, {REPS} calls each (rank 0, per call):")
    for name, (wall, cpu) in results.items():
        print(f"  {name:32} {wall:6.2f} ms wall, {cpu:6.2f} ms of CPU")
    print(f"TCP loopback round trip: {_loopback_round_trip_ms():.3f} ms")


if __name__ == "__main__":
    main()
