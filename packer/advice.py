"""The measured figures and rules that `packer doctor` and `readers.diagnose` quote in their advice: one
place, below both (readers imports packer; packer's doctor reaches readers lazily)."""

MAX_SIDE = 512  # the --max-side docs/resolution.md measures first
GPU_DECODE_RATE = 3769  # GPUDecoder's decode + crop on one H100, samples/s (docs/benchmarks.md, nvJPEG)


def max_side_gain(long_side: float) -> float | None:
    """How many times fewer pixels --max-side MAX_SIDE leaves to decode, for images with this
    mean long side (decode time follows the pixels stored); None where it would gain too
    little to advise (a long side within 1.2x of MAX_SIDE)."""
    return (long_side / MAX_SIDE) ** 2 if long_side > 1.2 * MAX_SIDE else None
