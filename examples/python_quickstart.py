"""flexc from PyTorch: ALiBi with a causal mask, forward and backward (README's quick start)."""
import torch
from flexc.torch import create_block_mask, flex_attention

q, k, v = (torch.randn(2, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
slope = torch.rand(8, device="cuda", requires_grad=True)  # one ALiBi slope per head, learned
mask = create_block_mask("q_idx >= kv_idx", B=None, H=None, Q_LEN=4096, KV_LEN=4096)
out = flex_attention(q, k, v, score_mod="score + slope[h] * float(kv_idx - q_idx)",
                     block_mask=mask, captures={"slope": slope})
out.float().square().mean().backward()  # flexc's backward kernels: q, k, v and slope get .grad
print(out.shape, q.grad.norm().item(), slope.grad)
