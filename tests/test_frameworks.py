"""packer's loaders under PyTorch Lightning and Hugging Face Accelerate (docs/frameworks.md):
2 CPU ranks over gloo, the 125-image ImageNet sample (one image per class, so a label
names a sample), every sample counted per rank per epoch; resumed from the frameworks'
own checkpoints at an epoch's end and mid-epoch, which must replay exactly what an
uninterrupted run saw. The docs' recipes are run too, as they are printed.

The runs are new processes running this file as a script:
`python tests/test_frameworks.py lightning|accelerate JOBFILE`, which runs the file's jobs one
after another in the same ranks, so a launch's imports, rank start-up and process group are paid
once for the several checks it serves. Runs resumed from a checkpoint are launched after the runs
that saved it, in processes of their own, as a user's resumed job is. A recipe's job runs the
printed code, unchanged, as `python train.py ARGUMENTS` in its own folder would, in ranks that
the launch's first job started the way the recipe's own launch would (Lightning's launcher, torchrun).
"""
from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import os
import re
import runpy
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the script run: this checkout's packer and readers

import readers  # noqa: E402
from packer import pack  # noqa: E402
from packer.cores import available_cores  # noqa: E402

# Collected: the tests need both frameworks, found here and imported only by the launches that
# run them (importing Lightning takes seconds, paid by every pytest process that collects the
# file). Run as the launch script, or imported again by the workers it spawns (__mp_main__),
# it imports only the one it runs (an Accelerate rank imports no Lightning).
if __name__ not in ("__main__", "__mp_main__"):
    for framework in ("lightning", "accelerate"):
        if importlib.util.find_spec(framework) is None:
            pytest.skip(f"could not find {framework!r}: the framework tests need it", allow_module_level=True)
import torch  # noqa: E402
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

BATCH, SEED, EPOCHS = 8, 5, 3
SAMPLES = 125
SOURCE_STRIDE = 1000  # a mixture's sample is named label + SOURCE_STRIDE x source
MIX_SAMPLES = 2 * SAMPLES  # the LMDB pack and the WDS folder mixed by their sizes: each sample once an epoch
# Over uneven.wds, this seed's shard orders gave 8, 9 and 8 batches a rank when whole shards
# were dealt: an epoch longer than the first, which Lightning cut short at the first's length.
WDS_SEED = 8
DOCS = HERE.parent / "docs" / "frameworks.md"


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    source = Path(os.environ.get("PACKER_SHARED_DATA", "/work/shared/data")) / "imagenet-sample"
    if not source.is_dir():
        pytest.skip(f"{source} is not present (set PACKER_SHARED_DATA)")
    root = tmp_path_factory.mktemp("frameworks")
    (root / "src").mkdir()
    (root / "src" / "train").symlink_to(source)  # a "train" split, as the docs' recipes read
    pack(str(root / "src"), "lmdb", str(root / "d.lmdb"), workers=1, progress=False)
    # Shards of 12 to 22 samples, in an order that changes with the epoch.
    pack(str(root / "src"), "wds", str(root / "uneven.wds"), workers=1, progress=False,
         options={"shard_size": 2_000_000, "max_count": None})
    return root


def labels_of(batch) -> torch.Tensor:
    """The collate: each sample's label (its name: one image per class), as a tensor, which
    Accelerate's dispatch slices among the ranks."""
    return torch.tensor([sample[1] + SOURCE_STRIDE * (sample[2] if len(sample) == 3 else 0) for sample in batch])


