"""Every CUDA kernel's host-side signature: its name and parameters in order, with C types.

One table is shared by the real driver (argument packing), the fake driver (which runs a
numpy twin of each kernel by parameter name) and tests/test_cuda_build.py (which checks each
entry against the compiled PTX, so host and device can never disagree on an argument).

Type codes: "p" device pointer (u64), "i" int32, "f" float32.
"""

from typing import NamedTuple, Optional

SOURCE_FILES = ("common.cuh", "activation.cu", "attention.cu", "dense_matmul.cu", "embed.cu",
                "int4_matmul.cu", "rmsnorm.cu", "rope_kv.cu", "sampling.cu")

_MATMUL_INT4 = ("x:p ldx:i M:i qw:p sz:p num_units:i group_size:i units_per_split:i bias:p y:p ldy:i N:i "
                "accumulate:i ws:p counters:p")
# the fused decoder products (int4_matmul.cu "fused kernels"): the plain product's parameters, then
# the RMSNorm prologue's, the RoPE/KV epilogue's and the argmax epilogue's (0 where unused)
_MATMUL_FUSED = (_MATMUL_INT4 + " norm_w:p norm_dim:i eps:f positions:p slot_mapping:p cos_sin:p max_positions:i "
                 "q_out:p ldq:i k_cache:p v_cache:p num_heads:i num_kv_heads:i head_dim:i argmax_keys:p "
                 "argmax_counters:p tokens:p")
FUSED_EPILOGUES = ("rope_f32", "rope_f16", "silu", "gelu", "argmax")
_DENSE = "x:p ldx:i M:i w:p ldw:i row_scales:p bias:p y:p ldy:i N:i accumulate:i"
_EMBED = "token_ids:p table:p scales:p zeros:p ldw:i group_size:i vocab_size:i D:i multiplier:f out:p ldo:i"
_ROPE = ("qkv:p ldqkv:i positions:p slot_mapping:p cos_sin:p max_positions:i q_out:p ldq:i "
         "k_cache:p v_cache:p num_heads:i num_kv_heads:i head_dim:i")
_ATTENTION = ("q:p ldq:i k_cache:p v_cache:p block_tables:p ld_bt:i positions:p items:p out:p ldo:i "
              "ws_ml:p ws_acc:p max_splits:i num_heads:i num_kv_heads:i head_dim:i block_size:i "
              "heads_per_block:i sliding_window:i scale:f softcap:f split_size:i")
_GLU = "gate_up:p ldg:i out:p ldo:i I:i"
_ATTENTION_FUSED = _ATTENTION + " counters:p"

# ------------------------------------------------------------------ the INT4 tensor-core products

# launch constants the host must agree on with int4_matmul.cu
MM_ROWS = 128                           # weight rows per block
# kernel families by activation mode: (tokens per block, family), smallest first
MM_KERNELS = {"exact": ((4, "int4_mm_tc_x4"), (8, "int4_mm_tc_x8"), (16, "int4_mm_tc_x16"), (64, "int4_mm_tc_x64")),
              "fp16": ((8, "int4_mm_tc_h8"), (16, "int4_mm_tc_h16"), (64, "int4_mm_tc_h64"))}
TC_GROUP_SIZES = (32, 64, 128)
# families compiled once per group size (int4_matmul.cu SPG: the group bookkeeping fixed at compile
# time), their kernels named "<family>g<group size>"; the others read the group size at run time
MM_BY_GROUP = ("int4_mm_tc_x4", "int4_mm_tc_x8", "int4_mm_tc_x16")
# a fused product's tile of up to this many tokens normalises its activations itself; a larger
# tile's fused kernel ("_xn") takes them normalised (forward.py runs rmsnorm first)
FUSED_NORM_TOKENS = 16
# the products' experiments (int4_matmul.cu ASYNC and PROBE): variant -> {kernel: its twin}, the
# twin computing what its kernel does (forward.py MM_VARIANT); and family -> its weight-stream
# probes (the same grid and loads, nothing computed: `bench engine --backend cuda --mm-probe`)
MM_VARIANTS = {"r": {"int4_mm_tc_x4g64": "int4_mm_tc_x4g64r"}}   # r: x4's units in registers, not cp.async
MM_PROBES = {"int4_mm_tc_x4": ("int4_mm_tc_x4p",)}
# blocks a SM the products' K split plans one wave of (forward.py), by family ("": the others): the
# x4 kernels (cp.async: 64 registers, 45 KB of shared memory) fit 4, the others 2-3
MM_BLOCKS_PER_SM = {"int4_mm_tc_x4": 4, "": 3}


def mm_kernel(family: str, group_size: int) -> str:
    """The product kernel of a family for a weight's group size."""
    return f"{family}g{group_size}" if family in MM_BY_GROUP else family


def fused_kernel(kernel: str, tokens: int, epilogue: str) -> str:
    """The fused twin of an INT4 product kernel whose tile is `tokens` tokens."""
    return f"{kernel}_{epilogue}" + ("_xn" if tokens > FUSED_NORM_TOKENS else "")


