"""What readers.Mix checks of its sources before any batch: the sources, the weights, one kind
of sample, labels that merge by name (or by the user's mapping) and never collide silently,
and each source's fingerprint, against which a saved state is checked (docs/mixing.md)."""
from __future__ import annotations

import json
import math
import zlib

import numpy as np
import torch.utils.data

from .sampler import dataset_fingerprint, reader_of

UNLABELED = -1  # packer's label of an unlabeled sample


def sample_kind(image) -> str:
    """What kind of image a sample holds, as a collate sees it: raw bytes, a PIL image, or
    an array or tensor of a dtype."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return "raw bytes"
    if isinstance(image, torch.Tensor):
        return f"tensor of {image.dtype}"
    if isinstance(image, np.ndarray):
        return f"numpy array of {image.dtype}"
    return "PIL image" if type(image).__module__.startswith("PIL") else type(image).__name__


def source_fingerprint(dataset) -> str:
    """What a state must have been saved over, for one source: its size, classes and storage
    order, and for packer data its tables' checksums (which cover every record's bytes), so a
    pack replaced on disk by other data differs, and a copy of it elsewhere does not."""
    reader = reader_of(dataset)
    name = dataset_fingerprint(dataset)
    sums = reader.table_checksums() if hasattr(reader, "table_checksums") else None
    if sums:
        return f"{name}, tables crc32 {zlib.crc32(json.dumps(sums, sort_keys=True).encode()):08x}"
    created = getattr(getattr(reader, "metadata", None), "created", "")
    return f"{name}, packed {created}" if created else name


def is_labeled(dataset) -> bool:
    """Whether a source's samples carry class labels: a class list, and for packer data a split packed labeled."""
    reader = reader_of(dataset) or getattr(dataset, "reader", None)
    splits = getattr(getattr(reader, "metadata", None), "splits", None)
    if splits is not None and getattr(reader, "split", None) in splits:
        return bool(splits[reader.split].labeled) and bool(getattr(dataset, "classes", None))
    return bool(getattr(dataset, "classes", None))


def checked_sources(sources) -> tuple[list[str], list]:
    if not isinstance(sources, dict) or not sources:
        raise ValueError(f"Mix: sources must be a non-empty dict {{name: dataset}}, got {sources!r}")
    for name, dataset in sources.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"Mix: source names must be non-empty strings, got {name!r}")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
            raise ValueError(f"Mix: source {name!r} ({type(dataset).__name__}) is not a map-style dataset; a mixture "
                             "draws samples by index: for WebDataset shards use readers.WDSMapDataset over the same "
                             "folder or URL")
        try:
            size = len(dataset)
        except TypeError as exc:
            raise ValueError(f"Mix: source {name!r} ({type(dataset).__name__}) has no length") from exc
        if size == 0:
            raise ValueError(f"Mix: source {name!r} is empty (0 samples); drop it from the mixture, or check the "
                             "path and split it was opened with")
    return list(sources), list(sources.values())


def checked_weights(weights, names: list[str], lengths: np.ndarray) -> tuple[float, ...]:
    """The weights normalised to sum to 1, in the order of names."""
    if weights is None:
        return tuple(float(n) / float(lengths.sum()) for n in lengths)
    if not isinstance(weights, dict):
        raise ValueError(f"Mix: weights must be a dict {{source name: weight}}, got {type(weights).__name__}")
    unknown = [k for k in weights if k not in names]
    if unknown:
        raise ValueError(f"Mix: weights name unknown source(s) {', '.join(map(repr, unknown))}; the sources are "
                         f"{', '.join(map(repr, names))}")
    missing = [n for n in names if n not in weights]
    if missing:
        raise ValueError(f"Mix: no weight for source(s) {', '.join(map(repr, missing))}; give every source a weight "
                         "(0 leaves one out of the draws)")
    for name in names:
        value = weights[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"Mix: the weight of source {name!r} must be a finite number >= 0, got {value!r}")
    total = float(sum(weights[n] for n in names))
    if total <= 0:
        raise ValueError(f"Mix: every weight is 0 ({', '.join(names)}); give at least one source a weight > 0")
    return tuple(float(weights[n]) / total for n in names)


