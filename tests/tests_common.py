WORLD_SIZES = [1, 2, 3, 4]

# torch.optim.AdamW's keyword for each implementation the planner names (plan.memory.ADAMW)
ADAMW_OPTIONS = {"fused": {"fused": True}, "foreach": {"foreach": True},
                 "for-loop": {"foreach": False}}

# the smallest GPT the CLI trains in a few seconds (one block, width 32)
TINY_GPT = ["--n-layer", "1", "--dim", "32", "--n-head", "4", "--n-kv-head", "1", "--seq-len",
            "32", "--batch-size", "4", "--warmup-steps", "3", "--seed", "2"]


def pools_checked(test_dir: str) -> bool:
    """Whether the session's pools for the tests of directory ``test_dir`` (its name) check
    their collectives: as TENSORPAR_CHECK_COLLECTIVES says, read as the CLI reads it; unset or
    "core": the layer tests' (tests/core) alone."""
    import os

    from tensorpar.runtime.groups import CHECK_ENV, checks_wanted

    if os.environ.get(CHECK_ENV, "core").strip().lower() == "core":
        return test_dir == "core"
    return checks_wanted()


def groups_held() -> int:
    """How many process groups this rank holds (the world's included): a pool's rank keeps every
    group a run made (a data-parallel mesh makes one or two), and each keeps gloo's event-loop
    threads polling, idle or not (``conftest.Pools``)."""
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


def cli_env() -> dict:
    """This environment without what a surrounding torchrun would set, nor the suite's own
    switch of checked pools (a command runs as a user's would)."""
    import os

    from tensorpar.runtime.groups import CHECK_ENV

    return {k: v for k, v in os.environ.items()
            if not k.startswith(("TORCHELASTIC", "MASTER_")) and k != CHECK_ENV}


def checkout_env() -> dict:
    """``cli_env()`` with this checkout first on the path (for a child Python process)."""
    import os
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[1])
    return cli_env() | {"PYTHONPATH": os.pathsep.join(filter(None, [repo,
                                                                     os.environ.get("PYTHONPATH")]))}


def tensorpar_cli(*args, timeout: float = 300, cwd=None):
    """``python -m tensorpar ARGS`` as a user runs it, in ``cwd`` (this checkout first on the
    path); the CompletedProcess (text)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "tensorpar", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=checkout_env())


def tensorpar_here(*args, cwd=None):
    """``tensorpar ARGS`` run in this process (``cli.main``, what the ``tensorpar`` script runs
    after starting its fork server): what a user sees (exit status, stdout, stderr) without the
    3-5 s a new Python spends importing torch; in ``cwd`` if given. For requests refused before
    any rank starts, and for runs beside a real process's run of the same command: their ranks
    fork from the session's server (conftest.py). The environment and the signal handlers that
    ``main`` sets are put back. A CompletedProcess, as ``tensorpar_cli`` returns.

    As the script does (``tensorpar/__main__.py``), what this process holds before the command
    is frozen out of the garbage collections while it runs (``gc.freeze``): ``main``'s last
    collection (and Python's own) then walks only what the command made, in place of the
    session's 400,000 or more objects, 0.2-0.6 s a command here."""
    import contextlib
    import gc
    import io
    import os
    import signal
    import subprocess

    from tensorpar.cli.main import main
    from tensorpar.runtime.groups import CHECK_ENV

    argv = list(map(str, args))
    signums = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    env, handlers = dict(os.environ), {s: signal.getsignal(s) for s in signums}
    out, err = io.StringIO(), io.StringIO()
    gc.freeze()
    try:
        os.environ.pop(CHECK_ENV, None)  # the suite's switch is not the command's
        with (contextlib.chdir(cwd or os.getcwd()), contextlib.redirect_stdout(out),
              contextlib.redirect_stderr(err)):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse: a bad flag (2) or --help (0)
                code = e.code if isinstance(e.code, int) else 1
    finally:
        gc.unfreeze()
        os.environ.clear()
        os.environ.update(env)
        for s, handler in handlers.items():
            signal.signal(s, handler)
    return subprocess.CompletedProcess(["tensorpar", *argv], code, out.getvalue(), err.getvalue())


def leftovers(*dirs) -> list:
    """Hidden or temporary files in ``dirs``: what an interrupted write would leave."""
    return [p for d in dirs if d.is_dir() for p in d.iterdir()
            if p.name.startswith(".") or ".tmp" in p.name]


def read_metrics(run) -> list[dict]:
    """The rows of ``RUN/metrics.jsonl``."""
    import json
    from pathlib import Path

    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def board_scalars(board) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of the TensorBoard folder ``board``, as TensorBoard shows them (its
    reader applies the purges a resumed writer records)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(board), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def live_processes() -> list[tuple[int, int, int, str]]:
    """(pid, parent pid, session id, command line) of every live (not zombie) process."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
                cmdline = open(f"/proc/{entry}/cmdline").read().replace("\0", " ")
            except OSError:
                continue
            if fields[0] != "Z":
                found.append((int(entry), int(fields[1]), int(fields[3]), cmdline))
    return found


def child_pids(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    return [p for p, parent, _, _ in live_processes() if parent == pid]


def rank_pids(launcher: int) -> list[int]:
    """The live ranks a ``tensorpar`` process started, in the order they started: the children
    of its fork server (``ranks/forkserver.py``)."""
    found = live_processes()
    servers = {p for p, parent, _, cmd in found if parent == launcher and "forkserver" in cmd}
    return sorted(p for p, parent, _, _ in found if parent in servers)


def sockets(pid: int) -> int:
    """How many sockets process ``pid`` holds open (0 once it is gone)."""
    import os

    try:
        return sum(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
                   for fd in os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return 0


def ranks_met(launcher: int, n: int) -> bool:
    """Whether the ``n`` ranks of a ``tensorpar`` process have met: each holds the sockets of a
    process group (its store connection, and gloo's listening socket and pair connection)."""
    ranks = rank_pids(launcher)
    return len(ranks) >= n and all(sockets(r) >= 3 for r in ranks)


def importing_torch(pid: int) -> bool:
    """Whether process ``pid`` has begun to import torch (its C++ library is mapped)."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return any("libtorch" in line for line in maps)
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_for(event, proc, what: str, timeout: float = 60.0, every: float = 0.02) -> None:
    """Until ``event()`` is true, while ``proc`` runs; fails, with its output, past ``timeout``
    seconds or if it ends first."""
    import time

    deadline = time.monotonic() + timeout
    while not event():
        assert proc.poll() is None, (what, proc.communicate())
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(every)


def char_tokenizer():
    """A character-level tokenizer for the 95 printable ASCII characters (ids 1-95): nothing
    downloaded."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{chr(c): c - 31 for c in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def bpe_tokenizer(folder, vocab_size: int = 512):
    """A byte-level BPE tokenizer (GPT-2's kind) trained on Python's help text, with an
    end-of-text token, saved in ``folder``: nothing downloaded. Returns the folder."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tensorpar.data.text import default_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = default_corpus()
    tok.train_from_iterator([text[i:i + 10_000] for i in range(0, len(text), 10_000)], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(str(folder))
    return folder
