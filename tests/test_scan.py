import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from packer.errors import PackError, SourceError
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


def test_hidden_names_imagefolder_would_read_are_announced(tmp_path):
    write(tmp_path / "a" / "x.jpg", jpeg_bytes(1))
    write(tmp_path / "a" / "._x.JPEG", jpeg_bytes(2))  # what ImageFolder would read as an image
    write(tmp_path / ".ipynb_checkpoints" / "y.jpg", jpeg_bytes(3))  # ... and as a class
    write(tmp_path / "a" / ".DS_Store", b"neither")  # never an image: not worth a word
    source = scan_source(tmp_path)
    assert [p for p, _ in listing(source)] == ["a/x.jpg"]
    [warning] = [w for w in source.warnings if "hidden" in w]
    assert warning.startswith("2 hidden name(s) left out: .ipynb_checkpoints, a/._x.JPEG;")
    assert "rename" in warning


def test_many_hidden_names_are_one_short_warning(tmp_path):
    write(tmp_path / "a" / "x.jpg", jpeg_bytes(1))
    for i in range(50):
        write(tmp_path / "a" / f"._{i:02d}.jpg", b"resource fork")
    [warning] = [w for w in scan_source(tmp_path).warnings if "hidden" in w]
    assert warning.startswith("50 hidden name(s) left out: a/._00.jpg, a/._01.jpg, a/._02.jpg and 47 more;")


def test_no_hidden_names_no_warning(tmp_path):
    write(tmp_path / "a" / "x.jpg", jpeg_bytes(1))
    write(tmp_path / "a" / ".DS_Store", b"neither")
    assert not [w for w in scan_source(tmp_path).warnings if "hidden" in w]


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


def test_two_links_to_one_folder_list_its_images_under_both_names_as_os_walk_does(tmp_path):
    shared = tmp_path / "shared"
    write(shared / "s.jpg", jpeg_bytes(1))
    write(shared / "deeper" / "d.jpg", jpeg_bytes(2))
    write(tmp_path / "src" / "a" / "1.jpg", jpeg_bytes(3))
    for name in ("x", "y"):
        os.symlink(shared, tmp_path / "src" / "a" / name)
    walked = [os.path.relpath(os.path.join(top, name), tmp_path / "src")  # what ImageFolder lists
              for top, dirs, files in sorted(os.walk(tmp_path / "src" / "a", followlinks=True))
              for name in sorted(files)]
    assert walked == ["a/1.jpg", "a/x/s.jpg", "a/x/deeper/d.jpg", "a/y/s.jpg", "a/y/deeper/d.jpg"]
    os.symlink(tmp_path / "src" / "a", shared / "deeper" / "up")  # a cycle through both links: cut in each
    source = scan_source(tmp_path / "src")
    assert [path for path, _ in listing(source)] == walked
    assert sum("symlink loop" in w for w in source.warnings) == 2, source.warnings


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


def test_fifos_sockets_and_devices_are_listed_as_refused(tmp_path):
    root = tmp_path / "src"
    write(root / "cat" / "ok.jpg", jpeg_bytes(1))
    os.mkfifo(root / "cat" / "pipe.jpg")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(root / "cat" / "sock.jpg"))
    os.symlink("/dev/zero", root / "cat" / "zero.jpg")
    os.symlink(root / "nowhere.jpg", root / "cat" / "dangling.jpg")  # not refused here: reading it says why
    listing = scan_source(root).splits[DEFAULT_SPLIT]
    assert list(listing.paths) == ["cat/dangling.jpg", "cat/ok.jpg", "cat/pipe.jpg", "cat/sock.jpg", "cat/zero.jpg"]
    assert {listing.paths[i]: why for i, why in listing.refused.items()} == {
        "cat/pipe.jpg": "not a regular file (FIFO)",
        "cat/sock.jpg": "not a regular file (socket)",
        "cat/zero.jpg": "not a regular file (character device)",
    }


def test_refused_files_of_an_unlabeled_folder_are_listed_too(flat_tree):
    os.mkfifo(flat_tree / "pipe.jpg")
    listing = scan_source(flat_tree).splits[DEFAULT_SPLIT]
    assert {listing.paths[i]: why for i, why in listing.refused.items()} == {"pipe.jpg": "not a regular file (FIFO)"}


# Unreadable folders. Root ignores chmod 000, so when the tests run as root the scan runs in
# a forked child that has dropped to nobody (exec'ing a new interpreter as nobody may be
# impossible: it often lives under /root). The tree lives in a folder that nobody can reach.

NOBODY = 65534


