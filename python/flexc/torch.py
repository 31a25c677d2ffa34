"""flexc.torch: FlexAttention's API on flexc's kernels. Switch with one import:

    from flexc.torch import flex_attention, create_block_mask   # was torch.nn.attention.flex_attention

    mask = create_block_mask("q_idx >= kv_idx", B=None, H=None, Q_LEN=4096, KV_LEN=4096)
    out = flex_attention(q, k, v, score_mod="score + slope[h] * (kv_idx - q_idx)",
                         block_mask=mask, captures={"slope": slopes})
    out.sum().backward()          # flexc's backward kernels; slopes.grad too

Mods are flexc expressions (strings, docs/dsl.md) or flexc.Variant objects, not Python callables;
the tensors they read are passed by name (`captures`), scalars likewise (`params`, runtime: a new
value never recompiles). Kernels run on torch's current stream; temporaries come from torch's
caching allocator. The call is a torch custom op with an autograd formula, so torch.compile traces
a model that calls it without a graph break. See docs/python.md.
"""
from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from . import _flexc
from ._flexc import CaptureSpec, Error, LinearVariant, ParamSpec, Variant

__all__ = ["BlockMask", "create_block_mask", "flex_attention", "ring_attention", "ring_shard"]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bf16", torch.float16: "fp16",
                torch.int32: "int32", torch.bool: "bool"}
# Converted on each call (a copy): flexc's captures are 32-bit.
_NARROWED = {torch.int64: torch.int32, torch.float64: torch.float32}


# ---- variants. flex_attention names its variant by a key string made of the mods' texts and the
# declarations (plain tuples: torch.compile traces this part as constants); the flexc.Variant is
# made from the key where the kernels run, once per process.

def _mod_text(mod, which):
    """(text, capture decls, param decls) of a mod given as a string or a flexc.Variant. Decls
    are tuples by name: capture (name, dtype, dims), param (name, type, default, const)."""
    if isinstance(mod, str):
        return mod, {}, {}
    if isinstance(mod, Variant):
        text = mod.score_mod if which == "score" else mod.mask_mod
        return (text, {c.name: (c.name, c.dtype, tuple(c.dims)) for c in mod.captures},
                {p.name: (p.name, p.type, float(p.default), bool(p.const)) for p in mod.params})
    raise Error(f"{which}_mod must be a flexc expression (str) or a flexc.Variant; got "
                f"{type(mod).__name__} (flexc compiles expressions, not Python functions)")