def make(job: dict):
    """The loader a job trains on, built as a user would, after the ranks are up."""
    import torch.utils.data as tud

    root = Path(job["root"])
    if job["loader"] == "wds":
        data = readers.WDSDataset(root / "uneven.wds", decode="raw", shuffle=32, seed=WDS_SEED)
        return readers.make_loader(data, BATCH, workers=job.get("workers", 1), collate_fn=labels_of,
                                   multiprocessing_context=job.get("context"))
    data = readers.LMDBDataset(root / "d.lmdb", decode="raw")
    if job["loader"] == "mixstream":  # with the WDS folder as a stream: readers.mix_stream.MixStream
        data = readers.Mix({"lmdb": data, "wds": readers.WDSDataset(root / "uneven.wds", decode="raw", shuffle=32,
                                                                   seed=WDS_SEED)}, seed=SEED)
    if job["loader"] == "mix":  # by index from the WDS folder: readers.WDSMapDataset
        data = readers.Mix({"lmdb": data, "wds": readers.WDSMapDataset(root / "uneven.wds", decode="raw")},
                          seed=SEED)
    if job["loader"] == "sampler":  # a plain DataLoader over packer's sampler
        return tud.DataLoader(data, BATCH, sampler=readers.ShuffleSampler(data, seed=SEED), drop_last=True,
                              collate_fn=labels_of)
    return readers.make_loader(data, BATCH, workers=1, seed=SEED, collate_fn=labels_of)


def record(out: Path, rank: int, seen: dict) -> None:
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


def recorder(job: dict):
    """A LightningModule that trains nothing and records the labels each rank is given, per epoch."""
    import lightning as L

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen: dict = {}

        def train_dataloader(self):
            # make_loader's default workers, on the cores Lightning's launcher's ranks share
            self.workers = readers.make_loader(readers.LMDBDataset(Path(job["root"]) / "d.lmdb"), BATCH).num_workers
            return make(job)

        def training_step(self, batch, index):
            self.seen.setdefault(str(self.current_epoch), []).extend(batch.tolist())
            return self.w.sum() * 0.0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_end(self):
            record(Path(job["out"]), self.global_rank, {**self.seen, "workers": self.workers})

    return Recorder()


def lightning_run(job: dict) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = Path(job["out"])
    checkpoints = [ModelCheckpoint(out / "end", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True)]
    if job.get("mid_step"):
        checkpoints.append(ModelCheckpoint(out / "mid", save_top_k=-1, every_n_train_steps=job["mid_step"],
                                           save_on_train_epoch_end=False))
    # Lightning's own launcher, as the docs' recipe: rank 1 runs this script again, with the same jobs.
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=checkpoints,
                        num_sanity_val_steps=0)
    trainer.fit(recorder(job), ckpt_path=job.get("resume"))


# The exceptions of refused prepare() calls, kept until the process exits: collected, the torchdata
# loader a refusal leaves behind would wait 5 s on each of its workers, which are never told to stop
# (torchdata 0.11.0); at the exit, torch skips that wait and multiprocessing ends the workers (which
# torch reports on stderr, the exit status staying 0).
REFUSALS: list[ValueError] = []


def accelerate_run(job: dict) -> None:
    """One rank of 2 under torchrun, or a process alone: prepare() the loader, train EPOCHS epochs (from a
    saved state, if the job says), save the state after job["save_at"] = [epoch, steps]."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    out = Path(job["out"])
    stateful = job.get("stateful", False)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
    loader = make(job)
    if job.get("unprepared"):
        try:
            next(iter(loader))
        except RuntimeError as exc:
            (out / f"error{accelerator.process_index}.txt").write_text(str(exc))
        return
    if job.get("refused"):
        own = loader.state_dict()  # make_loader's own state, unprepared, is not Accelerate's to refuse
        try:
            accelerator.prepare(loader)
        except ValueError as exc:
            (out / f"error{accelerator.process_index}.txt").write_text(f"{own['kind']}\n{exc}")
            REFUSALS.append(exc)
        return
    loader = accelerator.prepare(loader)
    start, skip = 0, 0
    if job.get("resume"):
        accelerator.load_state(job["resume"])
        start, skip = job["resume_at"]
    seen: dict[str, list[int]] = {}
    for epoch in range(start, EPOCHS):
        loader.set_epoch(epoch)  # docs/frameworks.md: Accelerate's own count restarts in a new process
        batches = loader
        if epoch == start and skip and not stateful:
            batches = accelerator.skip_first_batches(loader, skip)
        for step, batch in enumerate(batches, 1):
            seen.setdefault(str(epoch), []).extend(batch.tolist())
            if job.get("save_at") == [epoch, step]:
                accelerator.save_state(out / "state")
    record(out, accelerator.process_index, seen)


def recipe_job(name: str, arguments: list[str], where: Path) -> dict:
    """A job running the docs' recipe `name` as `python train.py ARGUMENTS` in `where`; not a
    launch's first: that one starts the ranks."""
    (where / "train.py").write_text(recipe(name))
    return {"recipe": str(where / "train.py"), "arguments": arguments}


