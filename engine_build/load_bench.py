"""Engine load time, measured against a copying reader in the same run.

    python -m tokenwire.engine_build.load_bench [--dir DIR] [--repeat N]

Writes a random-weight INT4 engine of Qwen2.5-0.5B's shape (hidden 896, intermediate 4864,
24 layers, 14 heads, 2 KV heads, head_dim 64, vocab 151936, tied fp16 embedding, group 64)
— random 4-bit codes and scales: load time does not depend on the values, and quantizing
half a billion weights with the numpy quantizer would take minutes — then times:
- `load_engine` (manifest, header checks, mmap, zero-copy views; the tokenizer loads lazily);
- the first full read of every tensor through those views (what the mapping defers);
- `safetensors.numpy.load_file` of the same file (a copying reader), as the reference;
- loading the tokenizer (here the default model's small one, so this is a lower bound).
The page cache is warm (the file was just written), so these are warm-start figures.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from ..core.config import ModelConfig
from ..kernels.engine_format import canonical_shapes, load_engine
from .default_model import default_tokenizer_files
from .engine_writer import write_engine

QWEN25_05B = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_ids=(151645, 151643))
GROUP_SIZE = 64


def random_int4_engine(out_dir: Path, config: ModelConfig = QWEN25_05B, seed: int = 0) -> Path:
    """Write a random-code INT4 engine of `config` (the encodings of docs/ENGINE_FORMAT.md)."""
    rng = np.random.default_rng(seed)
    tensors, meta = {}, {}
    for name, shape in canonical_shapes(config).items():
        if len(shape) == 1:
            tensors[name] = np.ones(shape, dtype=np.float32)
            meta[name] = {"kind": "dense", "shape": list(shape)}
        elif name == "embed":
            tensors[f"{name}.weight"] = (rng.random(shape, dtype=np.float32) * 0.04 - 0.02).astype(np.float16)
            meta[name] = {"kind": "dense", "shape": list(shape)}
        else:
            n, k = shape
            groups = -(-k // GROUP_SIZE)
            tensors[f"{name}.qweight"] = rng.integers(0, 256, size=(n, groups * GROUP_SIZE // 2), dtype=np.uint8)
            tensors[f"{name}.scales"] = np.full((n, groups), 0.002, dtype=np.float16)
            tensors[f"{name}.zeros"] = np.full((n, groups), 8, dtype=np.float16)
            meta[name] = {"kind": "int4", "shape": list(shape)}
    quantization = {"method": "int4", "group_size": GROUP_SIZE, "symmetric": True, "algorithm": "rtn",
                    "embedding": "fp16", "lm_head": "fp16"}
    return write_engine(out_dir, name="load-bench-qwen2.5-0.5b-shape", description="random INT4 codes, for timing",
                        config=config, quantization=quantization, tokenizer=default_tokenizer_files(),
                        source={"path": "random", "kind": "default", "sha256": "0" * 64}, tensors=tensors,
                        tensor_meta=meta)


def time_it(fn, repeat: int) -> float:
    """Median seconds of `repeat` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def touch_all(engine) -> int:
    """Read every byte of every tensor once (sums one value per 4 KiB page)."""
    total = 0
    for array in engine.tensors.values():
        flat = array.reshape(-1).view(np.uint8)
        total += int(flat[::4096].sum())
    return total


def main(argv=None) -> int:

    parser = argparse.ArgumentParser(description="engine load time vs a copying safetensors reader")
    parser.add_argument("--dir", help="where to write the engine (default: a temporary directory)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        t0 = time.perf_counter()
        path = random_int4_engine(Path(tmp) / "engine")
        size = (path / "weights.safetensors").stat().st_size
        print(f"wrote {size / 2**20:.0f} MiB engine ({QWEN25_05B.num_layers} layers, Qwen2.5-0.5B shape) "
              f"in {time.perf_counter() - t0:.1f} s")
        load = time_it(lambda: load_engine(path), args.repeat)
        engine = load_engine(path)
        first_touch = time_it(lambda: touch_all(engine), 1)          # page faults into the (warm) page cache
        touch = time_it(lambda: touch_all(engine), args.repeat)
        copy = time_it(lambda: load_file(str(path / "weights.safetensors")), args.repeat)
        tok = time_it(lambda: Tokenizer.from_file(str(path / "tokenizer.json")), args.repeat)
        print(f"load_engine (mmap, zero-copy views, checks): {load * 1e3:8.2f} ms")
        print(f"first touch of every page through the views:  {first_touch * 1e3:8.2f} ms (again: {touch * 1e3:.2f} ms)")
        print(f"reference: safetensors.numpy.load_file (copy): {copy * 1e3:8.2f} ms  "
              f"({copy / load:.0f}x the load_engine time)")
        print(f"tokenizer load (small default tokenizer):      {tok * 1e3:8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