def _capture_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise Error(f"captures['{name}'] must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype in _NARROWED:
        t = t.to(_NARROWED[t.dtype])
    if t.dtype not in _DTYPE_NAMES:
        raise Error(f"captures['{name}'] is {t.dtype}; flexc reads float32, bfloat16, float16, "
                    "int32 (int64 is narrowed) and bool")
    return t


def _inferred_decl(name, t, sizes):
    """A capture's declaration from its tensor: each dim named by the first of the call's sizes
    (KV_LEN, Q_LEN, H, B) it equals, else its number. A name keeps the kernel the same across
    sequence lengths; where two names fit, either reads the same elements."""
    if t.dim() < 1 or t.dim() > 4:
        raise Error(f"captures['{name}'] has {t.dim()} dims; a capture has 1 to 4 (pass a scalar "
                    "in params)")
    dims = []
    for d in t.shape:
        sym = str(d)
        for s, n in sizes:
            if n == d:
                sym = s
                break
        dims.append(sym)
    return (name, _DTYPE_NAMES[t.dtype], tuple(dims))


def _param_decl(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Error(f"params['{name}'] must be an int or a float; got {type(value).__name__}")
    return (name, "int" if isinstance(value, int) else "float", 0.0, False)


def _declare(sources, captures, params, sizes):
    """Capture and param declarations: those of Variant sources as declared, the rest inferred
    from the tensors and values passed. Returns (capture decls, tensors, param decls)."""
    capture_decls, param_decls = {}, {}
    for decls_c, decls_p in sources:
        capture_decls.update(decls_c)
        param_decls.update(decls_p)
    tensors = {}
    for n, t in (captures or {}).items():
        tensors[n] = _capture_tensor(n, t)
        if n not in capture_decls:
            capture_decls[n] = _inferred_decl(n, tensors[n], sizes)
    for n, value in (params or {}).items():
        if n not in param_decls:
            param_decls[n] = _param_decl(n, value)
    return capture_decls, tensors, param_decls


_SEP = "\x1f"  # between the key's fields; no flexc expression contains it


def _key(score, mask, capture_decls, param_decls):
    parts = [score, mask]
    for n in sorted(capture_decls):
        c = capture_decls[n]
        parts.append("c:" + n + ":" + c[1] + ":" + ",".join(c[2]))
    for n in sorted(param_decls):
        p = param_decls[n]
        parts.append("p:" + n + ":" + p[1] + ":" + str(float(p[2])) + ":" + ("1" if p[3] else "0"))
    return _SEP.join(parts)


@dataclass(frozen=True)
class _Entry:
    variant: Variant
    capture_names: tuple  # the order of the custom op's capture list (sorted)
    param_names: tuple    # the runtime params, sorted: the order of its param values


_VARIANTS: dict = {}


def _lookup(key):
    entry = _VARIANTS.get(key)
    if entry is None:
        score, mask, *decls = key.split(_SEP)
        caps, pars = [], []
        for d in decls:
            kind, name, typ, rest = d.split(":", 3)
            if kind == "c":
                caps.append(CaptureSpec(name, typ, rest.split(",")))
            else:
                default, const = rest.rsplit(":", 1)
                pars.append(ParamSpec(name, typ, float(default), const == "1"))
        variant = Variant.from_strings(score, mask, caps, pars, name="torch")
        entry = _Entry(variant, tuple(c.name for c in caps),
                       tuple(p.name for p in pars if not p.const))
        _VARIANTS[key] = entry
    return entry


def _names(capture_decls, param_decls):
    """The capture and runtime-param orders of _lookup's entry, from the declarations alone."""
    return sorted(capture_decls), [n for n in sorted(param_decls) if not param_decls[n][3]]


def _stream(device):
    return torch.cuda.current_stream(device).cuda_stream


# torch's current stream as an int, and raw views of CUDA tensors for flexc's binding (a
# tuple: data_ptr, dtype, shape, strides, device). Both skip Python objects that cost tens of
# microseconds a call (a Stream object; __dlpack__, which also refuses tensors that require grad).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_of(t):
    return _raw_stream(t.get_device()) if _raw_stream else _stream(t.device)


def _raw(t):
    return (t.data_ptr(), _DTYPE_NAMES.get(t.dtype, str(t.dtype)), t.shape, t.stride(),
            t.get_device())


def _raw_opt(t):
    return None if t is None else _raw(t)


# ---- BlockMask

_MASKS: "weakref.WeakValueDictionary[int, BlockMask]" = weakref.WeakValueDictionary()
_mask_ids = itertools.count(1)


class BlockMask:
    """flexc's BlockMask (which tiles to compute) with the mask_mod, captures and params it was
    built from, as FlexAttention's BlockMask carries its mask_mod. Make one with
    create_block_mask; flex_attention applies its mask_mod."""

    def __init__(self, mask, mask_mod, capture_decls, captures, param_decls, params):
        self._mask = mask
        self.mask_mod = mask_mod
        self._capture_decls, self._captures = capture_decls, captures
        self._param_decls, self._params = param_decls, dict(params or {})
        self._id = next(_mask_ids)
        _MASKS[self._id] = self
        # The id as a tensor: torch.compile takes tensors as graph inputs, so a new mask does not
        # retrace a compiled model (a Python int would be a constant guarded on).
        self._handle = torch.tensor([self._id], dtype=torch.int64)

    @property
    def shape(self):
        return self._mask.shape

    @property
    def BLOCK_SIZE(self):  # noqa: N802 (FlexAttention's name)
        return self._mask.tile_size

    def sparsity(self):
        return self._mask.sparsity()

    def to_string(self, max_rows=32, max_cols=32, max_heads=4):
        return self._mask.to_string(max_rows, max_cols, max_heads)

    def kv_lists(self):
        """FlexAttention's (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)."""
        return tuple(torch.from_numpy(x) for x in self._mask.kv_lists())

    def __repr__(self):
        return f"flexc.torch.BlockMask(mask_mod={self.mask_mod!r}, shape={self.shape}, " \
               f"sparsity={self.sparsity():.2f}%)\n{self._mask!r}"


def _mask_of(handle):
    """The flexc BlockMask of a BlockMask (eager calls) or of its handle (the custom op's)."""
    if handle is None:
        return None
    if isinstance(handle, BlockMask):
        return handle._mask
    mask = _MASKS.get(int(handle.item()))
    if mask is None:
        raise Error("flex_attention: the BlockMask this call was traced with no longer exists")
    return mask._mask


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cuda", BLOCK_SIZE=128, *,
                      captures=None, params=None, q_offset=0):
    """FlexAttention's create_block_mask for a flexc mask_mod (str or flexc.Variant). B / H None:
    the mask is the same for every batch / head. device: a CUDA device builds on the GPU on
    torch's current stream (the captures' host copies are read once for the interval
    analysis), "cpu" on the CPU. BLOCK_SIZE: an int or (q, kv) tile sizes; q_offset: the
    position of query 0 (chunked prefill)."""
    text, decl_c, decl_p = _mod_text(mask_mod, "mask")
    nb, nh = 1 if B is None else int(B), 1 if H is None else int(H)
    sizes = (("KV_LEN", KV_LEN), ("Q_LEN", Q_LEN + q_offset), ("H", nh), ("B", nb))
    capture_decls, tensors, param_decls = _declare([(decl_c, decl_p)], captures, params, sizes)
    variant = _lookup(_key("score", text, capture_decls, param_decls)).variant
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise Error(f"create_block_mask: device must be a CUDA device or 'cpu'; got {device}")
    q_tile, kv_tile = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    host, on_device = {}, {}
    for n, t in tensors.items():
        dev = t.detach().contiguous()
        if device.type == "cuda":
            dev = dev.to(device)
            on_device[n] = dev
        cpu = dev.cpu()
        host[n] = (cpu.view(torch.int16) if cpu.dtype == torch.bfloat16 else cpu).numpy()
    args = dict(captures=host, params=params or {}, q_tile=q_tile, kv_tile=kv_tile,
                q_offset=q_offset)
    if device.type == "cuda":
        with torch.cuda.device(device):
            mask = _flexc.create_block_mask(variant, nb, nh, Q_LEN, KV_LEN, **args, device="gpu",
                                            device_captures=on_device, stream=_stream(device))
    else:
        mask = _flexc.create_block_mask(variant, nb, nh, Q_LEN, KV_LEN, **args)
    return BlockMask(mask, text, capture_decls, tensors, param_decls, params)


# ---- the kernels

def _out_like(q, dv):
    """An output [B, H, L, dv] in q's memory order (a permuted [B, L, H, D] query gives a
    permuted output, as FlexAttention's does)."""
    shape = list(q.shape)
    if q.is_contiguous():
        shape[3] = dv
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    order = sorted(range(4), key=lambda i: (-q.stride(i), i))
    shape[3] = dv
    out = torch.empty([shape[i] for i in order], dtype=q.dtype, device=q.device)
    return out.permute([order.index(i) for i in range(4)])


def _forward(q, k, v, captures, mask_handle, key, scale, params, kernel):
    entry = _lookup(key)
    out = _out_like(q, v.shape[-1])
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    _flexc.attention(_raw(q), _raw(k), _raw(v), _raw(out), entry.variant,
                     block_mask=_mask_of(mask_handle),
                     captures={n: _raw(c) for n, c in zip(entry.capture_names, captures)},
                     params=dict(zip(entry.param_names, params)), scale=scale, lse=_raw(lse),
                     stream=_stream_of(q), kernel=kernel)
    return out, lse


def _backward(q, k, v, out, lse, dout, dlse, captures, mask_handle, key, scale, params,
              grads_of, kernel, deterministic):
    entry = _lookup(key)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if dlse is not None and not dlse.is_contiguous():  # a sum's gradient is an expanded scalar
        dlse = dlse.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    capture_grads = {n: torch.zeros_like(c, dtype=torch.float32)
                     for n, c, g in zip(entry.capture_names, captures, grads_of) if g}
    held = []

    def workspace(nbytes):  # torch's caching allocator, stream-ordered on the current stream
        held.append(torch.empty(nbytes, dtype=torch.uint8, device=q.device))
        return held[-1].data_ptr()

    _flexc.attention_backward(
        _raw(q), _raw(k), _raw(v), _raw(out), _raw(lse), _raw(dout), _raw(dq), _raw(dk), _raw(dv),
        entry.variant, block_mask=_mask_of(mask_handle),
        captures={n: _raw(c) for n, c in zip(entry.capture_names, captures)},
        capture_grads={n: _raw(g) for n, g in capture_grads.items()},
        params=dict(zip(entry.param_names, params)), scale=scale,
        dlse=None if dlse is None else _raw(dlse), stream=_stream_of(q), kernel=kernel,
        deterministic=None if deterministic < 0 else bool(deterministic), workspace=workspace)
    grads = [dq, dk, dv]
    for n, c, g in zip(entry.capture_names, captures, grads_of):
        if g:
            grads.append(capture_grads[n].to(c.dtype))
    return grads


# The custom ops torch.compile sees; their implementations are the two functions above.

@torch.library.custom_op("flexc::attention", mutates_args=(), device_types="cuda")
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  captures: list[torch.Tensor], mask_handle: Optional[torch.Tensor], key: str,
                  scale: float, params: list[float], kernel: str, deterministic: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, captures, mask_handle, key, scale, params, kernel)