def recipe_run(job: dict) -> None:
    """Run the recipe's train.py as its __main__, from its folder, with its arguments; what
    it prints goes to job["out"]/outputRANK.txt."""
    script, here, argv = Path(job["recipe"]), os.getcwd(), sys.argv
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    os.chdir(script.parent)
    sys.argv = [script.name, *job["arguments"]]
    try:
        with output_to(Path(job["out"]) / f"output{rank}.txt"):
            runpy.run_path(script.name, run_name="__main__")
    finally:
        os.chdir(here)
        sys.argv = argv


@contextlib.contextmanager
def output_to(path: Path):
    """This process's stdout and stderr, at the descriptors (as the frameworks' loggers write), into path."""
    saved = [os.dup(1), os.dup(2)]
    with open(path, "w") as file:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(file.fileno(), 1), os.dup2(file.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            for descriptor, old in zip((1, 2), saved):
                os.dup2(old, descriptor)
                os.close(old)


def recipe_output(out: Path) -> str:
    """What a recipe's job printed, on every rank."""
    return "".join(path.read_text() for path in sorted(out.glob("output*.txt")))


def torchrun_options(ranks: int) -> list[str]:
    """python's arguments that run a script under torchrun on `ranks` processes, on a free port."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    return ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(port)]


def launch(kind: str, jobs: dict[str, dict], root: Path, torchrun: bool = False) -> None:
    """Run jobs, in order, in one launch (under torchrun on 2 ranks, if asked); job NAME writes to root/NAME."""
    for name, job in jobs.items():
        (root / name).mkdir()
    jobfile = root / f"jobs-{next(iter(jobs))}.json"
    jobfile.write_text(json.dumps([{**job, "out": str(root / name)} for name, job in jobs.items()]))
    command = [sys.executable, __file__, kind, str(jobfile)]
    if torchrun:
        command[1:1] = torchrun_options(2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent, timeout=120 + 120 * len(jobs),
                          env=env)
    assert done.returncode == 0, f"the {kind} run of {', '.join(jobs)} failed:\n{done.stdout[-2000:]}\n" \
                                 f"{done.stderr[-6000:]}"


def records(out: Path, ranks: int = 2) -> dict:
    """{rank: {epoch: labels}} from a job's record files (FileNotFoundError when it recorded none)."""
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)}


def check_whole_epochs(seen: dict, epochs, padded: int = 0, samples: int = SAMPLES) -> None:
    """Every epoch, the ranks' samples are disjoint (but for `padded` repeats) and cover the
    dataset of `samples` (less drop_last's share), and each epoch's order differs from the one before."""
    for epoch in epochs:
        ranks = [seen[rank][str(epoch)] for rank in (0, 1)]
        assert len(ranks[0]) == len(ranks[1])
        kept = len(ranks[0]) + len(ranks[1])  # less than SAMPLES by drop_last, more by padding
        union = set(ranks[0]) | set(ranks[1])
        assert 0 <= min(kept, samples) - len(union) <= padded, f"epoch {epoch}: {len(union)} of {kept} distinct"
        assert kept > samples - 2 * 2 * BATCH, f"epoch {epoch}: {kept} of {samples} samples seen"
        if epoch:
            assert seen[0][str(epoch)] != seen[0][str(epoch - 1)], f"epoch {epoch} repeats the previous order"


