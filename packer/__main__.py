"""`python -m packer ...`: the packer command under a name no other tool shadows
(HashiCorp's `packer` is often first on PATH on infrastructure machines)."""
from .cli import main

main(prog_name="python -m packer")