@_attention_op.register_fake
def _(q, k, v, captures, mask_handle, key, scale, params, kernel, deterministic):
    return _out_like(q, v.shape[-1]), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("flexc::attention_backward", mutates_args=(), device_types="cuda")
def _attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, dout: torch.Tensor, dlse: Optional[torch.Tensor],
                           captures: list[torch.Tensor], mask_handle: Optional[torch.Tensor],
                           key: str, scale: float, params: list[float], grads_of: list[bool],
                           kernel: str, deterministic: int) -> list[torch.Tensor]:
    return _backward(q, k, v, out, lse, dout, dlse, captures, mask_handle, key, scale, params,
                     grads_of, kernel, deterministic)


@_attention_backward_op.register_fake
def _(q, k, v, out, lse, dout, dlse, captures, mask_handle, key, scale, params, grads_of, kernel,
      deterministic):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)] + \
        [torch.empty_like(c) for c, g in zip(captures, grads_of) if g]


def _save(ctx, inputs, out, lse, grads_of):
    q, k, v, captures, mask_handle, key, scale, params, kernel, deterministic = inputs
    # The custom op's mask is a handle tensor (saved); an eager call's, the BlockMask itself.
    handle = isinstance(mask_handle, torch.Tensor)
    ctx.save_for_backward(q, k, v, out, lse, *captures, *([mask_handle] if handle else []))
    ctx.n_captures, ctx.mask = len(captures), None if handle else mask_handle
    ctx.key, ctx.scale, ctx.params, ctx.kernel = key, scale, params, kernel
    ctx.deterministic, ctx.grads_of = deterministic, grads_of


