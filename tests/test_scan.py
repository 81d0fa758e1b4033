import os

import pytest

from packer.errors import SourceError
from packer.scan import DEFAULT_SPLIT, scan_source

from conftest import jpeg_bytes, torchvision_samples, write


def listing(source, split=DEFAULT_SPLIT):
    s = source.splits[split]
    return list(zip(s.paths, s.labels.tolist()))


def test_order_and_labels_match_imagefolder(image_tree):
    source = scan_source(image_tree)
    assert source.classes == ["cat", "dog house", "v1.2", "ünïcode"]
    assert listing(source) == torchvision_samples(image_tree)
    assert ("cat/nested/deeper/x.jpg", 0) in listing(source)


def test_hidden_files_and_folders_are_ignored(image_tree):
    paths = [p for p, _ in listing(scan_source(image_tree))]
    assert not any(part.startswith(".") for p in paths for part in p.split("/"))
    assert ".ipynb_checkpoints" not in scan_source(image_tree).classes


def test_real_imagenet_sample_matches_imagefolder(imagenet_sample):
    source = scan_source(imagenet_sample)
    assert len(source.classes) == 125
    assert listing(source) == torchvision_samples(imagenet_sample)


def test_empty_class_keeps_its_label_with_a_warning(image_tree):
    (image_tree / "aaa-empty").mkdir()
    source = scan_source(image_tree)
    assert source.classes[0] == "aaa-empty"
    assert listing(source)[0][1] == 1  # 'cat' moved to label 1 because the empty class sorts first
    assert any("empty class folder" in w and "aaa-empty" in w for w in source.warnings)


def test_splits_share_one_class_list(split_tree):
    source = scan_source(split_tree)
    assert sorted(source.splits) == ["train", "val"]
    assert source.classes == ["a", "b", "c"]
    assert sorted(set(source.splits["val"].labels.tolist())) == [0, 2]  # 'c' is 2 in every split
    assert listing(source, "train") == [("train/" + p, l) for p, l in torchvision_samples(split_tree / "train")]


def test_flat_folder_is_unlabeled(flat_tree):
    source = scan_source(flat_tree)
    assert source.classes == []
    assert listing(source) == [(f"f{i}.jpg", -1) for i in range(5)]
    assert not source.splits[DEFAULT_SPLIT].labeled


def test_symlinked_class_folder_is_followed_and_loops_are_cut(tmp_path):
    real = tmp_path / "elsewhere"
    write(real / "a.jpg", jpeg_bytes(1))
    root = tmp_path / "src"
    root.mkdir()
    os.symlink(real, root / "linked")
    os.symlink(real, real / "loop")  # elsewhere/loop -> elsewhere
    source = scan_source(root)
    assert listing(source) == [("linked/a.jpg", 0)]
    assert any("symlink loop" in w for w in source.warnings)


def test_loose_images_beside_class_folders_are_ignored_with_a_warning(image_tree):
    write(image_tree / "loose.jpg", jpeg_bytes(5))
    source = scan_source(image_tree)
    assert "loose.jpg" not in [p for p, _ in listing(source)]
    assert any("beside the class folders" in w for w in source.warnings)


def test_missing_or_empty_source_is_a_clear_error(tmp_path):
    with pytest.raises(SourceError, match="not a folder"):
        scan_source(tmp_path / "nope")
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    with pytest.raises(SourceError, match="no image files found"):
        scan_source(tmp_path / "empty")
