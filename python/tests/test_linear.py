"""flexc.torch.linear_attention / linear_attention_step (gated linear attention, docs/linear.md).

The C++ tests hold the kernels to the tolerance rule against the float64 reference; these check
what the Python layer adds: torch tensors in any layout flexc takes ([B, T, H, D] memory through
transpose, gates broadcast with expand), the final state, the step after a prefill, autograd
(gradients of q, k, v, the gates, and the initial state) and the errors. The GPU cases compare
with a float64 recurrence written here in torch (its autograd gives the gradients), loosely: a
relative rmse of 1% for outputs, 2% (bf16) and 0.5% (fp16) for gradients, several times what
rounding to the input type costs (at most 2^-8 and 2^-11 relative per value, applied to a few
operands on the way); a wrong kernel is off by O(1). The seed is fresh each run (FLEXC_SEED
repeats one); -s prints it and each gradient's error. Skipped without torch or a GPU.
"""
import json
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
def test_the_step_refuses_inputs_that_require_grad():
    q = torch.randn(1, 2, 1, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    state = torch.zeros(1, 2, 64, 64, device="cuda")
    with pytest.raises(flexc.Error, match="linear_attention_step has no backward"):
        linear_attention_step(q, q.detach(), q.detach(), state)
    with torch.no_grad():
        out = linear_attention_step(q, q, q, state)
    assert out.shape == (1, 2, 1, 64) and out.grad_fn is None


# ---- gradients: flexc's backward against the float64 recurrence's autograd on the same inputs

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}  # relative rmse of each gradient


def gate_source(kind, B, H, T, DK, gen):
    """(the float32 tensor a model learns, the function making g of it) for a gate kind: g itself
    per key dim or per step, or a decay per head expanded to [B, H, T]; (None, None) for none."""
    x = torch.randn(B, H, T, DK, generator=gen, device="cuda")
    if kind == "per_dim":
        return torch.nn.functional.logsigmoid(x) / 16, lambda s: s
    if kind == "per_step":
        return torch.nn.functional.logsigmoid(x[..., 0]) / 16, lambda s: s
    if kind == "per_head":
        decay = torch.log(1 - torch.exp2(-5.0 - torch.arange(H, device="cuda")))
        return decay, lambda s: s.view(1, H, 1).expand(B, H, T)
    return None, None


def check_gradients(gates, dtype, B, H, Hk, T, DK, DV, *, state=False, use_out=True,
                    transposed=False, wrt=("q", "k", "v", "g", "h0"), variant=None):
    """Gradients of sum(out * dout) (use_out) + sum(final_state * dstate) (state: with an initial
    state h0) with respect to the inputs named in `wrt` (the others get none), and the output.
    variant: linear_attention's, for flexc's run (a per_head variant makes its own decays)."""
    gen = torch.Generator(device="cuda").manual_seed(SEED)

    def randn(*shape):
        if transposed and len(shape) == 4:  # [B, T, H, D] memory seen as [B, H, T, D]
            b, h, t, d = shape
            return torch.randn(b, t, h, d, generator=gen, device="cuda").transpose(1, 2)
        return torch.randn(*shape, generator=gen, device="cuda")

    inputs = {"q": randn(B, H, T, DK).to(dtype), "k": randn(B, Hk, T, DK).to(dtype),
              "v": randn(B, Hk, T, DV).to(dtype)}
    source, make_g = gate_source(gates, B, H, T, DK, gen)
    if source is not None:
        inputs["g"] = source
    if state:
        inputs["h0"] = torch.randn(B, H, DK, DV, generator=gen, device="cuda") * 0.1
    # The loss's weights, exact in the types of out (the input type) and of the final state.
    dout = torch.randn(B, H, T, DV, generator=gen, device="cuda").to(dtype).double()
    dstate = torch.randn(B, H, DK, DV, generator=gen, device="cuda").double()

    def gradients(run, cast):
        leaves = {n: cast(t).requires_grad_(n in wrt) for n, t in inputs.items()}
        g = make_g(leaves["g"]) if "g" in leaves else None
        if g is not None and g.requires_grad:
            g.retain_grad()  # dg in g's shape, before expand()'s backward sums it into the decay's
        out, final = run(leaves["q"], leaves["k"], leaves["v"], g, leaves.get("h0"))
        loss = (out.double() * dout).sum() if use_out else 0
        if state:
            loss = loss + (final.double() * dstate).sum()
        loss.backward()
        grads = {n: t.grad for n, t in leaves.items()}
        grads["dg"] = None if g is None else g.grad
        grads["out"] = out.detach()
        return grads

    def flexc_run(q, k, v, g, h0):
        if variant is not None and gates == "per_head":
            g = None
        return linear_attention(q, k, v, g, initial_state=h0, output_final_state=state,
                                variant=variant)

    def gold_run(q, k, v, g, h0):
        if g is None:
            g = torch.zeros(B, H, T, DK, dtype=torch.float64, device="cuda")
        elif g.dim() == 3:
            g = g[..., None].expand(B, H, T, DK)
        return recurrence(q, k, v, g, h0, DK ** -0.5)

    got = gradients(flexc_run, lambda t: t.detach().clone())
    want = gradients(gold_run, lambda t: t.detach().double())
    assert rel_rmse(got["out"], want["out"]) < 1e-2, f"out (FLEXC_SEED={SEED})"
    errors = {}
    for n, t in inputs.items():
        if n not in wrt:
            assert got[n] is None, n
            continue
        assert got[n].shape == t.shape and got[n].dtype == t.dtype, n
        assert torch.isfinite(got[n]).all(), f"d{n} is not finite (FLEXC_SEED={SEED})"
        if n == "g" and got[n].shape != got["dg"].shape:
            # A decay per head: its gradient sums terms of both signs over B and T, so its
            # relative error says little (a sum near 0 has a large one). flexc's part is dg in
            # the expanded view's shape, held to the rule; the sum is torch's.
            torch.testing.assert_close(got[n], got["dg"].sum((0, 2)))
            errors[n] = rel_rmse(got["dg"], want["dg"])
        else:
            errors[n] = rel_rmse(got[n], want[n])
    summary = ", ".join(f"d{n} {e:.1e}" for n, e in errors.items())
    print(f"{gates} {dtype} T={T} DK={DK} DV={DV} Hk={Hk}: relative rmse {summary}")
    assert max(errors.values()) <= TOLERANCE[dtype], f"{summary} (FLEXC_SEED={SEED})"


@gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("T", [63, 64, 130])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("gates", ["per_dim", "per_step", "per_head", "none"])
def test_gradients_match_the_recurrence(gates, dtype, T, D):
    check_gradients(gates, dtype, B=2, H=2, Hk=2, T=T, DK=D, DV=D)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("gates", ["per_dim", "per_step", "per_head", "none"])
def test_gradients_with_gqa_states_and_the_transposed_layout(gates, dtype):
    check_gradients(gates, dtype, B=2, H=2, Hk=1, T=130, DK=64, DV=64, state=True,
                    transposed=True)


@gpu
@pytest.mark.parametrize("gates", ["per_dim", "none"])
def test_gradients_of_the_final_state_alone(gates):
    # out is left out of the loss (its gradient is None: the backward takes zeros), and q, which
    # the final state does not depend on, does not require grad.
    check_gradients(gates, torch.bfloat16, B=2, H=2, Hk=2, T=100, DK=64, DV=64, state=True,
                    use_out=False, wrt=("k", "v", "g", "h0"))


# ---- linear-attention configs (docs/linear.md, "Configs"): variant= decides g

CATALOGUE_GATES = {"gla": "per_dim", "simple_gla": "per_step", "retnet": "per_head",
                   "linear": "none"}


@gpu
@pytest.mark.parametrize("name", sorted(CATALOGUE_GATES))
def test_catalogue_variants_match_the_recurrence(name):
    # retnet's decays come from its config (the reference's from gate_source's formula, the
    # same), so they are not trained: no g gradient.
    gates = CATALOGUE_GATES[name]
    wrt = ("q", "k", "v", "h0") + (("g",) if gates in ("per_dim", "per_step") else ())
    check_gradients(gates, torch.bfloat16, B=1, H=2, Hk=2, T=70, DK=64, DV=64, state=True,
                    wrt=wrt, variant="@" + name)


@gpu
def test_a_json_config_gives_its_decays_and_scale(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "kind": "linear", "gate": "per_head",
                                "log_decay": "-0.1 * (h + 1)", "scale": 0.5}))
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    q, k, v = (torch.randn(1, 2, 70, 64, generator=gen, device="cuda").bfloat16()
               for _ in range(3))
    out, _ = linear_attention(q, k, v, variant=str(path))
    g = torch.tensor([-0.1, -0.2], device="cuda").view(1, 2, 1).expand(1, 2, 70)
    want, _ = linear_attention(q, k, v, g, scale=0.5)
    torch.testing.assert_close(out, want)


@gpu
def test_a_feature_map_equals_mapping_q_and_k_first():
    # @linear_elu against elu(x) + 1 applied by torch: outputs, gradients, and the step.
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    q, k, v = (torch.randn(2, 4, 150, 64, generator=gen, device="cuda").bfloat16()
               for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA
    dout = torch.randn(2, 4, 150, 64, generator=gen, device="cuda").bfloat16()
    phi = lambda x: torch.nn.functional.elu(x.float()).add(1).to(x.dtype)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = linear_attention(*ins, variant="@linear_elu")
    grads = torch.autograd.grad(out, ins, dout)
    ref_ins = [t.clone().requires_grad_() for t in (q, k, v)]
    want, _ = linear_attention(phi(ref_ins[0]), phi(ref_ins[1]), ref_ins[2])
    want_grads = torch.autograd.grad(want, ref_ins, dout)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    for got, exp in zip(grads, want_grads):
        torch.testing.assert_close(got, exp, rtol=3e-2, atol=3e-2 * exp.abs().max().item())
    with torch.no_grad():
        state = torch.zeros(2, 4, 64, 64, device="cuda")
        steps = [linear_attention_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                       state, variant="@linear_elu") for t in range(150)]
        torch.testing.assert_close(torch.cat(steps, 2), want, rtol=2e-2,
                                   atol=2e-2 * want.abs().max().item())


@gpu
def test_a_variant_refuses_the_wrong_g():
    q = torch.randn(1, 2, 8, 64, device="cuda", dtype=torch.bfloat16)
    step = torch.zeros(1, 2, 8, device="cuda")
    with pytest.raises(flexc.Error, match=r"variant 'gla' has gate per_dim: g must be "
                       r"\[B, H, T, DK\] = \[1, 2, 8, 64\]; got a tensor of shape \[1, 2, 8\]"):
        linear_attention(q, q, q, step, variant="@gla")
    with pytest.raises(flexc.Error, match=r"gate per_step: g must be \[B, H, T\] = \[1, 2, 8\]; "
                       "got None"):
        linear_attention(q, q, q, variant="@simple_gla")
    with pytest.raises(flexc.Error, match="gate per_head: g must be None"):
        linear_attention(q, q, q, step, variant=flexc.LinearVariant.load("@retnet"))
    with pytest.raises(flexc.Error, match="gate none: g must be None"):
        linear_attention(q, q, q, step, variant="@linear")
    with pytest.raises(flexc.Error, match="variant must be a flexc.LinearVariant"):
        linear_attention(q, q, q, variant=3)