def _grads_of(captures):
    return [c.requires_grad and c.is_floating_point() for c in captures]


def _grads(ctx, dout, dlse, backward):
    """dq, dk, dv and the captures' gradients (None where none is wanted), by `backward`: the
    custom op where torch.compile traces, _backward itself in eager autograd."""
    q, k, v, out, lse, *rest = ctx.saved_tensors
    captures = rest[:ctx.n_captures]
    mask_handle = rest[-1] if len(rest) > ctx.n_captures else ctx.mask
    if dout is None:  # only the LSE reaches the loss
        dout = torch.zeros_like(out)
    grads = backward(q, k, v, out, lse, dout, dlse, captures, mask_handle, ctx.key, ctx.scale,
               ctx.params, ctx.grads_of, ctx.kernel, ctx.deterministic)
    it = iter(grads[3:])
    return grads[0], grads[1], grads[2], [next(it) if g else None for g in ctx.grads_of]


def _setup_context(ctx, inputs, output):
    _save(ctx, inputs, *output, _grads_of(inputs[3]))


def _op_backward(ctx, dout, dlse):
    dq, dk, dv, dcaps = _grads(ctx, dout, dlse, _attention_backward_op)
    # One entry per input, a list for each list input (captures, params).
    return dq, dk, dv, dcaps, None, None, None, [None] * len(ctx.params), None, None


torch.library.register_autograd("flexc::attention", _op_backward, setup_context=_setup_context)


class _Attention(torch.autograd.Function):
    """Eager training: the same forward and backward without the custom op's dispatch."""

    @staticmethod
    def forward(ctx, q, k, v, mask_handle, key, scale, params, kernel, deterministic, *captures):
        ctx.set_materialize_grads(False)  # an unused LSE has no gradient to read
        inputs = (q, k, v, list(captures), mask_handle, key, scale, params, kernel, deterministic)
        out, lse = _forward(*inputs[:9])
        _save(ctx, inputs, out, lse, _grads_of(captures))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        dq, dk, dv, dcaps = _grads(ctx, dout, dlse, _backward)
        return (dq, dk, dv, None, None, None, None, None, None, *dcaps)


