"""The data pipeline measured: ``tensorpar prepare``'s throughput, a rank's resident memory and
start-up time on 50 MB against 1 GB of token shards, and the share of a step spent waiting for
its batch. Every measurement is a subprocess of ``python -m tensorpar ...``::

    python benchmarks/data_pipeline.py --out benchmarks/results/2026-11-27/data-pipeline.json

1. A corpus generated from Python's help topics (``default_corpus()``'s paragraphs, shuffled by a
   seeded generator; ``--corpus-mb`` in all): ``--files`` text files (one in five of 4.5 MB, the
   others equal; ``prepare`` encodes each in pieces of ``PIECE_CHARS`` characters, 256 Ki since
   the pieces were made small enough to spread one file over the cores, 4 Mi before) and a
   JSON-lines file of documents of 1-8 paragraphs (a tenth of the bytes). A byte-level BPE of
   ``--vocab`` ids (``tests/tests_common.py``'s ``bpe_tokenizer``, trained here, nothing
   downloaded). ``tensorpar prepare`` of all of it, of each kind of input alone and of one
   4.5 MB text file alone: wall time, CPU time (user + system of the process, its tokenizer
   threads included) and their ratio (cores used), tokens/s, MB/s; the ratio also net of
   start-up (less the wall and CPU time of ``prepare`` on a one-line file), and each thread's CPU
   time (how the encoding spread, whatever else ran on the machine). Then the count and the ids are
   checked against the tokenizer's own encoding of every whole document (transformers'
   ``AutoTokenizer``) plus one end-of-text id each.
2. A 1 GB shard folder: the 50 MB corpus's shard file copied until the folder holds ``--big-gib``
   GiB, an index written by hand, the tokenizer copied. ``tensorpar train --tp 1 --steps 5
   --seq-len 256 --batch-size 8`` with a small GPT (2 layers, dim 64) on each folder,
   ``--repeats`` times, alternating: each rank's resident peak (the summary's "resident peak"),
   the wall time from the command's start to the first ``metrics.jsonl`` row, and to its end.
3. The default GPT (6 layers, dim 192, the vocabulary of the tokenizer) at ``--tp 2 --seq-len
   256 --batch-size 8 --steps 30`` on the 1 GB folder, twice: cold (below), then the same command
   again with the pages the first run read still cached (warm): median ``data_s`` and
   ``step_time_s`` of the ``metrics.jsonl`` rows, and sum(data_s) / sum(step_time_s).
4. The batch reads alone (``TokenBatches.batch`` on the 1 GB folder, 60 batches of 8 x 257 ids,
   one process each, nothing else running in it): cold as the trainer maps the files (advised
   ``MADV_RANDOM``: no read-around on a page fault), cold with the maps advised back to
   ``MADV_NORMAL`` (the kernel's read-around, as the trainer read before it advised its maps), and
   warm; with how much the page cache grew. It tells the reading's own cost from the step's.
   ``--big-shard`` makes the large folder of one file instead of copies of the 50 MB shard.

Before each training run (and each cold read of 4.) the shard files of the folder it reads are
evicted from the page cache (``posix_fadvise(DONTNEED)`` on those files only, after ``fsync``):
the runs read cold data, as a first epoch over a corpus larger than memory does. ``--warm``
leaves the cache as it is. The block device's ``read_ahead_kb`` is recorded: a page fault on a
memory-mapped file without ``MADV_RANDOM`` reads that much around the page.

The machine's load average is recorded around each phase: the numbers are only as quiet as the
machine was.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MB = 1_000_000
BIG_FILE_MB = 4.5  # > the 4 Mi-character piece of prepare before PIECE_CHARS became 256 Ki
SMALL_MODEL = ["--n-layer", "2", "--dim", "64", "--n-head", "4", "--n-kv-head", "2"]
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    import tokenizers
    import torch
    import transformers

    return {"cpu": model, "kernel": platform.release(), "cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                / (1 << 30), 1),
            "python": platform.python_version(), "torch": torch.__version__,
            "tokenizers": tokenizers.__version__, "transformers": transformers.__version__,
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def read_ahead_kb(path: Path) -> int | None:
    """The read-ahead of the block device holding ``path`` (None where /sys does not say)."""
    st = os.stat(path)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for queue in (dev / "queue", dev / ".." / "queue"):  # a disk, or a partition's disk
        try:
            return int((queue / "read_ahead_kb").read_text())
        except (OSError, ValueError):
            continue
    return None


def thread_cpu(pid: int, seen: dict) -> None:
    """Each thread of ``pid``: its name and CPU time (user + system) so far, into ``seen``."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name, rest = stat.split("(", 1)[1].rsplit(")", 1)
        fields = rest.split()
        seen[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)


