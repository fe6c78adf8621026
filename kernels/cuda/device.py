"""One GPU as the CUDA backend uses it: the driver, two streams and the loaded kernels.

Contract:
- `Device(drv)` creates the compute stream (every kernel of a step, and the step's copies)
  and the copy stream (weight uploads), picks the architecture from the device, loads the
  cubin of kernels/cuda/build.py (`image_fn(arch)`, cached on disk) and looks up every
  kernel of kernels/cuda/kernels.py once.
- `launch(name, grid, block, stream, smem=0, **args)` binds keyword arguments to the
  kernel's parameter list (an unknown or missing name raises) and launches, with
  programmatic dependent launch when the device was made with `pdl=True` (sm_90+; the
  executor turns it on wherever the GPU has it: every kernel waits with griddepcontrol.wait
  before it reads what an earlier kernel wrote, and the INT4 products signal their dependents
  as soon as their last weight load is issued).
"""

from typing import Callable

from .build import kernel_image
from .kernels import ATT_PAIRS, ATT_TILE, SAMPLE_CAP, SPECS

MIN_TENSOR_CORE_CC = (8, 0)        # mma.m16n8k16 with fp16 inputs


class Device:
    def __init__(self, drv, image_fn: Callable[[str], bytes] = kernel_image, pdl: bool = False,
                 max_head_dim: int = 256):
        self.drv = drv
        self.name = drv.name
        self.compute_capability = cc = tuple(drv.compute_capability)
        self.arch = f"sm_{cc[0]}{cc[1]}"
        self.num_sms = drv.num_sms
        self.pdl = bool(pdl)
        if self.pdl and cc < (9, 0):
            raise ValueError(f"programmatic dependent launch needs sm_90 or newer; {self.name} is {self.arch}")
        self.compute_stream = drv.stream_create()
        self.copy_stream = drv.stream_create()
        self.module = drv.module_load(image_fn(self.arch))
        self.functions = {name: drv.module_function(self.module, name) for name in SPECS}
        self.raise_smem_limits(max_head_dim)

    @property
    def tensor_cores(self) -> bool:
        return self.compute_capability >= MIN_TENSOR_CORE_CC

    def raise_smem_limits(self, max_head_dim: int) -> None:
        """Kernels whose dynamic shared memory may pass the default 48 KB."""
        att = attention_smem_bytes(max_head_dim)
        for name in ("attention_paged_f32", "attention_paged_f16", "attention_paged_fused_f32",
                     "attention_paged_fused_f16"):
            self.drv.function_set_max_dynamic_smem(self.functions[name], att)
        self.drv.function_set_max_dynamic_smem(self.functions["sample_tokens"], sample_smem_bytes())

    def launch(self, name: str, grid, block: int, stream, smem: int = 0, **args) -> None:
        """Launch one kernel (hot path during eager steps and graph capture)."""
        spec = SPECS[name]
        if len(grid) != 3:
            grid = (*grid, 1, 1)[:3]
        self.drv.launch(self.functions[name], grid, block, smem, stream, spec.param_types,
                        spec.bind(**args), pdl=self.pdl)

    def close(self) -> None:
        for stream in (self.compute_stream, self.copy_stream):
            self.drv.stream_destroy(stream)
        self.drv.module_unload(self.module)


def attention_smem_bytes(head_dim: int) -> int:
    """q pairs [16][hd] + keys [32][hd + 1] + values [32][hd], fp32."""
    return 4 * (ATT_PAIRS * head_dim + ATT_TILE * (head_dim + 1) + ATT_TILE * head_dim)


def sample_smem_bytes() -> int:
    """candidate keys (u64), weights and running sums (f64)."""
    return 24 * SAMPLE_CAP