_KERNEL_OPTIONS = ("deterministic", "kernel")


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False, kernel_options=None, *, captures=None,
                   params=None):
    """torch.nn.attention.flex_attention on flexc's kernels. query [B, Hq, L, E], key
    [B, Hkv, S, E], value [B, Hkv, S, Ev]: bf16 / fp16 CUDA tensors, any strides flexc accepts
    (a permuted [B, L, H, E] tensor is fine). score_mod: a flexc expression of score, b, h, q_idx,
    kv_idx (str), or a flexc.Variant (whose mask applies too when no block_mask is given);
    block_mask: from create_block_mask. captures / params: the tensors and scalars the mods read,
    by name (the block mask's own are passed along). kernel_options: {"kernel": "auto" |
    "hopper" | "portable", "deterministic": bool (the backward's dq)}. Returns out, or
    (out, lse) with return_lse: float32 [B, Hq, L], natural log, -inf for a fully masked row
    (whose output is 0)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise Error(f"flex_attention: {name} must be a 4-d torch tensor [B, H, S, D]")
        if t.device.type != "cuda":
            raise Error(f"flex_attention: {name} is on {t.device}; flexc's kernels take CUDA "
                        "tensors")
    if query.size(1) != key.size(1) and not enable_gqa:
        raise Error(f"flex_attention: query has {query.size(1)} heads and key {key.size(1)}; "
                    "pass enable_gqa=True for grouped-query attention")
    options = dict(kernel_options or {})
    for name in options:
        if name not in _KERNEL_OPTIONS:
            raise Error(f"flex_attention: unknown kernel_options key '{name}' (flexc takes "
                        f"{', '.join(_KERNEL_OPTIONS)})")
    kernel = options.get("kernel", "auto")
    deterministic = -1 if options.get("deterministic") is None else int(options["deterministic"])

    score = ("score", {}, {}) if score_mod is None else _mod_text(score_mod, "score")
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise Error("flex_attention: block_mask must come from flexc.torch.create_block_mask")
        mask = (block_mask.mask_mod, block_mask._capture_decls, block_mask._param_decls)
        if isinstance(score_mod, Variant) and score_mod.mask_mod not in ("true", mask[0]):
            raise Error(f"flex_attention: score_mod's variant masks with '{score_mod.mask_mod}' "
                        f"but block_mask was built from '{mask[0]}'")
        captures = {**block_mask._captures, **(captures or {})}
        params = {**block_mask._params, **(params or {})}
        handle = block_mask._handle
    else:
        mask = _mod_text(score_mod, "mask") if isinstance(score_mod, Variant) else ("true", {}, {})
        handle = None
    B, Hq, L, E = query.shape
    sizes = (("KV_LEN", key.size(2)), ("Q_LEN", L), ("H", Hq), ("B", B))
    capture_decls, tensors, param_decls = _declare([score[1:], mask[1:]], captures, params,
                                                   sizes)
    vkey = _key(score[0], mask[0], capture_decls, param_decls)
    capture_names, param_names = _names(capture_decls, param_decls)
    caps = []
    for n in capture_names:
        if n not in tensors:
            raise Error(f"flex_attention: the variant declares capture '{n}': pass it in captures")
        if tensors[n].device != query.device:
            raise Error(f"flex_attention: captures['{n}'] is on {tensors[n].device}, query on "
                        f"{query.device}")
        caps.append(tensors[n])
    values = params or {}
    pvals = [float(values[n]) if n in values else param_decls[n][2] for n in param_names]
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)

    args = (query, key, value, caps, handle, vkey, scale, pvals, kernel, deterministic)
    if torch.compiler.is_compiling():
        out, lse = _attention_op(*args)
    elif torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, *caps)):
        out, lse = _Attention.apply(query, key, value, block_mask, vkey, scale, pvals, kernel,
                                    deterministic, *caps)
    else:
        out, lse = _forward(query, key, value, caps, block_mask, vkey, scale, pvals, kernel)
    return (out, lse) if return_lse else out


# ---- Ring attention (docs/ring.md): one sequence over the ranks of a torch.distributed group

# (variant, communicator, shapes, params, mask captures' contents) -> flexc RingAttention, the
# oldest evicted past _MAX_RINGS (every rank makes the same calls, so evicts the same).
_RINGS: dict = {}
_MAX_RINGS = 8


def _comm_ptr(group):
    """The ncclComm_t of `group`'s NCCL backend on the current device, as an int. torch makes it
    at the group's first collective (or at init_process_group with device_id)."""
    import torch.distributed as dist

    backend = group._get_backend(torch.device("cuda", torch.cuda.current_device()))
    if not hasattr(backend, "_comm_ptr"):
        raise Error("ring_attention needs torch.distributed's NCCL backend (ProcessGroupNCCL "
                    "with _comm_ptr, torch >= 2.8)")
    try:
        ptr = backend._comm_ptr()
    except RuntimeError:
        ptr = 0
    if not ptr:  # not made yet: a collective makes it
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
        ptr = backend._comm_ptr()
    return ptr