def run(cmd: list[str], first_row: Path | None = None, threads: bool = False) -> dict:
    """Run ``cmd``; its wall time, the CPU time of it and its descendants that were waited for
    (user + system), its output; with ``first_row``, the seconds until that file first held a
    complete line; with ``threads``, the CPU time of each of its threads (last seen, every
    0.1 s) that used more than 0.1 s: how the work spread, whatever else the machine ran."""
    env = os.environ | {"COLUMNS": "400", "PYTHONUNBUFFERED": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env=env)
        row_at, seen, sampled = None, {}, 0.0
        while proc.poll() is None:
            if threads and time.perf_counter() - sampled >= 0.1:
                thread_cpu(proc.pid, seen)
                sampled = time.perf_counter()
            if first_row is not None and row_at is None and first_row.is_file():
                with open(first_row) as f:
                    if f.readline().endswith("\n"):
                        row_at = time.perf_counter() - start
            time.sleep(0.01)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{stdout}\n{stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"command": " ".join(["python", *cmd[1:]]), "wall_s": round(wall, 3),
            "cpu_s": round(cpu, 3),
            "first_row_s": None if row_at is None else round(row_at, 3),
            "thread_cpu_s": sorted(([name, round(cpu, 2)] for name, cpu in seen.values()
                                    if cpu > 0.1), key=lambda x: -x[1]),
            "load_average_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
            "stdout": stdout, "stderr": stderr}


def tensorpar(*args: str) -> list[str]:
    return [sys.executable, "-m", "tensorpar", *args]


# --- 1. the corpus, the tokenizer, prepare ----------------------------------------------------

def make_corpus(folder: Path, total_mb: float, files: int, seed: int) -> dict:
    from tensorpar.data.text import default_corpus

    paragraphs = [p for p in default_corpus().split("\n\n") if p.strip()]
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    jsonl_mb = total_mb / 10
    big = [i for i in range(files) if i % 5 == 4]
    small_mb = (total_mb - jsonl_mb - BIG_FILE_MB * len(big)) / (files - len(big))
    if small_mb <= 0:
        raise SystemExit(f"--corpus-mb {total_mb} is too small for {files} files")

    def text_of(nbytes: float) -> str:
        out, n = [], 0
        while n < nbytes:
            p = rng.choice(paragraphs)
            out.append(p)
            n += len(p.encode()) + 2
        return "\n\n".join(out) + "\n"

    for i in range(files):
        (folder / f"part-{i:02d}.txt").write_text(
            text_of((BIG_FILE_MB if i in big else small_mb) * MB), encoding="utf-8")
    docs, n = 0, 0
    with open(folder / "docs.jsonl", "w", encoding="utf-8") as f:
        while n < jsonl_mb * MB:
            doc = "\n\n".join(rng.choice(paragraphs) for _ in range(rng.randint(1, 8)))
            line = json.dumps({"text": doc}, ensure_ascii=False) + "\n"
            f.write(line)
            n += len(line.encode())
            docs += 1
    sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
    return {"files": len(sizes), "text_files": files, "text_files_over_4MiB": len(big),
            "jsonl_documents": docs, "bytes": sum(sizes.values()),
            "text_file_mb": [round(small_mb, 3), BIG_FILE_MB], "jsonl_mb": round(n / MB, 3)}


