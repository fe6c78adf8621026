"""The CUDA backend: hand-written kernels on cuda-python's driver API, no PyTorch.

Folder map (one concern per file):
  *.cu, common.cuh   the kernels; kernels.py lists each one's host-side signature
  build.py           NVRTC at first use (or nvcc ahead of time) -> cubin, cached by source hash + arch
  driver.py          the thin typed wrapper over cuda.bindings.driver (the only module calling it; the
                     step wait goes through ctypes so it never holds the GIL)
  fake.py            the same interface without a GPU (host-side tests); fake_kernels.py: the numpy twins
  device.py          one GPU: streams, the loaded module, launches by keyword
  layout.py          the tensor-core weight layout (numpy twin of the device repack), fused kernels' row orders
  weights.py         engine tensors -> device memory, once
  meta.py            a step's metadata, packed for one async copy; ring.py: the pinned output ring
  forward.py         the model and the sampler as launch sequences (eager or captured): five fused kernels
                     per decode layer by default, the ten unfused ones kept as their reference
  executor.py        CudaExecutor: the Executor of core/executor.py
  verify_on_gpu.sh   one command for a GPU machine: build, tests, golden, benchmark, serving

`create_executor(engine, options)` is the "cuda" row of kernels.BACKENDS. cuda-python is
imported only when an executor is made, so CPU-only installs never need it.
"""

from typing import Optional

from ...core.options import EngineOptions
from .build import kernel_image
from .driver import CudaError
from .executor import CudaExecutor, CudaOptions


def create_executor(engine, options: EngineOptions, max_model_len: Optional[int] = None, *, driver=None,
                    image_fn=None, **cuda_options):
    """kernels.BACKENDS["cuda"]: a loaded engine directory -> CudaExecutor.

    The shared options (block size, KV blocks, batch and token budgets, context) come from
    `options`; `cuda_options` are the CUDA-only CudaOptions fields (kv_dtype, use_graphs, pdl,
    device, ...); `driver` and `image_fn` replace the real driver and kernel build (tests pass
    kernels/cuda/fake.py). Raises ValueError when the backend cannot run here (no
    cuda-python, no driver, no device)."""
    opts = CudaOptions(block_size=options.block_size, num_blocks=options.num_kv_blocks, max_model_len=max_model_len,
                       max_num_seqs=options.max_num_seqs, max_num_batched_tokens=options.max_num_batched_tokens,
                       **cuda_options)
    try:
        return CudaExecutor(engine.config, engine.tensors, opts, driver=driver, image_fn=image_fn or kernel_image)
    except CudaError as exc:
        raise ValueError(f"the cuda backend is not available: {exc}") from None
