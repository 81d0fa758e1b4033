"""The library's pack(): one source packed (packer.pack), or, given parts= or executor=, packed in
parts on an Executor and merged (packer.parts), to a folder or a URL (packer.destination). It sits
above both, so neither imports the other to hand parts= on."""
from __future__ import annotations

import inspect

from .destination import destination_for
from .errors import PackError
from .pack import pack as pack_source
from .pack import pack_output, pack_settings
from .parts import pack_in_parts
from .writing import PackResult


def pack(src: str, fmt: str = "lmdb", out: str | None = None, *, parts: int | None = None, executor=None,
         force: bool = False, staging_dir: str | None = None, storage_options: dict | None = None,
         **kwargs) -> PackResult:
    """Pack the ImageFolder tree at src into `fmt` at out: packer.pack.pack, whose keyword
    arguments (part=, shuffle=, checksum=...) it takes and documents.

    Packing in parts (packer.parts, docs/parts.md): parts=N with executor=, any
    concurrent.futures.Executor (a Dask Client's get_executor(), mpi4py's
    MPIPoolExecutor...), runs the N parts on it and merges them into out; without an
    executor they run on local processes. Workers must see src and out's folder at the
    same paths.

    out may be a URL (s3://bucket/key): the dataset is packed in a folder under staging_dir
    (default $TMPDIR) and uploaded, storage_options saying how to reach the store
    (packer.destination, docs/remote.md).
    """
    inspect.signature(pack_source).bind(src, fmt, out, **kwargs)  # a misspelt keyword fails here, not later
    writer = pack_settings(fmt, **kwargs)[2]  # the writer's options; refused before OUT is looked at or any part starts
    in_parts = executor is not None or parts is not None
    if in_parts and kwargs.get("part") is not None:
        raise PackError("part= packs one part, parts= and executor= pack them all: pass one or the other")
    destination = destination_for(out, lambda: pack_output(src, fmt, kwargs.get("part")), force=force,
                                  staging_dir=staging_dir, storage_options=storage_options)
    return destination.write(fmt, [src], lambda local, force: pack_here(src, fmt, local, parts, executor, writer,
                                                                        force=force, **kwargs))


def pack_here(src: str, fmt: str, out: str, parts: int | None, executor, writer: dict, **kwargs) -> PackResult:
    """pack() to a local out, its settings checked (writer: the writer's options, checked)."""
    if executor is None and parts is None:
        return pack_source(src, fmt, out, **kwargs)
    kwargs.pop("part", None)
    return pack_in_parts(src, fmt, out, parts=parts, executor=executor, **{**kwargs, "options": writer})