def make_tokenizer(folder: Path, vocab: int) -> float:
    sys.path.insert(0, str(ROOT / "tests"))
    from tests_common import bpe_tokenizer

    start = time.perf_counter()
    bpe_tokenizer(folder, vocab)
    return time.perf_counter() - start


def check_counts(corpus: Path, shards: Path, tok_dir: Path) -> dict:
    """Every document of every source encoded whole by the tokenizer itself, plus one end-of-text
    id: the same count per source, and the same ids in the same place of the shards."""
    import transformers

    transformers.logging.set_verbosity_error()
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    index = json.loads((shards / "index.json").read_text())
    eos = tok.eos_token_id
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    ids = np.concatenate([np.fromfile(shards / s["file"], dtype=dtype) for s in index["shards"]])
    start, at, mismatched, checked = time.perf_counter(), 0, [], 0
    sources = index["sources"]
    group: list[tuple[dict, list[str]]] = []

    def flush():
        nonlocal at, checked
        texts = [t for _, docs in group for t in docs]
        encoded = tok(texts, add_special_tokens=False)["input_ids"] if texts else []
        k = 0
        for source, docs in group:
            mine = []
            for _ in docs:
                mine.append(np.asarray(encoded[k] + [eos], dtype=np.int64))
                k += 1
            mine = np.concatenate(mine) if mine else np.empty(0, dtype=np.int64)
            stored = ids[at:at + source["tokens"]].astype(np.int64)
            same = len(mine) == source["tokens"] and np.array_equal(mine, stored)
            checked += len(mine)
            if not same:
                mismatched.append({"file": source["file"], "tokenizer": len(mine),
                                   "prepare": source["tokens"]})
            at += source["tokens"]
        group.clear()

    for source in sources:
        path = Path(source["file"])
        if path.suffix == ".jsonl":
            docs = [json.loads(line)["text"] for line in open(path, encoding="utf-8")
                    if line.strip()]
        else:
            docs = [path.read_text(encoding="utf-8")]
        group.append((source, docs))
        if sum(len(d) for _, ds in group for d in ds) > 8 * MB:  # both cores, bounded memory
            flush()
    flush()
    return {"sources_checked": len(sources), "tokens_checked": checked,
            "tokens_in_index": index["tokens"], "all_ids_equal": not mismatched and
            checked == index["tokens"] == len(ids), "mismatched": mismatched,
            "seconds": round(time.perf_counter() - start, 1)}


def measure_prepare(corpus: Path, tok_dir: Path, out: Path, files: list[str] | None = None
                    ) -> dict:
    files = files or sorted(str(p) for p in corpus.iterdir())
    r = run(tensorpar("prepare", *files, "--tokenizer", str(tok_dir), "--out", str(out)),
            threads=True)
    line = next(x for x in r["stderr"].splitlines() if x.startswith("tensorpar prepare: wrote"))
    index = json.loads((out / "index.json").read_text())
    nbytes = sum(Path(f).stat().st_size for f in files)
    return {"command": r["command"].replace(str(ROOT) + "/", ""), "line": line,
            "documents": index["documents"], "tokens": index["tokens"],
            "shard_bytes": sum((out / s["file"]).stat().st_size for s in index["shards"]),
            "input_bytes": nbytes, "bytes_per_token": round(nbytes / index["tokens"], 3),
            "prepare_seconds": index["seconds"], "tokens_per_second": index["tokens_per_second"],
            "mb_per_second": round(nbytes / MB / max(index["seconds"], 1e-3), 3),
            "command_wall_s": r["wall_s"], "command_cpu_s": r["cpu_s"],
            "cores_used": round(r["cpu_s"] / r["wall_s"], 2),
            "thread_cpu_s": r["thread_cpu_s"], "load_average_1min": r["load_average_1min"]}


def net_of_startup(run: dict, startup: dict) -> float:
    """CPU time over wall time of a prepare command, less a one-line file's prepare (interpreter
    start, imports, the tokenizer's load: on one core) from both."""
    return round((run["command_cpu_s"] - startup["command_cpu_s"])
                 / (run["command_wall_s"] - startup["command_wall_s"]), 2)


