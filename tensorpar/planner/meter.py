"""Per-rank memory meter: bytes of tensor storage alive at entry and at the peak, CPU or CUDA.

::

    with MemoryMeter("cpu") as mem:
        loss = model(ids, targets); loss.backward(); opt.step()
    mem.entry_bytes  # weights, grads, optimizer states, ... alive when the block began
    mem.peak_bytes   # the most alive at any moment inside it, entry_bytes included

What it counts: the storage bytes of every tensor on the meter's device (``untyped_storage()
.nbytes()``), each storage once however many tensors view it.

- CUDA: the caching allocator's own statistics, ``torch.cuda.memory_allocated`` at entry and
  ``max_memory_allocated`` (its peak is reset at entry), so it sees every allocation, inside
  kernels too, rounded to the allocator's 512-byte blocks.
- CPU: torch keeps no allocator statistics, so the meter tracks storages itself. At entry it
  scans the live tensors once (``gc``, plus each one's ``.grad``, which autograd holds in C++);
  inside the block a ``TorchDispatchMode`` sees the output of every aten op (in forward, in the
  autograd engine's backward, in the optimizer step) and a weakref on each new storage subtracts
  its bytes when it is freed. Torch keeps one Python object per storage while the storage lives,
  so a weakref fires exactly when the memory is released. FSDP2 frees and re-allocates its
  unsharded parameters in place (``untyped_storage().resize_``), which no dispatched op shows;
  it does so inside its ``record_function`` regions, whose enter and exit ops are dispatched, so
  at each of those the meter reads again the size of every storage it tracks (without this it
  would count each resharded block as alive until an op touched it again: a TP=2 x DP=2 step of
  a 3-block GPT read 37% over its peak).

What it does not count: fake tensors, which hold no memory (torch.compile keeps thousands of them
alive in its caches: each reports the bytes of a real one, on the device it stands for), the
allocator's slack (CUDA's reserved-but-free cache and rounding,
the CPU allocator's and the OS's page overhead), non-tensor memory (Python objects, the autograd
graph's nodes, communication buffers inside gloo/NCCL, CUDA context, kernels' workspaces). On CPU
also: scratch memory a single kernel allocates and frees before it returns (oneDNN's or the CPU
flash-attention kernel's per-thread buffers), and tensors alive at entry that no Python object
reaches (saved activations of a graph built before the block) until an op returns a view of them.
The peak is sampled at op boundaries: after each op returns, with its inputs still alive.

``profiled=True`` (CPU): the block runs under ``torch.profiler`` with ``profile_memory`` instead,
and the peak is read off the allocator's events: every allocation and free of torch's CPU
allocator inside the block, in order, each free matched by address to an allocation of the block
(the entry scan is the same). No TorchDispatchMode is active, so ``torch.compile``d code runs
compiled and its own buffers are counted (a TorchDispatchMode makes dynamo run the model eagerly:
``gpt/speedups.loss_function``); kernels' scratch buffers that go through the allocator are
counted too. The profiler sees one thread, the one that entered the block:
- it reads high where memory is freed unseen: a storage from before the block (its free is
  ignored) and, at TP > 1, a buffer of an asynchronous collective whose last reference gloo's
  thread drops (the overlapped input-gradient all-reduces; let go when its address is allocated
  again, else never). An eager GPT step reads the dispatch meter's peak to the byte at TP=1, and
  up to about three activations (B·T·D floats each) above it at TP=2 and 3
  (``tests/planner/test_meter_profiled.py``);
- it reads low by what other threads allocate: none of tensorpar's steps allocate there (gloo's
  threads work in the tensors they are given), but a user's own threads would.
One profiler at a time: inside a running ``torch.profiler`` it is refused. libkineto logs each
profiler start and stop to stderr unless ``KINETO_LOG_LEVEL`` is 6 or more (the bench sets it).
"""

from __future__ import annotations

import gc
import threading
import weakref

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

# the ops that open and close a ``record_function`` region: where FSDP2 resizes storages
_REGION_OPS = tuple(getattr(torch.ops.profiler, name) for name in (
    "_record_function_enter", "_record_function_enter_new", "_record_function_exit")
    if hasattr(torch.ops.profiler, name))