def check_mixed_stream(seen: dict, epochs) -> None:
    """A stream mixture, by its sizes: every epoch, the same batch count on both ranks and the
    map-style source (LMDB: labels below SOURCE_STRIDE) giving each of its samples once; the
    stream, along its own epochs, which carry on across the mixture's (drop_last leaves a few
    of each stream epoch to the next mixture epoch): over the run, every one of its samples
    read, as often as any other within 2, but for the rank's padding."""
    stream = collections.Counter()
    for epoch in epochs:
        ranks = [seen[rank][str(epoch)] for rank in (0, 1)]
        assert len(ranks[0]) == len(ranks[1]) and len(ranks[0]) * 2 > MIX_SAMPLES - 2 * 2 * BATCH, f"epoch {epoch}"
        lmdb = [label for labels in ranks for label in labels if label < SOURCE_STRIDE]
        assert len(lmdb) == len(set(lmdb)) > SAMPLES - 2 * 2 * BATCH, f"epoch {epoch}: the LMDB source's samples"
        stream.update(label for labels in ranks for label in labels if label >= SOURCE_STRIDE)
    # Within 2: a rank's share of the stream changes with its epoch's shard order, so the ranks' chains, a
    # few draws apart, may each read a sample; the last, the padded sample (125 over 2 ranks), once more each epoch.
    counts = sorted(stream.values())
    assert len(stream) == SAMPLES and counts[-2] - counts[0] <= 2 and counts[-1] <= counts[0] + 2 + EPOCHS, counts


def epochs_of(seen: dict) -> dict:
    """A Lightning rank's record less its worker count: {epoch: labels}."""
    return {key: labels for key, labels in seen.items() if key != "workers"}


LIGHTNING_LOADERS = ("make_loader", "wds", "mix", "mixstream")
MID_STEP = {"make_loader": 11, "wds": 11, "mix": 20, "mixstream": 20}  # 7 or 8, or 15, steps an epoch: mid-epoch 1


@pytest.fixture(scope="module")
def lightning_launches(packs, tmp_path_factory) -> Path:
    """Every Lightning run of the tests below: the uninterrupted runs and the docs' recipe's
    first in one launch, then every run resumed from their checkpoints, and the recipe's
    second, in another. The folder holding each job's (the recipe's own: recipe/)."""
    root = tmp_path_factory.mktemp("lightning")
    (root / "recipe").mkdir()
    whole = {f"{loader}-whole": {"root": str(packs), "loader": loader, "mid_step": MID_STEP[loader]}
             for loader in LIGHTNING_LOADERS}
    first = recipe_job("lightning", [str(packs / "d.lmdb"), "1", "16", "2"], root / "recipe")
    launch("lightning", {"sampler-whole": {"root": str(packs), "loader": "sampler"}, **whole, "recipe-first": first},
           root)
    shutil.copy(root / "recipe" / "checkpoints" / "last.ckpt", root / "recipe-first")  # the next run replaces it
    resumed = {}
    for loader in LIGHTNING_LOADERS:
        (end,) = (root / f"{loader}-whole" / "end").glob("epoch=0-*.ckpt")
        (mid,) = (root / f"{loader}-whole" / "mid").glob(f"*step={MID_STEP[loader]}.ckpt")
        for name, checkpoint in (("after-end", end), ("after-mid", mid)):
            resumed[f"{loader}-{name}"] = {**whole[f"{loader}-whole"], "mid_step": None, "resume": str(checkpoint)}
    again = recipe_job("lightning", [str(packs / "d.lmdb"), "2", "16", "2"], root / "recipe")
    launch("lightning", {**resumed, "recipe-again": again}, root)
    return root


@pytest.fixture(scope="module")
def lightning_runs(lightning_launches) -> dict:
    """{sampler-whole|LOADER-whole|LOADER-after-end|LOADER-after-mid: {rank: {epoch: labels}}}."""
    runs = [f"{loader}-{run}" for loader in LIGHTNING_LOADERS for run in ("whole", "after-end", "after-mid")]
    return {name: records(lightning_launches / name) for name in ["sampler-whole", *runs]}


