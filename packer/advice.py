"""The measured figures that `packer doctor` and `readers.diagnose` quote in their advice: one
place, below both (readers imports packer; packer's doctor reaches readers lazily)."""

MAX_SIDE = 512  # the --max-side docs/resolution.md measures first
GPU_DECODE_RATE = 3769  # GPUDecoder's decode + crop on one H100, samples/s (docs/benchmarks.md, nvJPEG)
