"""The CUDA backend: hand-written kernels on cuda-python's driver API, no PyTorch.

Folder map (one concern per file):
  *.cu, common.cuh   the kernels; kernels.py lists each one's host-side signature
  build.py           NVRTC at first use (or nvcc ahead of time) -> cubin, cached by source hash + arch
  driver.py          the thin typed wrapper over cuda.bindings.driver (the only module calling it)
  fake.py            the same interface without a GPU (host-side tests); fake_kernels.py: the numpy twins
  device.py          one GPU: streams, the loaded module, launches by keyword
  layout.py          the tensor-core weight layout (numpy twin of the device repack)
  weights.py         engine tensors -> device memory, once
  meta.py            a step's metadata, packed for one async copy; ring.py: the pinned output ring
  forward.py         the model and the sampler as launch sequences (eager or captured)
  executor.py        CudaExecutor: the Executor of core/executor.py
  verify_on_gpu.sh   one command for a GPU machine: build, tests, golden, benchmark

`create_executor(engine, **options)` is what `--backend cuda` calls. cuda-python is
imported only when an executor is made, so CPU-only installs never need it.
"""

from typing import Optional


def create_executor(engine, *, block_size: int = 16, num_blocks: Optional[int] = None,
                    max_model_len: Optional[int] = None, max_num_seqs: int = 256,
                    max_num_batched_tokens: int = 2048, driver=None, image_fn=None, **options):
    """An engine directory (or a loaded engine_build Engine) -> CudaExecutor.

    `options` are CudaOptions fields (kv_dtype, use_graphs, pdl, device, ...); `driver` and
    `image_fn` replace the real driver and kernel build (tests pass kernels/cuda/fake.py)."""
    from .build import kernel_image
    from .executor import CudaExecutor, CudaOptions
    if not hasattr(engine, "tensors"):
        from ..engine_format import load_engine
        engine = load_engine(engine)
    opts = CudaOptions(block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len,
                       max_batch=max_num_seqs, max_num_tokens=max_num_batched_tokens, **options)
    return CudaExecutor(engine.config, engine.tensors, opts, driver=driver, image_fn=image_fn or kernel_image)
