"""webdataset's indexed reader (wids) reads packer's shards through the per-split wids index.

wids is webdataset's indexed reader, installed by the `bench` extra (it shipped inside webdataset
0.2.x and is a package of its own since 1.x): where it does not import, these tests skip saying so.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from packer import pack
from packer.formats import _tar


def packed_sample(imagenet_sample: Path, out: Path) -> Path:
    pack(str(imagenet_sample), "wds", str(out), workers=1, progress=False)
    return out


def shard_samples(out: Path, split: str = "all") -> list:
    """(key, image bytes, label, relative path) of every sample, in the order the shards hold them."""
    index = json.loads((out / "index.json").read_text())
    samples = []
    for shard in index["wds"]["splits"][split]["shards"]:
        for sample in _tar.iter_samples(str(out / shard["name"])):
            meta = json.loads(sample.parts["json"])
            samples.append((sample.key, sample.parts["jpg"], int(sample.parts["cls"]), meta["path"]))
    return samples


def test_wids_index_lists_the_shards_relative_to_itself(imagenet_sample, tmp_path):
    out = packed_sample(imagenet_sample, tmp_path / "s.wds")
    index = json.loads((out / "index.json").read_text())
    entry = index["wds"]["splits"]["all"]
    described = json.loads((out / entry["wids_index"]).read_text())
    assert described["wids_version"] == 1 and described["classes"] == index["classes"]
    assert described["shardlist"] == [{"url": Path(s["name"]).name, "nsamples": s["count"]} for s in entry["shards"]]
    assert sum(s["nsamples"] for s in described["shardlist"]) == 125


def test_wids_reads_packer_shards_record_for_record(imagenet_sample, tmp_path, monkeypatch):
    try:
        import wids
    except ImportError as exc:
        pytest.skip(f"wids is not installed ({exc}); install packer[bench] or `pip install wids`")
    monkeypatch.setenv("WIDS_CACHE", str(tmp_path / "wids-cache"))
    out = packed_sample(imagenet_sample, tmp_path / "s.wds")
    expected = shard_samples(out)
    raw = wids.ShardListDataset(str(out / "all" / "wids-index.json"), transformations=[])
    assert len(raw) == len(expected) == 125
    assert raw.spec["classes"] == json.loads((out / "index.json").read_text())["classes"]
    for i, (key, image, label, relpath) in enumerate(expected):
        sample = raw[i]
        assert sample["__key__"] == key
        assert sample[".jpg"].read() == image
        assert int(sample[".cls"].read()) == label
        assert json.loads(sample[".json"].read())["path"] == relpath
    decoded = wids.ShardListDataset(str(out / "all" / "wids-index.json"))  # its default decoder: PIL, cls as int
    first = decoded[0]
    assert first[".cls"] == expected[0][2] and first[".jpg"].size[0] > 0