def _host(t):
    """A mask capture as numpy, for the BlockMasks built on the CPU (bf16 / fp16 as 16-bit bits)."""
    t = t.detach().cpu().contiguous()
    return (t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()


def ring_shard(x, rank, ranks, sharding="zigzag", dim=2):
    """Rank `rank`'s shard of a whole-sequence tensor along `dim` (default: [B, H, S, D]'s S), as
    ring_attention takes it: chunk `rank` (contiguous), or chunks `rank` and 2 ranks - 1 - rank
    of 2 x ranks (zigzag), concatenated."""
    if sharding == "contiguous":
        return x.chunk(ranks, dim)[rank]
    if sharding != "zigzag":
        raise Error(f"ring_shard: sharding must be 'zigzag' or 'contiguous'; got '{sharding}'")
    chunks = x.chunk(2 * ranks, dim)
    return torch.cat([chunks[rank], chunks[2 * ranks - 1 - rank]], dim)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, names, scale, kernel, deterministic, *captures):
        out = torch.empty(q.shape[:-1] + (v.size(-1),), dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        caps = {n: _raw(t) for n, t in zip(names, captures)}
        ring.forward(_raw(q), _raw(k), _raw(v), _raw(out), lse=_raw(lse), captures=caps,
                     scale=scale, stream=_stream_of(q), kernel=kernel)
        ctx.save_for_backward(q, k, v, out, lse, *captures)
        ctx.ring, ctx.names, ctx.scale = ring, names, scale
        ctx.kernel, ctx.deterministic = kernel, deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *captures = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dout = dout.contiguous()  # kept until the kernels reading it are enqueued
        # Float captures asked for (inputs 8 on): float32 sums, cast back to their dtype.
        grads = {n: torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                 for i, (n, t) in enumerate(zip(ctx.names, captures))
                 if ctx.needs_input_grad[8 + i] and t.is_floating_point()}
        ctx.ring.backward(_raw(q), _raw(k), _raw(v), _raw(out), _raw(lse), _raw(dout), _raw(dq),
                          _raw(dk), _raw(dv),
                          captures={n: _raw(t) for n, t in zip(ctx.names, captures)},
                          capture_grads={n: _raw(g) for n, g in grads.items()},
                          scale=ctx.scale, stream=_stream_of(q), deterministic=ctx.deterministic,
                          kernel=ctx.kernel)
        return (dq, dk, dv, None, None, None, None, None,
                *(grads[n].to(t.dtype) if n in grads else None
                  for n, t in zip(ctx.names, captures)))


def ring_attention(q, k, v, score_mod=None, mask_mod=None, *, group=None, sharding="zigzag",
                   captures=None, params=None, scale=None, kernel="auto", deterministic=None):
    """Ring attention (docs/ring.md) over the ranks of a torch.distributed NCCL process group
    (default: the world), every rank calling it with its shard: q [B, Hq, S / ranks, D], k and
    v [B, Hkv, S / ranks, D / Dv] (bf16 / fp16 CUDA tensors on the rank's device; ring_shard()
    cuts them from the whole sequence), of the sequence's S = ranks x q.size(2) tokens. The mods
    (flexc expressions or a flexc.Variant, as flex_attention takes them) see global positions
    and S; captures (tensors over the whole sequence, on the rank's device) and params by name.
    K/V travel around the ring over the group's own communicator; blocks the mask leaves empty
    are skipped. Returns the shard's output, differentiable in q, k, v and float32 captures that
    require grad (a capture's gradient is this rank's share: sum it over the ranks, as for any
    replicated parameter). The first call for a variant, shape, params and mask captures builds
    the plan and BlockMasks (collective); later calls reuse them (the last 8 kept). The group's
    communicator must be blocking (torch's default; not TORCH_NCCL_USE_COMM_NONBLOCKING)."""
    import torch.distributed as dist

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.device.type != "cuda":
            raise Error(f"ring_attention: {name} must be a 4-d CUDA tensor [B, H, S / ranks, D]")
    group = group or dist.group.WORLD
    ranks = dist.get_world_size(group)
    B, Hq, L, E = q.shape
    S = L * ranks
    score = ("score", {}, {}) if score_mod is None else _mod_text(score_mod, "score")
    if mask_mod is None:
        mask = _mod_text(score_mod, "mask") if isinstance(score_mod, Variant) else ("true", {}, {})
    else:
        mask = _mod_text(mask_mod, "mask")
    sizes = (("KV_LEN", S), ("Q_LEN", S), ("H", Hq), ("B", B))
    capture_decls, tensors, param_decls = _declare([score[1:], mask[1:]], captures, params, sizes)
    vkey = _key(score[0], mask[0], capture_decls, param_decls)
    entry = _lookup(vkey)
    names = tuple(sorted(capture_decls))
    for n in names:
        if n not in tensors:
            raise Error(f"ring_attention: the variant declares capture '{n}': pass it in captures")
    values = {n: float(x) for n, x in (params or {}).items()}
    with torch.cuda.device(q.device):  # the communicator and the kernels: q's GPU
        comm = _comm_ptr(group)
        # The plan and BlockMasks follow the mask captures' contents: a new document layout is
        # a new ring (host copies, compared by their bytes).
        host = {n: _host(tensors[n]) for n in names}
        rkey = (vkey, comm, tuple(q.shape), tuple(k.shape), v.size(-1), q.dtype, sharding,
                tuple(sorted(values.items())), tuple((n, a.tobytes()) for n, a in host.items()))
        ring = _RINGS.get(rkey)
        if ring is None:
            ring = _flexc.RingAttention(
                entry.variant, comm, ranks, S, sharding=sharding, batch=B, q_heads=Hq,
                kv_heads=k.size(1), head_dim=E, v_head_dim=v.size(-1),
                dtype=_DTYPE_NAMES[q.dtype], params=values, captures=host)
            if len(_RINGS) >= _MAX_RINGS:
                del _RINGS[next(iter(_RINGS))]
            _RINGS[rkey] = ring
        scale = None if scale is None else float(scale)
        caps = [tensors[n] for n in names]
        return _Ring.apply(q, k.contiguous(), v.contiguous(), ring, names, scale, kernel,
                           deterministic, *caps)


# ---- Gated linear attention (docs/linear.md)

def _check_linear(what, q, k, v, **optional):
    """Tensors on q's CUDA device (the raw views below carry pointers; the C++ checks the rest)."""
    for name, t in (("q", q), ("k", k), ("v", v), *optional.items()):
        if t is None and name in ("g", "initial_state"):
            continue
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or t.device != q.device:
            where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise Error(f"{what}: {name} must be a torch tensor on q's CUDA device; got {where}")
        if name in ("q", "k", "v") and t.dim() != 4:
            raise Error(f"{what}: {name} must be 4-d [B, H, T, D]; got {tuple(t.shape)}")


def _linear_forward(q, k, v, g, initial_state, scale, output_final_state, workspace, variant):
    out = _out_like(q, v.shape[-1])
    final = None
    if output_final_state:
        final = torch.empty(q.shape[0], q.shape[1], q.shape[3], v.shape[3], dtype=torch.float32,
                            device=q.device)
    _flexc.linear_attention(_raw(q), _raw(k), _raw(v), _raw(out), g=_raw_opt(g),
                            initial_state=_raw_opt(initial_state), final_state=_raw_opt(final),
                            scale=scale, stream=_stream_of(q), workspace=workspace,
                            variant=variant)
    return out, final


_LINEAR_VARIANTS: dict = {}  # config string -> LinearVariant, loaded once per process
# (log_decay, H, device) -> the float32 [H] decays: building them is a blocking host-to-device copy.
_HEAD_DECAYS: dict = {}


def _linear_variant(variant):
    if isinstance(variant, LinearVariant):
        return variant
    if not isinstance(variant, str):
        raise Error("linear_attention: variant must be a flexc.LinearVariant or a config ('@name' "
                    f"or a JSON file's path); got {type(variant).__name__}")
    v = _LINEAR_VARIANTS.get(variant)
    if v is None:
        v = _LINEAR_VARIANTS[variant] = LinearVariant.load(variant)
    return v


def _head_decays(variant, H, device):
    key = (variant.log_decay, H, device)
    decay = _HEAD_DECAYS.get(key)
    if decay is None:
        decay = torch.tensor(variant.head_log_decays(H), dtype=torch.float32, device=device)
        _HEAD_DECAYS[key] = decay
    return decay


def _variant_gates(variant, q, g):
    """The g the kernels read for the variant's gate kind: the caller's, checked against the kind's
    shape (per_dim, per_step); the decays of its log_decay, [H] expanded to [B, H, T] (per_head);
    None (none)."""
    B, H, T, DK = q.shape
    gate = variant.gate
    if gate in ("per_dim", "per_step"):
        want = (B, H, T, DK) if gate == "per_dim" else (B, H, T)
        if g is not None and tuple(g.shape) == want:
            return g
        need = ("[B, H, T, DK]" if gate == "per_dim" else "[B, H, T]") + f" = {list(want)}"
    elif g is None:
        if gate == "none":
            return None
        return _head_decays(variant, H, q.device).view(1, H, 1).expand(B, H, T)
    else:
        need = "None (its decays come from its log_decay)" if gate == "per_head" else \
            "None (it has no gate)"
    got = "None" if g is None else f"a tensor of shape {list(g.shape)}"
    raise Error(f"linear_attention: variant '{variant.name}' has gate {gate}: g must be {need}; "
                f"got {got}")


class _LinearAttention(torch.autograd.Function):
    """Training: flexc's forward, then its backward, which recomputes the chunk states from the
    inputs (so nothing but the inputs is saved)."""

    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, scale, output_final_state, workspace, variant):
        ctx.set_materialize_grads(False)  # an output left out of the loss has no gradient to read
        ctx.save_for_backward(q, k, v, g, initial_state)
        ctx.scale, ctx.workspace, ctx.variant = scale, workspace, variant
        return _linear_forward(q, k, v, g, initial_state, scale, output_final_state, workspace,
                               variant)

    @staticmethod
    def backward(ctx, dout, dfinal):
        q, k, v, g, initial_state = ctx.saved_tensors
        if dout is None:  # only the final state reaches the loss
            dout = torch.zeros(*q.shape[:3], v.shape[3], dtype=q.dtype, device=q.device)
        elif dout.stride(-1) != 1 or dout.data_ptr() % 16 or any(s % 8 for s in dout.stride()[:3]):
            dout = dout.contiguous()  # the kernels read 16-byte aligned rows (a sum's is expanded)
        if dfinal is not None and not dfinal.is_contiguous():
            dfinal = dfinal.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # dg is required with gates; in g's logical shape, which expand()'s backward then reduces.
        dg = None if g is None else torch.empty(g.shape, dtype=g.dtype, device=g.device)
        dh0 = None
        if initial_state is not None and ctx.needs_input_grad[4]:
            dh0 = torch.empty_like(initial_state)
        held = []

        def cached(nbytes):  # torch's caching allocator, stream-ordered on the current stream
            held.append(torch.empty(nbytes, dtype=torch.uint8, device=q.device))
            return held[-1].data_ptr()

        _flexc.linear_attention_backward(
            _raw(q), _raw(k), _raw(v), _raw(dout), _raw(dq), _raw(dk), _raw(dv), g=_raw_opt(g),
            dg=_raw_opt(dg), initial_state=_raw_opt(initial_state), d_initial_state=_raw_opt(dh0),
            d_final_state=_raw_opt(dfinal), scale=ctx.scale, stream=_stream_of(q),
            workspace=ctx.workspace or cached, variant=ctx.variant)
        # The kernel writes dq, dk and dv whichever are wanted; autograd takes None for the rest.
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
                dg if need[3] else None, dh0, None, None, None, None)