def checked_kind(names: list[str], sources: list) -> str:
    """The one kind of image every source yields (its first sample read to see), or a
    ValueError naming the sources that differ: a batch cannot mix raw bytes and images."""
    kinds = {}
    for name, dataset in zip(names, sources):
        sample = dataset[0]
        if not isinstance(sample, (tuple, list)) or len(sample) != 2:
            raise ValueError(f"Mix: source {name!r} yields {type(sample).__name__} samples; a mixture takes "
                             "(image, label) pairs")
        kinds[name] = sample_kind(sample[0])
    if len(set(kinds.values())) > 1:
        said = ", ".join(f"{n!r} gives {k}" for n, k in kinds.items())
        raise ValueError(f"Mix: the sources' samples differ in kind ({said}); open every source with the same decode= "
                         "and transform, so one batch holds one kind")
    return next(iter(kinds.values()))


def merged_labels(names: list[str], sources: list, class_to_idx, unlabeled) -> tuple[list, dict, list]:
    """(classes, class_to_idx, per source an array from its labels to the merged ones or None
    for a source mixed unlabeled)."""
    unlabeled = {unlabeled} if isinstance(unlabeled, str) else set(unlabeled)
    unknown = unlabeled - set(names)
    if unknown:
        raise ValueError(f"Mix: unlabeled names unknown source(s) {', '.join(map(repr, sorted(unknown)))}; the "
                         f"sources are {', '.join(map(repr, names))}")
    labeled = {n: is_labeled(ds) for n, ds in zip(names, sources)}
    if any(labeled.values()):
        silent = [n for n in names if not labeled[n] and n not in unlabeled]
        if silent:
            have = [n for n in names if labeled[n]]
            raise ValueError(f"Mix: source(s) {', '.join(map(repr, silent))} have no labels and "
                             f"{', '.join(map(repr, have))} do: pass unlabeled=({', '.join(map(repr, silent))},) to "
                             "mix their samples with label -1, or give them labels")
    kept = [(n, ds) for n, ds in zip(names, sources) if labeled[n] and n not in unlabeled]
    if class_to_idx is None:
        class_to_idx = {}
        for _, ds in kept:
            for c in ds.classes:
                class_to_idx.setdefault(c, len(class_to_idx))
    classes = checked_mapping(class_to_idx)
    maps = []
    for name, ds in zip(names, sources):
        if not labeled[name] or name in unlabeled:
            maps.append(None)
            continue
        missing = [c for c in ds.classes if c not in class_to_idx]
        if missing:
            raise ValueError(f"Mix: class_to_idx has no label for class(es) {', '.join(map(repr, missing[:5]))} of "
                             f"source {name!r}; add them, or pass unlabeled=({name!r},)")
        maps.append(np.array([class_to_idx[c] for c in ds.classes], dtype=np.int64))
    return classes, dict(class_to_idx), maps


def checked_mapping(class_to_idx) -> list[str]:
    """The class list of a {name: label} mapping: labels 0..K-1 each used (names may share one)."""
    if not isinstance(class_to_idx, dict):
        raise ValueError(f"Mix: class_to_idx must be a dict {{class name: label}}, got {type(class_to_idx).__name__}")
    classes: dict[int, str] = {}
    for name, label in class_to_idx.items():
        if not isinstance(name, str) or isinstance(label, bool) or not isinstance(label, int) or label < 0:
            raise ValueError(f"Mix: class_to_idx maps class names to labels >= 0, got {name!r}: {label!r}")
        classes.setdefault(label, name)
    missing = sorted(set(range(max(classes, default=-1) + 1)) - set(classes))
    if missing:
        raise ValueError(f"Mix: class_to_idx's labels must be 0..K-1 with none unused; {missing[:5]} unused")
    return [classes[k] for k in range(len(classes))]