# --- 2. a large folder, resident memory and start-up --------------------------------------------

def make_big(small: Path, big: Path, gib: float, one_file: bool = False) -> dict:
    """``gib`` GiB of copies of the small folder's shards: a file each, or (``one_file``) all in
    one file."""
    index = json.loads((small / "index.json").read_text())
    files = [small / s["file"] for s in index["shards"]]
    per_copy = sum(f.stat().st_size for f in files)
    copies = math.ceil(gib * (1 << 30) / per_copy)
    big.mkdir()
    shards = []
    for _ in range(copies):
        for f, s in zip(files, index["shards"], strict=True):
            if one_file:
                if not shards:
                    shards.append({"file": "tokens-00000.bin", "tokens": 0})
                with open(f, "rb") as src, open(big / shards[0]["file"], "ab") as dst:
                    shutil.copyfileobj(src, dst)
                shards[0]["tokens"] += s["tokens"]
                continue
            name = f"tokens-{len(shards):05d}.bin"
            shutil.copyfile(f, big / name)
            shards.append({"file": name, "tokens": s["tokens"]})
    shutil.copytree(small / "tokenizer", big / "tokenizer")
    tokens = sum(s["tokens"] for s in shards)
    made = {k: index[k] for k in ("format", "version", "dtype", "tokenizer")} | {
        "documents": index["documents"] * copies, "tokens": tokens,
        # any 64 hex digits are accepted; this one names what the folder repeats
        "sha256": hashlib.sha256(f"{index['sha256']} x {copies}".encode()).hexdigest(),
        "shards": shards, "sources": []}
    (big / "index.json").write_text(json.dumps(made, indent=1) + "\n")
    return {"copies": copies, "shard_files": len(shards), "tokens": tokens,
            "bytes": sum((big / s["file"]).stat().st_size for s in shards)}


def evict(folder: Path) -> None:
    """The folder's shard files out of the page cache (these files only)."""
    for path in folder.glob("tokens-*.bin"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_peaks(stdout: str) -> list[int]:
    """Each rank's "resident peak" from the summary table, in bytes."""
    found = re.findall(r"rank (\d+)[^\n]*?resident peak ([\d.]+) (B|KiB|MiB|GiB)", stdout)
    return [round(float(v) * UNITS[u]) for _, v, u in sorted(found, key=lambda x: int(x[0]))]


def train(data: Path, out: Path, args: list[str], cold: bool) -> dict:
    if cold:
        evict(data)
    metrics = out / "metrics.jsonl"
    r = run(tensorpar("train", "--data", str(data), "--out", str(out), *args), metrics)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    peaks = resident_peaks(r["stdout"])
    if not peaks:
        sys.exit(f"no resident peak in the summary:\n{r['stdout']}")
    return {"command": r["command"].replace(str(ROOT) + "/", ""), "rows": rows,
            "resident_peak_bytes": peaks, "wall_s": r["wall_s"], "first_row_s": r["first_row_s"],
            # the command's start to the first step's start
            "before_first_step_s": round(r["first_row_s"] - rows[0]["step_time_s"], 3),
            "load_average_1min": r["load_average_1min"]}


def memory_runs(folders: dict[str, Path], runs: Path, repeats: int, cold: bool) -> dict:
    out: dict[str, list] = {name: [] for name in folders}
    for i in range(repeats):
        for name, data in folders.items():
            r = train(data, runs / f"mem-{name}-{i}", ["--tp", "1", "--steps", "5", "--seq-len",
                                                          "256", "--batch-size", "8",
                                                          *SMALL_MODEL], cold)
            rows = r.pop("rows")
            r["data_s"] = [row["data_s"] for row in rows]
            r["step_time_s"] = [row["step_time_s"] for row in rows]
            out[name].append(r)
            print(f"  {name} run {i + 1}: resident peak "
                  f"{r['resident_peak_bytes'][0] / (1 << 20):.1f} MiB, first row at "
                  f"{r['first_row_s']:.2f} s, done at {r['wall_s']:.2f} s", flush=True)
    return out


# --- 3. the data wait of the default GPT ----------------------------------------------------------

def batch_reads(folder: str, mode: str, batches: int = 60) -> dict:
    """In this process: ``batches`` batches of the trainer's ``TokenBatches`` over ``folder``
    (mode cold, cold-normal or warm); milliseconds per batch, and the page cache's growth."""
    import mmap

    from tensorpar.data.packing import TokenBatches
    from tensorpar.data.shards import TokenShards

    def cached_mib() -> float:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines()
                    if x.startswith("Cached:"))
        return int(line.split()[1]) / 1024

    if mode != "warm":
        evict(Path(folder))
    before = cached_mib()
    shards = TokenShards(folder)
    if mode == "cold-normal":  # the kernel's read-around again, as before the trainer advised
        for m in shards.maps:
            m.base.obj.madvise(mmap.MADV_NORMAL)  # the array, a memoryview, the mmap
    start = time.perf_counter()
    reader = TokenBatches(shards, 256, 8, 0, digest=shards.digest)
    ms = []
    for step in range(batches):
        t = time.perf_counter()
        reader.batch(step)
        ms.append((time.perf_counter() - t) * 1e3)
    return {"mode": mode, "batches": batches, "first_ms": round(ms[0], 2),
            "median_ms": round(statistics.median(ms), 3),
            "median_ms_2_to_30": round(statistics.median(ms[1:30]), 3),
            "median_ms_31_on": round(statistics.median(ms[30:]), 3) if batches > 31 else None,
            "total_s": round(time.perf_counter() - start, 3),
            "page_cache_growth_mib": round(cached_mib() - before, 1)}


