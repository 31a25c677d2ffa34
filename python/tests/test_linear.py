"""flexc.torch.linear_attention / linear_attention_step (gated linear attention, docs/linear.md).

The C++ tests hold the kernels to the tolerance rule against the float64 reference; these check
what the Python layer adds: torch tensors in any layout flexc takes ([B, T, H, D] memory through
transpose, gates broadcast with expand), the final state, the step after a prefill, and the
errors. The GPU cases compare with a float64 recurrence written here in torch, loosely (bf16
rounding is ~0.4% per value; a wrong kernel is off by O(1)). Skipped without torch or a GPU.
"""
import os
import random

import pytest

torch = pytest.importorskip("torch")

import flexc  # noqa: E402
from flexc.torch import linear_attention, linear_attention_step  # noqa: E402

SEED = int(os.environ.get("FLEXC_SEED", random.randrange(1 << 30)))
print(f"test_linear seed: FLEXC_SEED={SEED}")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


def recurrence(q, k, v, g, h0, scale):
    """float64 S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t, o_t = scale q_t S_t; g [B, H, T, DK]."""
    B, H, T, DK = q.shape
    hk = k.shape[1]
    k = k.repeat_interleave(H // hk, dim=1).double()
    v = v.repeat_interleave(H // hk, dim=1).double()
    q, g = q.double(), g.double()
    S = torch.zeros(B, H, DK, v.shape[-1], dtype=torch.float64, device=q.device)
    if h0 is not None:
        S = S + h0.double()
    out = []
    for t in range(T):
        S = torch.exp(g[:, :, t, :, None]) * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        out.append(scale * torch.einsum("bhd,bhde->bhe", q[:, :, t], S))
    return torch.stack(out, dim=2), S


def rel_rmse(x, ref):
    return ((x.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def test_cpu_tensors_and_bad_shapes_are_errors():
    q = torch.zeros(1, 2, 8, 64)
    with pytest.raises(flexc.Error, match="q must be a torch tensor on q's CUDA device"):
        linear_attention(q, q, q)
    if torch.cuda.is_available():
        c = q.cuda().bfloat16()
        with pytest.raises(flexc.Error, match="g must be a torch tensor on q's CUDA device"):
            linear_attention(c, c, c, torch.zeros(1, 2, 8))
        with pytest.raises(flexc.Error, match="k must be 4-d"):
            linear_attention(c, c[0], c)


@gpu
@pytest.mark.parametrize("gates", ["per_dim", "per_step", "per_head", "none"])
def test_matches_the_recurrence_in_torch_layouts(gates):
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    B, T, H, Hk, DK, DV = 2, 200, 4, 2, 64, 128
    # [B, T, H, D] memory (fla's layout), seen as [B, H, T, D].
    q = torch.randn(B, T, H, DK, generator=gen, device="cuda").bfloat16().transpose(1, 2)
    k = torch.randn(B, T, Hk, DK, generator=gen, device="cuda").bfloat16().transpose(1, 2)
    v = torch.randn(B, T, Hk, DV, generator=gen, device="cuda").bfloat16().transpose(1, 2)
    x = torch.randn(B, H, T, DK, generator=gen, device="cuda")
    if gates == "per_dim":
        g = torch.nn.functional.logsigmoid(x) / 16
        full = g
    elif gates == "per_step":
        g = torch.nn.functional.logsigmoid(x[..., 0]) / 16
        full = g[..., None].expand(B, H, T, DK)
    elif gates == "per_head":
        decay = torch.log(1 - torch.exp2(-5.0 - torch.arange(H, device="cuda")))
        g = decay.view(1, H, 1).expand(B, H, T)
        full = g[..., None].expand(B, H, T, DK)
    else:
        g, full = None, torch.zeros(B, H, T, DK, device="cuda")
    h0 = torch.randn(B, H, DK, DV, generator=gen, device="cuda") * 0.1
    out, final = linear_attention(q, k, v, g, initial_state=h0, output_final_state=True)
    ref_out, ref_state = recurrence(q, k, v, full, h0, DK ** -0.5)
    assert out.shape == (B, H, T, DV) and out.dtype == torch.bfloat16
    assert final.shape == (B, H, DK, DV) and final.dtype == torch.float32
    assert rel_rmse(out, ref_out) < 1e-2
    assert rel_rmse(final, ref_state) < 1e-2
    # Decoding on from the final state: three single steps equal the recurrence continued.
    q1, k1, v1 = (torch.randn(B, n, 3, d, generator=gen, device="cuda").bfloat16()
                  for n, d in ((H, DK), (Hk, DK), (Hk, DV)))
    g1 = None if g is None else (full[:, :, :3] if gates == "per_dim" else full[:, :, :3, 0])
    state = final.clone()
    steps = [linear_attention_step(q1[:, :, t:t + 1], k1[:, :, t:t + 1], v1[:, :, t:t + 1], state,
                                   None if g1 is None else g1[:, :, t:t + 1])
             for t in range(3)]
    ref_steps, ref_end = recurrence(q1, k1, v1, full[:, :, :3], final, DK ** -0.5)
    assert rel_rmse(torch.cat(steps, dim=2), ref_steps) < 1e-2
    assert rel_rmse(state, ref_end) < 1e-2


@gpu
def test_inputs_that_require_grad_are_refused():
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(flexc.Error, match="no backward yet"):
        linear_attention(q, q.detach(), q.detach())
    with torch.no_grad():
        out, final = linear_attention(q, q, q)
    assert final is None and out.shape == (1, 2, 64, 64)
