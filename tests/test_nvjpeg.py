"""readers.nvjpeg: the optional GPU decode path is import-guarded and refuses clearly without its needs."""
import importlib.util

import pytest
import torch

from readers import CenterCrop, make_loader


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="checks the no-torchvision error")
def test_gpu_decoder_without_torchvision_says_what_to_install():
    from readers.nvjpeg import GPUDecoder  # importing the module needs neither torchvision nor CUDA

    with pytest.raises(ImportError, match="gpu_decode needs torchvision.*decode on the CPU"):
        GPUDecoder(CenterCrop(224))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_make_loader_gpu_decode_needs_a_cuda_device():
    with pytest.raises(ValueError, match="gpu_decode decodes on the GPU and needs device='cuda'"):
        make_loader([(b"", 0)], 1, workers=0, gpu_decode=True)
    assert make_loader([(b"", 0)], 1, workers=0, gpu_decode=False) is not None