class MMProduct(NamedTuple):
    family: str
    tokens: int                         # per block
    fp16: bool                          # one fp16 column per token (else the exact hi/lo pair)
    epilogue: Optional[str]             # fused: rope_f32 | rope_f16 | silu | gelu | argmax


def _mm_products() -> dict:
    out = {}
    for mode, families in MM_KERNELS.items():
        for tokens, family in families:
            groups = TC_GROUP_SIZES if family in MM_BY_GROUP else (None,)
            kernels = [mm_kernel(family, g) if g else family for g in groups]
            kernels += [twin for k in kernels for v in MM_VARIANTS.values() for plain, twin in v.items() if plain == k]
            for k in kernels:
                out[k] = MMProduct(family, tokens, mode == "fp16", None)
                out.update({fused_kernel(k, tokens, e): MMProduct(family, tokens, mode == "fp16", e)
                            for e in FUSED_EPILOGUES})
    return out


# every INT4 product kernel a step may launch, by name (the fake driver's twins, the bench's families)
MM_PRODUCTS = _mm_products()

SIGNATURES = {
    **{name: _MATMUL_FUSED if p.epilogue else _MATMUL_INT4 for name, p in MM_PRODUCTS.items()},
    **{probe: _MATMUL_INT4 for probes in MM_PROBES.values() for probe in probes},
    "int4_mm_simt": ("x:p ldx:i M:i qweight:p scales:p zeros:p words_per_row:i group_size:i "
                     "bias:p y:p ldy:i N:i accumulate:i"),
    "int4_repack_tc": ("qweight:p scales:p zeros:p N:i Kb:i num_src_groups:i qw:p sz:p "
                       "num_tiles:i num_chunks:i num_groups:i"),
    "dense_mm_f32": _DENSE,
    "dense_mm_f16": _DENSE,
    "dense_mm_i8": _DENSE,
    "embed_f32": _EMBED,
    "embed_f16": _EMBED,
    "embed_i8": _EMBED,
    "embed_i4": _EMBED,
    "rmsnorm": "x:p ldx:i rows:p w:p out:p ldo:i D:i eps:f accumulate:i",
    "head_rmsnorm": "qkv:p ldqkv:i q_norm:p k_norm:p num_heads:i head_dim:i eps:f",
    "logit_softcap": "logits:p ldl:i vocab_size:i cap:f",
    "glu_silu": _GLU,
    "glu_gelu_tanh": _GLU,
    "rope_kv_append_f32": _ROPE,
    "rope_kv_append_f16": _ROPE,
    "attention_paged_f32": _ATTENTION,
    "attention_paged_f16": _ATTENTION,
    "attention_paged_fused_f32": _ATTENTION_FUSED,
    "attention_paged_fused_f16": _ATTENTION_FUSED,
    "attention_combine": "ws_ml:p ws_acc:p num_splits:i max_splits:i out:p ldo:i num_heads:i head_dim:i",
    "apply_penalties": "logits:p plogits:p ldl:i vocab_size:i fparams:p iparams:p row_ptr:p entries:p",
    "argmax_rows": "logits:p ldl:i vocab_size:i tokens:p",
    "sample_tokens": "logits:p plogits:p ldl:i vocab_size:i dparams:p iparams:p rng:p tokens:p",
    "compute_logprobs": ("logits:p ldl:i vocab_size:i iparams:p tokens:p token_logprob:p "
                         "top_ids:p top_logprobs:p"),
}

# launch constants the host must agree on with the sources
SIMT_MT = DENSE_MT = 8                  # tokens per block of the SIMT / dense kernels
ATT_PAIRS, ATT_TILE = 16, 32            # attention: (query, head) pairs per block, keys per tile
SAMPLE_CAP = 2048                       # sample_tokens: candidates sorted in shared memory
MAX_TOP_LOGPROBS = 20


class KernelSpec(NamedTuple):
    name: str
    param_names: tuple
    param_types: str                    # one code per parameter
    name_set: frozenset                 # param_names, for the launch's one-comparison check

    def bind(self, **kwargs) -> tuple:
        """Arguments in kernel order from keywords; a missing or unknown name is an error."""
        if kwargs.keys() == self.name_set:                    # every launch but a wrong one
            return tuple(map(kwargs.__getitem__, self.param_names))
        unknown = set(kwargs) - set(self.param_names)
        missing = [n for n in self.param_names if n not in kwargs]
        if unknown or missing:
            raise TypeError(f"kernel {self.name}: unknown arguments {sorted(unknown)}, missing {missing}")
        return tuple(kwargs[n] for n in self.param_names)


def _spec(name: str, text: str) -> KernelSpec:
    names, types = zip(*(p.split(":") for p in text.split()))
    return KernelSpec(name, tuple(names), "".join(types), frozenset(names))


SPECS = {name: _spec(name, text) for name, text in SIGNATURES.items()}