@pytest.fixture
def public_tmp():
    """A temporary folder any user may read (tmp_path is private to its owner)."""
    folder = Path(tempfile.mkdtemp(prefix="packer-perm-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        for dirpath, dirnames, _ in os.walk(folder):
            for name in dirnames:
                os.chmod(os.path.join(dirpath, name), 0o755)
        shutil.rmtree(folder)


def locked_tree(root: Path, locked: list[str]) -> Path:
    """SRC/{cat,dog,locked}/... with the folders named in `locked` made unreadable (chmod 000)."""
    src = root / "src"
    write(src / "cat" / "a.jpg", jpeg_bytes(1))
    write(src / "cat" / "locked-sub" / "b.jpg", jpeg_bytes(2))
    write(src / "cat" / "sub" / "c.jpg", jpeg_bytes(3))
    write(src / "dog" / "d.jpg", jpeg_bytes(4))
    write(src / "locked" / "e.jpg", jpeg_bytes(5))
    for dirpath, dirnames, filenames in os.walk(src):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)
    src.chmod(0o755)
    for rel in locked:
        (src / rel).chmod(0)
    return src


def as_unprivileged(fn, locked: list[Path]):
    """fn()'s JSON-able result, computed by a process that cannot read the `locked` folders.

    As root: in a forked child that drops to nobody. Skips the test when that is impossible
    or when the locked folders stay readable (a file system that ignores permissions).
    """
    def checked():
        readable = [str(p) for p in locked if os.access(p, os.R_OK)]
        return {"skip": f"still readable after chmod 000: {readable}"} if readable else {"result": fn()}

    if os.geteuid() != 0:
        answer = checked()
    else:
        answer = run_forked_as(NOBODY, checked)
    if "skip" in answer:
        pytest.skip(answer["skip"])
    return answer["result"]


def run_forked_as(uid: int, fn) -> dict:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read_end)
        try:
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            except OSError as exc:
                answer = {"skip": f"cannot drop privileges to uid {uid} ({exc})"}
            else:
                answer = fn()
        except BaseException as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        with os.fdopen(write_end, "w") as f:
            f.write(json.dumps(answer))
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        text = f.read()
    os.waitpid(pid, 0)
    answer = json.loads(text)
    assert "error" not in answer, answer["error"]
    return answer


def scan_outcome(src: Path, on_error: str) -> dict:
    try:
        source = scan_source(src, on_error)
    except SourceError as exc:
        return {"error": str(exc)}
    return {"classes": source.classes, "listings": {name: listing(source, name) for name in source.splits},
            "skipped": source.skipped,
            "warnings": source.warnings}


@pytest.mark.parametrize("locked", ["locked", "cat/locked-sub"])
def test_an_unreadable_folder_stops_the_scan_naming_it(public_tmp, locked):
    src = locked_tree(public_tmp, [locked])
    outcome = as_unprivileged(lambda: scan_outcome(src, "fail"), [src / locked])
    assert outcome.get("error") == (f"{locked}: cannot read folder (Permission denied); fix its permissions, "
                                    "or pass --on-error skip to leave it out"), outcome


def test_a_folder_past_the_path_length_limit_is_named_with_the_right_advice(tmp_path):
    write(tmp_path / "src" / "cat" / "a.jpg", jpeg_bytes(1))
    fd = os.open(tmp_path / "src" / "cat", os.O_RDONLY)
    try:
        for _ in range(4400 // 201):  # made a level at a time, by descriptor: past PATH_MAX (4,096)
            os.mkdir("d" * 200, dir_fd=fd)
            deeper = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = deeper
    finally:
        os.close(fd)
    with pytest.raises(SourceError, match=r"cat/(d{200}/)+d{200}: cannot read folder \(File name too long\); its "
                                          r"path is longer than the system allows: rename or move folders"):
        scan_source(tmp_path / "src")


def test_with_skip_unreadable_folders_are_listed_as_skipped(public_tmp):
    src = locked_tree(public_tmp, ["locked", "cat/locked-sub"])
    outcome = as_unprivileged(lambda: scan_outcome(src, "skip"), [src / "locked", src / "cat" / "locked-sub"])
    assert outcome["classes"] == ["cat", "dog", "locked"]  # the unreadable class keeps its label
    assert outcome["listings"] == {DEFAULT_SPLIT: [["cat/a.jpg", 0], ["cat/sub/c.jpg", 0], ["dog/d.jpg", 1]]}
    assert outcome["skipped"] == [
        {"path": "cat/locked-sub", "split": DEFAULT_SPLIT, "reason": "cannot read folder (Permission denied)"},
        {"path": "locked", "split": DEFAULT_SPLIT, "reason": "cannot read folder (Permission denied)"},
    ]
    assert not any("empty class folder" in w for w in outcome["warnings"])  # it is not empty, it is unreadable


def test_an_unreadable_split_folder_is_skipped_whole(public_tmp):
    src = public_tmp / "splits"
    write(src / "train" / "a" / "1.jpg", jpeg_bytes(1))
    write(src / "val" / "a" / "2.jpg", jpeg_bytes(2))
    for folder in (src, src / "train", src / "train" / "a", src / "val", src / "val" / "a"):
        folder.chmod(0o755)
    for f in (src / "train" / "a" / "1.jpg", src / "val" / "a" / "2.jpg"):
        f.chmod(0o644)
    (src / "val").chmod(0)
    skipped = as_unprivileged(lambda: scan_outcome(src, "skip"), [src / "val"])
    assert skipped["listings"] == {"train": [["train/a/1.jpg", 0]]}
    assert skipped["skipped"] == [{"path": "val", "split": "val", "reason": "cannot read folder (Permission denied)"}]
    failed = as_unprivileged(lambda: scan_outcome(src, "fail"), [src / "val"])
    assert failed["error"].startswith("val: cannot read folder (Permission denied)")


def test_an_unknown_on_error_policy_is_refused(image_tree):
    with pytest.raises(PackError, match="on_error must be one of fail, skip"):
        scan_source(image_tree, "ignore")


def test_a_flat_split_beside_a_labeled_one_is_warned_about(split_tree):
    for i in range(3):
        write(split_tree / "test" / f"t{i}.jpg", jpeg_bytes(7000 + i))
    source = scan_source(split_tree)
    assert not source.splits["test"].labeled
    assert ("test/: 3 images with no class folders, packed unlabeled (label -1); "
            "pass --labels FILE to label them") in source.warnings
    assert not any("no class folders" in w for w in scan_source(split_tree / "train").warnings)