def linear_attention(q, k, v, g=None, *, scale=None, initial_state=None,
                     output_final_state=False, workspace=None, variant=None):
    """Gated linear attention (GLA) on CUDA tensors, chunkwise: returns (out, final_state).

    q, k: [B, H, T, DK]; v: [B, H, T, DV] (k and v may have fewer heads, dividing H); bf16 or fp16,
    any batch / head / token strides (a [B, T, H, D] tensor's .transpose(1, 2) is taken as is).
    g: log gates (<= 0), [B, H, T, DK] per key dim (GLA), [B, H, T] per step (Mamba-2), any
    strides (expand() broadcasts: a fixed per-head decay is g_h.view(1, H, 1).expand(B, H, T)),
    float32 / bf16 / fp16; None: no gate. initial_state: float32 [B, H, DK, DV]. final_state is
    float32 [B, H, DK, DV] when output_final_state, else None.

    Differentiable in q, k, v, g and initial_state (a loss of out, final_state or both): the
    backward kernels recompute the chunk states from the inputs. workspace: a callable
    (bytes -> device pointer kept valid on the stream) for the temporaries; None: flexc's pool
    in the forward, torch's caching allocator in the backward.

    variant: a linear-attention config (docs/linear.md, "Configs"), a flexc.LinearVariant or what
    LinearVariant.load takes ("@retnet", a JSON file's path). Its gate decides g: per_dim takes g
    [B, H, T, DK], per_step g [B, H, T], per_head and none take g=None (per_head: the decays of its
    log_decay, on q's device, not trained); its scale applies when scale is None, and its
    feature_map (if any) applies to q and k, inside the kernels' calls (gradients through it)."""
    _check_linear("linear_attention", q, k, v, g=g, initial_state=initial_state)
    if variant is not None:
        variant = _linear_variant(variant)
        g = _variant_gates(variant, q, g)
        if scale is None:
            scale = variant.scale
    if initial_state is not None and not initial_state.is_contiguous():
        initial_state = initial_state.contiguous()
    args = (q, k, v, g, initial_state, scale, output_final_state, workspace, variant)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args[:5]):
        return _LinearAttention.apply(*args)
    return _linear_forward(*args)


def linear_attention_step(q, k, v, state, g=None, *, scale=None, variant=None):
    """The recurrent form over q's T tokens (T = 1 when decoding): `state` (float32 [B, H, DK, DV],
    contiguous) is updated in place; returns out [B, H, T, DV]. Shapes, gates and variant as
    linear_attention's. Forward only: inputs that require grad are refused (outside no_grad)."""
    _check_linear("linear_attention_step", q, k, v, state=state, g=g)
    if variant is not None:
        variant = _linear_variant(variant)
        g = _variant_gates(variant, q, g)
        if scale is None:
            scale = variant.scale
    tensors = (q, k, v, state, g)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise Error("flexc.torch.linear_attention_step has no backward (it is for decoding); call "
                    "it under torch.no_grad(), or train with linear_attention")
    out = _out_like(q, v.shape[-1])
    _flexc.linear_attention_step(_raw(q), _raw(k), _raw(v), _raw(state), _raw(out),
                                 g=_raw_opt(g), scale=scale, stream=_stream_of(q),
                                 variant=variant)
    return out
