"""flexc: attention variants written as two expressions, JIT-compiled into fused GPU kernels.

    import flexc
    alibi = flexc.Variant.from_strings("score + slope[h] * (kv_idx - q_idx)", "q_idx >= kv_idx",
                                       [flexc.CaptureSpec("slope", "float32", ["H"])])
    mask = flexc.create_block_mask(alibi, B=1, H=8, q_len=4096, kv_len=4096)
    print(mask.sparsity(), mask.to_string())
    ptx = flexc.compile(alibi, "attention_fwd", arch="sm_90").ptx

This module is the CPU side of the C++ library (variants, linear-attention configs, ahead-of-time
compilation, BlockMasks on the CPU, the float64 reference); errors raise flexc.Error (a
ValueError) with flexc's message. See docs/python.md.
"""
import importlib.util
import os

import numpy as np

from . import _flexc
from ._flexc import (  # noqa: F401  (the public names)
    BlockMask,
    CaptureSpec,
    CompiledKernel,
    Error,
    KernelInfo,
    LinearVariant,
    ParamSpec,
    Precision,
    RingAttention,
    RingBlock,
    RingPlan,
    RingStats,
    RingStep,
    TileKind,
    Variant,
    _dlpack_view,
    _reference_attention,
    attention,
    attention_backward,
    compile,
    compose,
    create_block_mask,
    decode,
    kernel_templates,
    linear_attention,
    linear_attention_backward,
    linear_attention_step,
    plan_ring,
)


def _nvrtc_wheel_dirs():
    """lib/ of NVIDIA's NVRTC wheels (nvidia-cuda-nvrtc: nvidia/cu13; the CUDA 12 one:
    nvidia/cuda_nvrtc), searched after the CUDA toolkit: a pip user needs no toolkit."""
    for package in ("nvidia.cu13", "nvidia.cuda_nvrtc"):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        for root in (spec.submodule_search_locations or []) if spec else []:
            lib = os.path.join(root, "lib")
            if os.path.isdir(lib):
                yield lib


for _dir in _nvrtc_wheel_dirs():
    _flexc.add_nvrtc_search_dir(_dir)


def _kv_lists(self):
    """FlexAttention's (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), int32,
    shaped [nb, nh, num_q_tiles] and [nb, nh, num_q_tiles, num_kv_tiles]."""
    nb, nh = self.shape[0], self.shape[1]
    nq, nk = self.num_tiles
    rows, idx = (nb, nh, nq), (nb, nh, nq, nk)
    return tuple(np.frombuffer(raw, dtype=np.int32).reshape(shape)
                 for raw, shape in zip(self._kv_lists_raw(), (rows, idx, rows, idx)))


BlockMask.kv_lists = _kv_lists


def reference_attention(variant, q, k, v, captures=None, params=None, scale=None, dtype="bf16"):
    """flexc's float64 CPU oracle on numpy arrays q [B, Hq, Q_LEN, D], k [B, Hkv, KV_LEN, D],
    v [B, Hkv, KV_LEN, Dv] (taken as float32): (out [B, Hq, Q_LEN, Dv], lse [B, Hq, Q_LEN]),
    float64, LSE in natural log and -inf for a row with no unmasked element."""
    as32 = lambda x: np.ascontiguousarray(x, dtype=np.float32)  # noqa: E731
    out, lse, shape = _reference_attention(variant, as32(q), as32(k), as32(v), captures or {},
                                           params or {}, scale, dtype)
    return (np.frombuffer(out, dtype=np.float64).reshape(shape),
            np.frombuffer(lse, dtype=np.float64).reshape(shape[:3]))

__all__ = [
    "BlockMask", "CaptureSpec", "CompiledKernel", "Error", "KernelInfo", "LinearVariant",
    "ParamSpec", "Precision", "RingAttention", "RingBlock", "RingPlan", "RingStats", "RingStep",
    "TileKind", "Variant",
    "attention", "attention_backward", "compile", "compose", "create_block_mask", "decode",
    "kernel_templates", "linear_attention", "linear_attention_backward", "linear_attention_step",
    "plan_ring", "reference_attention",
]
# flexc.torch (FlexAttention's API on torch tensors) is imported on its own: `import flexc.torch`.
