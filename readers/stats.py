"""LoaderStats: how long the training loop waits for data versus how long a step takes.

Wraps any iterable of batches. The time spent inside next() is data wait; the time from
handing a batch out to being asked for the next one is the step. CUDA kernels run
asynchronously, so a step's host time is only its launch time until the host blocks
(on .item(), a full launch queue, an allocator sync); over a window of steps the totals
are right. sync_cuda=True synchronises before each timestamp for exact figures, at a
cost.
"""
from __future__ import annotations

import collections
import time
import warnings


class LoaderWarning(UserWarning):
    """The training loop keeps waiting for data."""


def batch_samples(batch) -> int:
    """Samples in a batch: the length of its first tensor-like leaf."""
    while isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    if isinstance(batch, dict) and batch:
        return batch_samples(next(iter(batch.values())))
    shape = getattr(batch, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    return len(batch) if hasattr(batch, "__len__") else 1


class LoaderStats:
    """Iterate `loader` through this to time data waits and steps.

    Args:
        threshold: warn (LoaderWarning, once per epoch) when the data wait is more than
            this fraction of the wall time over a whole window of steps.
        window: steps per judgement; warmup: first steps of each epoch left out
            (worker start-up, cudnn autotuning).
    """

    def __init__(self, loader, *, threshold: float = 0.1, window: int = 50, warmup: int = 5,
                 sync_cuda: bool = False, clock=time.perf_counter):
        if not 0 < threshold < 1:
            raise ValueError(f"LoaderStats: threshold is a fraction of wall time in (0, 1), got {threshold}")
        if window < 1 or warmup < 0:
            raise ValueError(f"LoaderStats: window must be >= 1 and warmup >= 0, got {window}, {warmup}")
        self.loader = loader
        self.threshold = threshold
        self.window = window
        self.warmup = warmup
        self.sync_cuda = sync_cuda
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.samples = 0
        self.wait_s = 0.0
        self.step_s = 0.0
        self.warned = False
        self._recent: collections.deque = collections.deque(maxlen=self.window)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        # dataset, batch_size, set_epoch, ... of the wrapped loader
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def _now(self) -> float:
        if self.sync_cuda:
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
        return self.clock()

    def __iter__(self):
        self.reset()
        iterator = iter(self.loader)
        handed_out = None
        while True:
            asked = self._now()
            try:
                batch = next(iterator)
            except StopIteration:
                if handed_out is not None:
                    self._record(handed_out[0], asked - handed_out[1], handed_out[2])
                return
            got = self.clock()
            if handed_out is not None:
                self._record(handed_out[0], asked - handed_out[1], handed_out[2])
            handed_out = (got - asked, got, batch_samples(batch))
            yield batch

    def _record(self, wait: float, step: float, samples: int) -> None:
        self.steps += 1
        if self.steps <= self.warmup:
            return
        self.samples += samples
        self.wait_s += wait
        self.step_s += step
        self._recent.append((wait, step))
        if not self.warned and len(self._recent) == self.window:
            wait_sum = sum(w for w, _ in self._recent)
            total = wait_sum + sum(s for _, s in self._recent)
            if total > 0 and wait_sum / total > self.threshold:
                self.warned = True
                warnings.warn(self._advice(wait_sum / total, wait_sum / self.window, total / self.window),
                              LoaderWarning, stacklevel=3)

    def _advice(self, fraction: float, wait: float, per_step: float) -> str:
        workers = getattr(self.loader, "num_workers", None)
        workers = workers if workers is not None else getattr(getattr(self.loader, "loader", None), "num_workers", "?")
        return (f"the training loop waited for data {fraction:.0%} of the time over the last {self.window} "
                f"steps ({wait * 1e3:.1f} ms of each {per_step * 1e3:.1f} ms step): the GPU is waiting for data. "
                f"Try more workers (now {workers}), a packed format (readers.LMDBDataset) instead of a folder, "
                f"decode-aware uint8 transforms (decode='raw' with readers.RandomResizedCrop), normalising on the "
                f"GPU (readers.CUDAPrefetcher), or a smaller input size; readers.diagnose(loader, step) measures which")

    def summary(self) -> dict:
        """Figures of the current (or last) epoch, warm-up steps left out. An epoch no longer
        than the warm-up measures nothing: its figures are zeros and "note" says why."""
        total = self.wait_s + self.step_s
        note = {}
        if self.steps <= self.warmup:
            note = {"note": f"nothing measured: this epoch ran {self.steps} step(s), all within the first "
                            f"warmup={self.warmup} left out; run more steps, or LoaderStats(loader, warmup=0) "
                            f"(make_loader(..., stats=dict(warmup=0)))"}
        return {
            "steps": self.steps,
            "measured_steps": max(0, self.steps - self.warmup),
            "samples": self.samples,
            "wait_s": self.wait_s,
            "step_s": self.step_s,
            "wait_fraction": self.wait_s / total if total else 0.0,
            "samples_per_s": self.samples / total if total else 0.0,
            **note,
        }

    def __repr__(self) -> str:
        s = self.summary()
        if "note" in s:
            return f"LoaderStats(steps={s['steps']}, {s['note']})"
        return (f"LoaderStats(steps={s['steps']}, wait={s['wait_fraction']:.1%}, "
                f"samples/s={s['samples_per_s']:.1f})")