def test_lightning_defaults_leave_a_plain_loader_over_a_packer_sampler_its_shares(lightning_runs):
    seen = lightning_runs["sampler-whole"]
    check_whole_epochs(seen, range(EPOCHS))
    # Lightning's launcher sets LOCAL_RANK and WORLD_SIZE, not LOCAL_WORLD_SIZE: make_loader's
    # default still shares the cores between the 2 ranks.
    assert [seen[rank]["workers"] for rank in (0, 1)] == [max(1, available_cores() // 2)] * 2


def check_stream_epochs(seen: dict, root: Path) -> None:
    """Every epoch Lightning ran over the stream is the whole pass each rank's stream makes of
    it (outside Lightning, which reads a loader's length once), and covers every sample
    less drop_last's share."""
    for epoch in range(EPOCHS):
        trained = []
        for rank in (0, 1):
            stream = readers.WDSDataset(root / "uneven.wds", decode="raw", shuffle=32, seed=WDS_SEED, rank=rank,
                                        world_size=2)
            stream.set_epoch(epoch)
            loader = readers.make_loader(stream, BATCH, workers=1, collate_fn=labels_of)
            assert len(seen[rank][str(epoch)]) == len(loader) * BATCH, f"epoch {epoch} cut short on rank {rank}"
            trained += seen[rank][str(epoch)]
        assert len(set(trained)) >= SAMPLES - 2 * BATCH  # each rank drops its partial batch, nothing more


@pytest.mark.parametrize("loader", LIGHTNING_LOADERS)
def test_lightning_resumes_exactly_from_epoch_end_and_mid_epoch_checkpoints(lightning_runs, packs, loader):
    whole, after_end, after_mid = (lightning_runs[f"{loader}-{run}"] for run in ("whole", "after-end", "after-mid"))
    if loader == "mixstream":
        check_mixed_stream(whole, range(EPOCHS))
    else:
        check_whole_epochs(whole, range(EPOCHS), padded=1 if loader == "wds" else 0,  # a stream pads odd counts
                           samples=MIX_SAMPLES if loader == "mix" else SAMPLES)
    if loader == "wds":
        check_stream_epochs(whole, packs)
    mid_step = MID_STEP[loader]
    for rank in (0, 1):
        assert epochs_of(after_end[rank]) == {e: whole[rank][e] for e in ("1", "2")}
        steps_before = mid_step - len(whole[rank]["0"]) // BATCH
        assert set(epochs_of(after_mid[rank])) == {"1", "2"}
        assert after_mid[rank]["1"] == whole[rank]["1"][steps_before * BATCH:]
        assert after_mid[rank]["2"] == whole[rank]["2"]


ACCELERATE_CASES = [("make_loader", False), ("make_loader", True), ("wds", False), ("mix", False), ("mixstream", False)]
REFUSED_CASES = [(2, 1, None), (1, 1, None), (2, 2, "spawn"), (1, 0, None)]


def accelerate_case(loader: str, stateful: bool) -> str:
    return f"{loader}-{'stateful' if stateful else 'plain'}"


def refused_case(ranks: int, workers: int, context: str | None) -> str:
    return f"refused-{ranks}x{workers}-{context or 'default'}"


@pytest.fixture(scope="module")
def accelerate_runs(packs, tmp_path_factory) -> Path:
    """Every Accelerate run of the tests below: under torchrun, one launch of 2 ranks for the
    uninterrupted runs, the refusals and the docs' recipe's first run, and one for the runs
    resumed from the first launch's saved states and the recipe's second; between them, the
    1-process refusals in a plain process, as a user runs one. The folder holding each job's
    (the recipe's own: recipe/)."""
    root = tmp_path_factory.mktemp("accelerate")
    (root / "recipe").mkdir()
    recipe_arguments = [str(BATCH), "3", "checkpoint"]  # BATCH EVERY CHECKPOINT, after DATA EPOCHS
    whole = {f"{accelerate_case(loader, stateful)}-whole": {"root": str(packs), "loader": loader, "stateful": stateful,
                                                           "save_at": [1, 3]}
             for loader, stateful in ACCELERATE_CASES}  # mid-epoch 1, after 3 steps
    refused = {ranks: {refused_case(ranks, workers, context): {
        "root": str(packs), "loader": "wds", "stateful": True, "refused": True, "workers": workers,
        "context": context} for r, workers, context in REFUSED_CASES if r == ranks} for ranks in (1, 2)}
    unprepared = {"unprepared": {"root": str(packs), "loader": "make_loader", "unprepared": True}}
    first = recipe_job("accelerate", [str(packs / "d.lmdb"), "1", *recipe_arguments], root / "recipe")
    launch("accelerate", {**whole, **unprepared, **refused[2], "recipe-first": first}, root, torchrun=True)
    launch("accelerate", refused[1], root)
    resumed = {name.replace("-whole", "-resumed"): {**job, "save_at": None, "resume": str(root / name / "state"),
                                                     "resume_at": [1, 3]} for name, job in whole.items()}
    again = recipe_job("accelerate", [str(packs / "d.lmdb"), "2", *recipe_arguments], root / "recipe")
    launch("accelerate", {**resumed, "recipe-again": again}, root, torchrun=True)
    return root


@pytest.mark.parametrize("loader, stateful", ACCELERATE_CASES)
def test_accelerate_prepare_shards_the_whole_dataset_and_resumes_exactly(accelerate_runs, loader, stateful):
    """Mid-epoch 1, after 3 steps, through skip_first_batches or the stateful loader's state."""
    whole = records(accelerate_runs / f"{accelerate_case(loader, stateful)}-whole")
    if loader == "mixstream":
        check_mixed_stream(whole, range(EPOCHS))
    else:
        check_whole_epochs(whole, range(EPOCHS), samples=MIX_SAMPLES if loader == "mix" else SAMPLES)
    resumed = records(accelerate_runs / f"{accelerate_case(loader, stateful)}-resumed")
    for rank in (0, 1):  # each step gives each rank one batch of BATCH
        assert resumed[rank] == {"1": whole[rank]["1"][3 * BATCH:], "2": whole[rank]["2"]}


def test_make_loader_not_prepared_under_accelerate_says_to_prepare_it(accelerate_runs):
    out = accelerate_runs / "unprepared"
    assert not list(out.glob("rank*.json"))  # no records: the run stops at the error
    for rank in (0, 1):
        assert "accelerator.prepare()" in (out / f"error{rank}.txt").read_text()


@pytest.mark.parametrize("ranks, workers, context", REFUSED_CASES)
def test_accelerate_stateful_loader_over_wds_stops_at_prepare_saying_what_to_set(accelerate_runs, ranks, workers,
                                                                                  context):
    """use_stateful_dataloader=True saves a WDSDataset's streams a look-ahead past the batches
    trained on, and rank 1's stale state can overwrite rank 0's: prepare() refuses it."""
    out = accelerate_runs / refused_case(ranks, workers, context)
    assert not list(out.glob("rank*.json"))  # no records: the run stops at the error
    for rank in range(ranks):
        own, error = (out / f"error{rank}.txt").read_text().split("\n", 1)
        assert own == "EpochLoader"
        assert "use_stateful_dataloader=False" in error and "skip_first_batches" in error


# The docs' recipes, run as they are printed (in the launches of lightning_launches and accelerate_runs).

def recipe(name: str) -> str:
    """The code block docs/frameworks.md tags `<!-- recipe: name ... -->`, as printed."""
    found = re.search(rf"<!-- recipe: {name} .*?-->\n```python\n(.*?)```", DOCS.read_text(), re.S)
    assert found, f"{DOCS} has no recipe tagged {name!r}"
    return found.group(1)


def test_the_lightning_recipe_resumes_from_its_last_checkpoint(lightning_launches):
    first = torch.load(lightning_launches / "recipe-first" / "last.ckpt", weights_only=False)
    again = recipe_output(lightning_launches / "recipe-again")
    assert "Restored all states from the checkpoint" in again  # ckpt_path="last" found last.ckpt
    last = torch.load(lightning_launches / "recipe" / "checkpoints" / "last.ckpt", weights_only=False)
    assert first["global_step"] > 0
    assert (first["epoch"], last["epoch"], last["global_step"]) == (0, 1, 2 * first["global_step"])


def test_the_accelerate_recipe_trains_distributed_and_resumes_after_an_epochs_end(accelerate_runs, packs):
    """On CPU under torchrun (the docs' launch), each rank gets half the loader's batches; a
    state saved after an epoch's last batch resumes at the next epoch, replaying nothing."""
    data = readers.LMDBDataset(packs / "d.lmdb")
    whole = len(readers.make_loader(data, BATCH, workers=0))  # one process's batches of an epoch
    first = recipe_output(accelerate_runs / "recipe-first")
    assert re.findall(r"epoch (\d+): (\d+) steps", first) == [("0", str(whole // 2))]
    again = recipe_output(accelerate_runs / "recipe-again")
    assert re.findall(r"epoch (\d+): (\d+) steps", again) == [("1", str(whole // 2))]


def test_make_loader_refuses_a_one_process_accelerator_where_the_launcher_started_several(packs, tmp_path):
    """Under torchrun, Accelerator() without cpu=True on a machine without GPUs runs one
    process (DistributedType.NO) in each: each would train alone on its share."""
    script = tmp_path / "alone.py"
    script.write_text("import sys\nfrom accelerate import Accelerator\nimport readers\n\naccelerator = Accelerator()\n"
                      f"readers.make_loader(readers.LMDBDataset({str(packs / 'd.lmdb')!r}), {BATCH})\n")
    command = [sys.executable, *torchrun_options(2), str(script)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    for rank in (0, 1):
        assert f"RuntimeError: this is rank {rank} of WORLD_SIZE=2" in done.stdout + done.stderr
    assert "Accelerator(cpu=True" in done.stdout + done.stderr


# What the frameworks rely on, in one process.

def test_an_epoch_set_on_the_sampler_before_the_first_batch_is_the_pass_run(packs):
    data = readers.LMDBDataset(packs / "d.lmdb", decode="raw")
    loader = readers.make_loader(data, BATCH, workers=0, seed=SEED, collate_fn=labels_of)
    first = [b.tolist() for b in loader]
    batches = iter(loader)  # Lightning makes a resumed epoch's iterator, then sets its epoch
    loader.sampler.set_epoch(4)
    expected = readers.ShuffleSampler(data, seed=SEED, drop_last=True)
    expected.set_epoch(4)
    order = list(expected)
    assert [b.tolist() for b in batches] == [data.reader.labels[order[k:k + BATCH]].tolist()
                                             for k in range(0, len(order) - BATCH + 1, BATCH)] != first
    assert loader.state_dict()["epoch"] == 5  # and passes go on from the epoch set


def test_a_stream_loader_takes_its_epoch_through_its_sampler(packs):
    def loader():
        stream = readers.WDSDataset(packs / "uneven.wds", decode="raw", shuffle=32, seed=WDS_SEED)
        return readers.make_loader(stream, BATCH, workers=0, collate_fn=labels_of)

    framework, direct = loader(), loader()
    framework.sampler.set_epoch(2)  # what Lightning calls, each epoch
    direct.set_epoch(2)
    assert [b.tolist() for b in framework] == [b.tolist() for b in direct]


def test_a_state_saved_after_an_epochs_last_batch_resumes_at_the_next_epoch(packs):
    data = readers.LMDBDataset(packs / "d.lmdb", decode="raw")
    loader = readers.make_loader(data, BATCH, workers=0, seed=SEED, collate_fn=labels_of)
    batches = iter(loader)
    for _ in range(len(loader)):  # Lightning saves here, before asking for a batch past the last
        next(batches)
    state = loader.state_dict()
    assert (state["epoch"], state["batches"], state["sampler"]["epoch"]) == (1, 0, 1)



def test_a_stream_loaders_length_is_every_pass_it_runs(packs):
    """Lightning reads it once, and ends each epoch there."""
    stream = readers.WDSDataset(packs / "uneven.wds", decode="raw", shuffle=32, seed=WDS_SEED, rank=0,
                                world_size=2)
    loader = readers.make_loader(stream, BATCH, workers=1, collate_fn=labels_of)
    said = len(loader)
    assert [len(list(loader)) for _ in range(3)] == [said] * 3


if __name__ == "__main__":
    for one in json.loads(Path(sys.argv[2]).read_text()):
        run = recipe_run if "recipe" in one else {"lightning": lightning_run, "accelerate": accelerate_run}[sys.argv[1]]
        run(one)