def reads(folder: Path) -> list[dict]:
    out = []
    for mode in ("cold", "cold-normal", "warm"):
        r = run([sys.executable, str(Path(__file__).resolve()), "--batch-reads", str(folder),
                 mode])
        out.append(json.loads(r["stdout"]) | {"load_average_1min": r["load_average_1min"]})
        print(f"  reads {out[-1]}", flush=True)
    return out


def wait_run(data: Path, out: Path, steps: int, cold: bool) -> dict:
    r = train(data, out, ["--tp", "2", "--seq-len", "256", "--batch-size", "8", "--steps",
                          str(steps)], cold)
    rows = r.pop("rows")
    data_s = [row["data_s"] for row in rows]
    step_s = [row["step_time_s"] for row in rows]
    return r | {
        "steps": len(rows), "median_data_s": statistics.median(data_s),
        "median_step_time_s": statistics.median(step_s),
        "data_share": sum(data_s) / sum(step_s),
        "data_share_after_step_1": sum(data_s[1:]) / sum(step_s[1:]),
        "first_step_data_s": data_s[0], "max_data_s": max(data_s),
        "median_tokens_per_s": statistics.median(row["tokens_per_s"] for row in rows[1:]),
        "data_s": data_s, "step_time_s": step_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/data-pipeline.json",
                   help="the JSON of results")
    p.add_argument("--work", help="scratch folder (default: a temporary one, removed at the end)")
    p.add_argument("--corpus-mb", type=float, default=50.0)
    p.add_argument("--files", type=int, default=20, help="text files of the corpus")
    p.add_argument("--vocab", type=int, default=8192, help="the BPE tokenizer's vocabulary")
    p.add_argument("--big-gib", type=float, default=1.0, help="the large shard folder's size")
    p.add_argument("--big-shard", action="store_true",
                   help="the large folder in one file, not copies of the 50 MB shard")
    p.add_argument("--repeats", type=int, default=3, help="memory runs per folder")
    p.add_argument("--steps", type=int, default=30, help="steps of the data-wait run")
    p.add_argument("--no-check", action="store_true", help="skip the count check")
    p.add_argument("--warm", action="store_true", help="leave the page cache as it is")
    p.add_argument("--seed", type=int, default=0, help="the corpus generator's seed")
    p.add_argument("--batch-reads", nargs=2, metavar=("FOLDER", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.batch_reads:  # one measurement of 4., in its own process
        print(json.dumps(batch_reads(*args.batch_reads)))
        return
    began = time.perf_counter()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="tensorpar-data-"))
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        sys.exit(f"--work {work} is not empty")
    try:
        result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "command": " ".join(["python", "benchmarks/data_pipeline.py", *sys.argv[1:]]),
                  "machine": machine() | {"read_ahead_kb": read_ahead_kb(work)},
                  "work": str(work), "cold_page_cache": not args.warm}
        print(f"machine: {result['machine']}", flush=True)
        tok_dir = work / "tokenizer"
        result["tokenizer"] = {"vocab_size": args.vocab,
                               "train_seconds": round(make_tokenizer(tok_dir, args.vocab), 2)}
        print(f"tokenizer: {result['tokenizer']}", flush=True)
        result["corpus"] = make_corpus(work / "corpus", args.corpus_mb, args.files, args.seed)
        print(f"corpus: {result['corpus']}", flush=True)

        small = work / "shards-50mb"
        result["prepare"] = measure_prepare(work / "corpus", tok_dir, small)
        print(f"prepare: {result['prepare']}", flush=True)
        # start-up alone: a one-line file
        (work / "one-line.jsonl").write_text(json.dumps({"text": "One line."}) + "\n")
        startup = measure_prepare(work / "corpus", tok_dir, work / "shards-startup",
                                  [str(work / "one-line.jsonl")])
        result["prepare"]["cores_used_net_of_startup"] = net_of_startup(result["prepare"],
                                                                        startup)
        # each kind of input alone: a text file is one document, a JSON-lines file many; and
        # one text file (4.5 MB) alone
        for kind, pattern in (("text_files_alone", "*.txt"), ("jsonl_alone", "*.jsonl"),
                              ("one_text_file_alone", "part-04.txt"),
                              ("startup_one_line", None)):
            part = startup if pattern is None else measure_prepare(
                work / "corpus", tok_dir, work / f"shards-{kind}",
                sorted(str(p) for p in (work / "corpus").glob(pattern)))
            result["prepare"][kind] = {k: part[k] for k in (
                "documents", "tokens", "input_bytes", "prepare_seconds", "tokens_per_second",
                "mb_per_second", "command_wall_s", "command_cpu_s", "cores_used",
                "thread_cpu_s", "load_average_1min")}
            if pattern is not None:
                result["prepare"][kind]["cores_used_net_of_startup"] = net_of_startup(
                    part, startup)
            print(f"  {kind}: {result['prepare'][kind]}", flush=True)
        if not args.no_check:
            result["check"] = check_counts(work / "corpus", small, tok_dir)
            print(f"check: {result['check']}", flush=True)

        big = work / "shards-1gb"
        result["big_folder"] = make_big(small, big, args.big_gib, args.big_shard)
        print(f"big folder: {result['big_folder']}", flush=True)
        runs = work / "runs"
        result["memory"] = memory_runs({"50mb": small, "1gb": big}, runs, args.repeats,
                                       not args.warm)
        result["data_wait"] = {}
        for name, cold in (("cold", not args.warm), ("warm", False)):
            w = result["data_wait"][name] = wait_run(big, runs / f"wait-{name}", args.steps,
                                                     cold)
            print(f"data wait, {name}: median data_s {w['median_data_s'] * 1e3:.2f} ms, median "
                  f"step {w['median_step_time_s'] * 1e3:.1f} ms, share {w['data_share']:.3%} "
                  f"({w['data_share_after_step_1']:.3%} after step 1), first step's "
                  f"{w['first_step_data_s'] * 1e3:.1f} ms; resident peaks "
                  f"{[round(b / (1 << 20), 1) for b in w['resident_peak_bytes']]} MiB; first "
                  f"row at {w['first_row_s']:.1f} s, done at {w['wall_s']:.1f} s", flush=True)
        result["batch_reads"] = reads(big)
        result["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        result["total_wall_s"] = round(time.perf_counter() - began, 1)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out} ({result['total_wall_s']:.0f} s in all)")
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