class _StorageTracker(TorchDispatchMode):
    """Counts the live bytes of the storages on one device type; keeps their running peak."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted for it
        self._refs: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()
        self._closed = False

    def add(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage if it is new (or has grown, as ``resize_`` and ``out=`` do)."""
        if is_traceable_wrapper_subclass(t):  # a DTensor: only its local tensor holds memory
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name, None)
                if isinstance(inner, torch.Tensor):
                    self.add(inner)
            return
        if t.device.type != self.device_type or t.is_meta or is_fake(t):
            return
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse and other storage-less tensors
            return
        nbytes = storage.nbytes()
        key = id(storage)
        with self._lock:
            old = self._sizes.get(key)
            if old is None:  # tracked even if empty: FSDP2 resizes its storages in place
                self._refs[key] = weakref.ref(storage, self._freed_callback(key))
            elif old == nbytes:
                return
            self._sizes[key] = nbytes
            self.live_bytes += nbytes - (old or 0)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def resync(self) -> None:
        """Read again the size of every tracked storage: ``resize_`` on a storage (FSDP2's
        free and re-allocation of unsharded parameters) goes through no dispatched op."""
        with self._lock:
            refs = list(self._refs.items())
        # strong references, read and dropped outside the lock: a storage that dies meanwhile
        # runs its callback, which takes the lock, in whatever thread lets it go
        alive = [(key, ref, ref()) for key, ref in refs]
        with self._lock:
            for key, ref, storage in alive:
                if storage is None or self._refs.get(key) is not ref:
                    continue
                nbytes, old = storage.nbytes(), self._sizes[key]
                if nbytes != old:
                    self._sizes[key] = nbytes
                    self.live_bytes += nbytes - old
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _freed_callback(self, key: int):
        def freed(_ref):
            with self._lock:
                if self._closed:
                    return
                self.live_bytes -= self._sizes.pop(key, 0)
                self._refs.pop(key, None)
        return freed

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._sizes.clear()
            self._refs.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, torch.Tensor) and t is not torch.Tensor and
               hasattr(t, "__tensor_flatten__") for t in types):
            # let a wrapper subclass (DTensor) run its op: the local ops it issues come back
            # here, so its allocations, inside its dispatch too, are seen
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if getattr(func, "_overloadpacket", None) in _REGION_OPS:
            self.resync()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out


def _live_tensors():
    """Every tensor a Python object reaches, and the gradients autograd holds for them."""
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter reads __class__, which some objects make warn
        if not issubclass(type(obj), torch.Tensor):
            continue
        yield obj
        if obj.is_leaf:  # .grad of a non-leaf is never kept (and reading it warns)
            grad = obj.grad
            if isinstance(grad, torch.Tensor):
                yield grad


def _peak_of_allocations(results) -> int:
    """The most bytes allocated inside a profiled block and alive at once: torch's CPU allocator's
    events in time order, each free matched by its address to an allocation of the block (a free
    of anything allocated before is ignored, as is the size c10 reports with it: its table of
    sizes may be stale). An address allocated again before its free was seen was freed in
    between, where the profiler did not look; its bytes are let go then, late but never early."""
    from torch._C._profiler import _EventType

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    events = sorted(((n.start_time_ns, n.extra_fields) for n in
                     walk(results.experimental_event_tree()) if n.tag == _EventType.Allocation
                     and n.extra_fields.device.type == "cpu"), key=lambda event: event[0])
    sizes: dict[int, int] = {}  # address -> bytes, of the block's allocations still alive
    live = peak = 0
    for _, event in events:
        live -= sizes.pop(event.ptr, 0)  # freed now, or (allocated again) freed unseen before
        if event.alloc_size > 0:
            sizes[event.ptr] = event.alloc_size
            live += event.alloc_size
            peak = max(peak, live)
    return peak


class MemoryMeter:
    """Context manager measuring this process's tensor memory on ``device`` (None: CPU).

    After (or inside) the block: ``entry_bytes``, the storage alive when it began, and
    ``peak_bytes``, the most alive at any moment inside it, ``entry_bytes`` included. See the
    module docstring for what is and is not counted.
    """

    def __init__(self, device: torch.device | str | None = None, profiled: bool = False):
        self.device = torch.device(device if device is not None else "cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.profiled = profiled and self.device.type == "cpu"  # CUDA: the allocator's stats
        self.entry_bytes = 0
        self._peak = 0
        self._tracker: _StorageTracker | None = None
        self._profiler: torch.profiler.profile | None = None

    @property
    def peak_bytes(self) -> int:
        if self._tracker is not None:  # inside the block: the running peak
            return self._tracker.peak_bytes
        if self.device.type == "cuda" and self._peak < 0:
            return torch.cuda.max_memory_allocated(self.device)
        return self._peak

    def __enter__(self) -> MemoryMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.entry_bytes = torch.cuda.memory_allocated(self.device)
            self._peak = -1  # read from the allocator until exit
            return self
        tracker = _StorageTracker(self.device.type)
        # what is already garbage is not alive: collected until a pass frees nothing, since
        # some garbage (dynamo's traced graphs and the autograd nodes of their Functions) is
        # only freed a layer at a time, one pass each
        for _ in range(16):
            if not gc.collect():
                break
        for t in _live_tensors():
            tracker.add(t)
        tracker.peak_bytes = tracker.live_bytes
        self.entry_bytes = self._peak = tracker.live_bytes
        if self.profiled:  # the scan gave the entry; the allocator's events give the rest
            tracker.close()
            if torch._C._autograd._profiler_enabled():
                raise RuntimeError("MemoryMeter(profiled=True) inside a running torch.profiler: "
                                   "its profile reads the memory; one profiler at a time")
            self._profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
            return self
        tracker.__enter__()
        self._tracker = tracker
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._peak = torch.cuda.max_memory_allocated(self.device)
            return
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.__exit__(*exc)
            self._peak = self.entry_bytes + _peak_of_allocations(profiler.profiler.kineto_results)
            return
        tracker, self._tracker = self._tracker, None
        tracker.__exit__(*exc)
        self._peak = tracker.peak_bytes
        tracker.close()
