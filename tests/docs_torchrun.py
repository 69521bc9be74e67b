"""``torchrun --standalone --nproc-per-node N NAME.py`` (or ``-m MODULE ARGS``) for the docs'
examples, without new interpreters: N ranks forked from the session's fork server (which has
imported torch and transformers, conftest.py), each given the environment torchrun gives its
ranks (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RUN_ID, one thread), running NAME.py (or the module) as ``__main__`` in the
example's directory. A torchrun process and its
ranks each import torch (and transformers) again: 10-15 s an example on 2 cores, where forked
ranks start in a second. torchrun itself is tested where tensorpar runs under it
(tests/train/test_torchrun_train.py, tests/dp/test_multinode.py and others)."""

import os
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path

NPROC = ("--nproc-per-node", "--nproc_per_node")


def torchrun_args(args: list[str]) -> tuple[int, list[str]] | None:
    """(N, what each rank runs) of torchrun's arguments ``--standalone --nproc-per-node N`` and
    ``NAME.py`` or ``-m MODULE ARGS``; None for any other form (run as a process)."""
    if len(args) > 3 and args[0] == "--standalone" and args[1] in NPROC and args[2].isdigit() \
            and (args[3:] == [args[3]] and args[3].endswith(".py")
                 or args[3] == "-m" and len(args) > 4):
        return int(args[2]), args[3:]
    return None


def _rank(rank: int, world: int, port: int, words: list[str], cwd: str, env: dict, out: str,
          err: str) -> None:
    """One rank: torchrun's environment, its output to ``out`` and ``err`` (the descriptors too,
    for what C++ prints), ``words`` (``NAME.py`` or ``-m MODULE ARGS``) run as ``__main__``; an
    exception or SystemExit becomes the process's exit status, as in a process torchrun
    starts."""
    import runpy

    import torch

    from tensorpar.ranks.signals import rank_defaults

    rank_defaults()
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", ROLE_RANK=str(rank),
                      ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="docs",
                      TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1 for more than one rank
    sys.stdout.flush()
    sys.stderr.flush()
    for path, fd in ((out, 1), (err, 2)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.chdir(cwd)
    sys.path.insert(0, cwd)
    if words[0] == "-m":  # python -m MODULE ARGS
        sys.argv = [words[1], *words[2:]]
        runpy.run_module(words[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = words
        runpy.run_path(os.path.join(cwd, words[0]), run_name="__main__")


def torchrun_here(world: int, words: list[str], cwd: Path, env: dict,
                  timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``words`` on ``world`` forked ranks (``_rank``); the CompletedProcess torchrun's
    would give: its ranks' output in rank order, exit status 1 if a rank failed."""
    from tensorpar.ranks.forkserver import rank_context
    from tensorpar.ranks.local import free_port

    ctx, port = rank_context(), free_port()
    with tempfile.TemporaryDirectory() as logs:
        files = [(f"{logs}/{r}.out", f"{logs}/{r}.err") for r in range(world)]
        procs = [ctx.Process(target=_rank, args=(r, world, port, words, str(cwd), env, *files[r]),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        _wait(procs, timeout)
        codes = [p.exitcode for p in procs]
        out, err = ("".join(Path(f[i]).read_text() for f in files) for i in (0, 1))
    code = 0 if all(c == 0 for c in codes) else 1
    if code:
        err += f"\nranks' exit codes {codes}"
    return subprocess.CompletedProcess(["torchrun", *words], code, out, err)


def _wait(procs, timeout: float) -> None:
    """Until every rank has ended; once one fails or ``timeout`` seconds pass, the others are
    stopped (as torchrun stops a failed run's ranks)."""
    deadline = time.monotonic() + timeout
    while alive := [p for p in procs if p.is_alive()]:
        if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in alive:
                p.kill()
        wait([p.sentinel for p in alive], timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        p.join()
