"""The GPU entry points' tensor handling, on the CPU: any DLPack producer's tensors are read with
their dtype, shape and strides; host memory and unsupported dtypes are refused by name before any
GPU work. (The kernels themselves run in the GPU tests.)"""
import numpy as np
import pytest

import flexc


@pytest.mark.parametrize("dtype, name", [(np.float32, "float32"), (np.int32, "int32"),
                                         (np.float16, "fp16")])
def test_views_keep_dtype_shape_and_strides(dtype, name):
    x = np.arange(2 * 3 * 5 * 8).reshape(2, 3, 5, 8).astype(dtype)
    assert flexc._dlpack_view(x) == (name, [2, 3, 5, 8], [120, 40, 8, 1])
    # A permuted view ([B, S, H, D] memory seen as [B, H, S, D]) and a slice.
    t = x.transpose(0, 2, 1, 3)
    assert flexc._dlpack_view(t) == (name, [2, 5, 3, 8], [120, 8, 40, 1])
    s = x[:, 1:, ::2, :]
    assert flexc._dlpack_view(s) == (name, [2, 2, 3, 8], [120, 40, 16, 1])


def test_unsupported_inputs_are_named():
    with pytest.raises(flexc.Error, match=r"x: DLPack dtype \(code 2, 64 bits, 1 lanes\)"):
        flexc._dlpack_view(np.zeros(4))
    with pytest.raises(flexc.Error, match="x: expected a tensor with __dlpack__"):
        flexc._dlpack_view([1.0, 2.0])


def test_kernels_refuse_host_memory_before_any_gpu_work():
    noop = flexc.Variant.from_catalogue("noop")
    q = np.zeros((1, 2, 16, 64), np.float16)
    with pytest.raises(flexc.Error, match="q is in cpu memory; flexc's kernels take CUDA"):
        flexc.attention(q, q, q, q, noop)
    with pytest.raises(flexc.Error, match="q is in cpu memory; flexc's kernels take CUDA"):
        flexc.attention(q, q, q, q, noop, prepare=True)
    alibi = flexc.Variant.from_catalogue("alibi")
    with pytest.raises(flexc.Error, match=r"captures\['slope'\] is in cpu memory"):
        flexc.attention(q, q, q, q, alibi, captures={"slope": np.zeros(2, np.float32)})
    lens = np.array([16], np.int32)
    with pytest.raises(flexc.Error, match="k is in cpu memory"):
        flexc.decode(q, q, q, lens, q, noop)
    with pytest.raises(flexc.Error, match="k is in cpu memory"):
        flexc.decode(q, q, q, lens, q, noop, prepare=True)
    with pytest.raises(flexc.Error, match="dq is in cpu memory"):
        flexc.attention_backward(q, q, q, q, np.zeros((1, 2, 16), np.float32), q, q, q, q, noop)


def test_raw_views_from_flexc_torch():
    # flexc.torch hands tensors over as (data_ptr, dtype, shape, strides, device) tuples.
    assert flexc._dlpack_view((4096, "bf16", (2, 5, 3, 8), (120, 8, 40, 1), 0)) == \
        ("bf16", [2, 5, 3, 8], [120, 8, 40, 1])
    with pytest.raises(flexc.Error, match="x: a raw view is .* got a tuple of 2"):
        flexc._dlpack_view((4096, "bf16"))
    with pytest.raises(flexc.Error, match="unknown dtype|dtype"):
        flexc._dlpack_view((4096, "torch.int64", (2,), (1,), 0))
    noop = flexc.Variant.from_catalogue("noop")
    a = (4096, "bf16", (1, 2, 16, 64), (2048, 1024, 64, 1), 0)
    b = (4096, "bf16", (1, 2, 16, 64), (2048, 1024, 64, 1), 1)
    with pytest.raises(flexc.Error, match="k is on CUDA device 1, other tensors on device 0"):
        flexc.attention(a, b, a, a, noop)
