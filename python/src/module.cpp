// flexc._flexc: the Python binding of flexc's public C++ API (include/flexc/): variants and
// linear-attention configs, ahead-of-time compilation, BlockMasks built on the CPU, the float64
// reference (host arrays: numpy), and the kernels (attention, its backward, decode, gated linear
// attention and its backward) on CUDA tensors from any DLPack producer. flexc::Error becomes
// flexc.Error (a ValueError) with flexc's message.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "dlpack.h"
#include "flexc/attention.h"
#include "flexc/blockmask.h"
#include "flexc/decode.h"
#include "flexc/error.h"
#include "flexc/jit.h"
#include "flexc/linear.h"
#include "flexc/reference.h"
#include "flexc/ring.h"
#include "flexc/tensor.h"
#include "flexc/variant.h"

namespace py = pybind11;
using namespace flexc;

namespace {

// Host arrays cross through the buffer protocol (numpy arrays, memoryviews), not pybind11's numpy
// API: that API reads numpy's structs, which numpy 2 changed, and this module must work with the
// pybind11 of the platform and any numpy. flexc/__init__.py wraps results as numpy arrays.

// A buffer's element type as flexc names it; bf16 has no buffer format: pass uint16 bits for a
// capture declared bf16 (or fp16).
DType dtype_of(const py::buffer_info& b, const std::string& declared) {
  const std::string& f = b.format;
  const char c = f.empty() ? '?' : f.back();  // formats may carry a byte-order prefix
  if (c == 'f' && b.itemsize == 4) return DType::F32;
  if ((c == 'i' || c == 'l') && b.itemsize == 4) return DType::I32;
  if ((c == '?' || c == 'B' || c == 'b') && b.itemsize == 1) return DType::Bool;
  if (c == 'e' && b.itemsize == 2) return DType::F16;
  if ((c == 'H' || c == 'h') && b.itemsize == 2 && (declared == "bf16" || declared == "fp16"))
    return parse_dtype(declared);
  throw Error("array of format '" + f + "' (" + std::to_string(b.itemsize) +
              " bytes) is not one flexc reads: float32, int32, bool, float16, or uint16 bits of "
              "a bf16 capture");
}

// A host view of a buffer (strides in elements; the buffer must stay alive).
TensorView host_view(const py::buffer_info& b, DType dtype) {
  TensorView t;
  t.data = b.ptr;
  t.dtype = dtype;
  for (py::ssize_t i = 0; i < b.ndim; ++i) {
    t.shape.push_back(b.shape[i]);
    if (b.strides[i] % b.itemsize != 0) throw Error("array strides must be whole elements");
    t.strides.push_back(b.strides[i] / b.itemsize);
  }
  return t;
}

using python::Borrowed;

// The kernels' stream from the Python argument (an int cudaStream_t; None: the legacy default
// stream), and the same stream in DLPack's convention for the producers (1: legacy default).
struct Stream {
  CUstream_st* cuda;
  int64_t dlpack;
  explicit Stream(std::optional<int64_t> s)
      : cuda(reinterpret_cast<CUstream_st*>(s.value_or(0))), dlpack(s.value_or(0) ? *s : 1) {}
};

// Captures given as DLPack tensors, by name.
std::map<std::string, TensorView, std::less<>> capture_views(Borrowed& b, const py::dict& d,
                                                             const Stream& s) {
  std::map<std::string, TensorView, std::less<>> out;
  for (auto [key, value] : d) {
    const std::string name = py::str(key);
    out[name] = b.view(value, "captures['" + name + "']", s.dlpack, true);
  }
  return out;
}

// What every kernel call's options share: captures (DLPack), params, scale and the stream.
template <class Options>
void set_common(Options& o, Borrowed& b, const Stream& st, const py::dict& captures,
                const std::map<std::string, double>& params, std::optional<double> scale) {
  o.captures = capture_views(b, captures, st);
  for (const auto& [name, value] : params) o.params[name] = value;
  o.scale = scale;
  o.stream = st.cuda;
}

// A Python callable (bytes -> int device pointer that it keeps valid on the stream, such as a
// framework's caching allocator) as flexc's workspace allocator; None: flexc's own pool.
WorkspaceAllocator workspace_from(const py::object& fn) {
  if (fn.is_none()) return {};
  return [fn](size_t bytes) -> void* {
    py::gil_scoped_acquire gil;
    return reinterpret_cast<void*>(fn(bytes).cast<uintptr_t>());
  };
}

std::string declared_dtype(const Variant& v, const std::string& capture) {
  for (const CaptureSpec& c : v.captures())
    if (c.name == capture) return c.dtype;
  return {};
}

// Host captures (numpy arrays in their declared dtype) for a mask's builders; `infos` keeps the
// buffers they view requested.
std::map<std::string, CaptureData, std::less<>> mask_captures(
    const Variant& v, const std::map<std::string, py::buffer>& captures,
    std::vector<py::buffer_info>& infos) {
  std::map<std::string, CaptureData, std::less<>> out;
  infos.reserve(captures.size());
  for (const auto& [name, a] : captures) {
    infos.push_back(a.request());
    const TensorView t = host_view(infos.back(), dtype_of(infos.back(), declared_dtype(v, name)));
    out[name] = CaptureData{t.data, nullptr, t.shape, t.strides};
  }
  return out;
}

template <class T>
py::bytes raw(const std::vector<T>& v) {
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// A C-contiguous float32 [B, H, S, D] buffer as a span.
std::span<const float> floats4(const py::buffer_info& b, const char* name,
                               std::vector<int64_t>& shape) {
  if (b.ndim != 4 || b.itemsize != 4 || b.format.empty() || b.format.back() != 'f')
    throw Error(std::string("reference_attention: ") + name +
                " must be a float32 [B, H, S, D] array");
  shape.assign(b.shape.begin(), b.shape.end());
  py::ssize_t stride = 4;
  for (py::ssize_t i = 3; i >= 0; --i) {
    if (b.shape[i] > 1 && b.strides[i] != stride)
      throw Error(std::string("reference_attention: ") + name + " must be C-contiguous");
    stride *= b.shape[i];
  }
  return {static_cast<const float*>(b.ptr), static_cast<size_t>(stride / 4)};
}

}  // namespace

// RingAttention's calls' shared options: captures (DLPack), scale, stream, kernel.
template <class Options>
Options ring_options(Borrowed& b, const Stream& st, const py::dict& captures,
                     std::optional<double> scale, const std::string& kernel) {
  Options o;
  o.captures = capture_views(b, captures, st);
  o.scale = scale;
  o.stream = st.cuda;
  o.kernel = parse_fwd_kernel(kernel);
  return o;
}

// A ring's shape from the Python arguments (plan_ring, RingAttention).
RingShape ring_shape(int64_t ranks, int64_t seq_len, const std::string& sharding, int64_t batch,
                     int64_t q_heads, std::optional<int64_t> kv_heads, int64_t head_dim,
                     int64_t v_head_dim, const std::string& dtype) {
  RingShape s;
  s.ranks = ranks, s.seq_len = seq_len, s.batch = batch, s.q_heads = q_heads;
  s.kv_heads = kv_heads.value_or(q_heads), s.head_dim = head_dim, s.v_head_dim = v_head_dim;
  s.dtype = parse_dtype(dtype);
  if (sharding == "zigzag") s.sharding = Sharding::Zigzag;
  else if (sharding == "contiguous") s.sharding = Sharding::Contiguous;
  else throw Error("sharding must be 'zigzag' or 'contiguous'; got '" + sharding + "'");
  return s;
}

PYBIND11_MODULE(_flexc, m) {
  m.doc() = "flexc: attention variants from two expressions, JIT-compiled for NVIDIA GPUs";
  static py::exception<Error> error(m, "Error", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });

  py::enum_<Precision>(m, "Precision")
      .value("FAST", Precision::Fast)
      .value("EXACT", Precision::Exact)
      .value("APPROX", Precision::Approx);

  py::class_<CaptureSpec>(m, "CaptureSpec")
      .def(py::init([](std::string name, std::string dtype, std::vector<std::string> dims) {
             return CaptureSpec{std::move(name), std::move(dtype), std::move(dims)};
           }),
           py::arg("name"), py::arg("dtype"), py::arg("dims"))
      .def_readonly("name", &CaptureSpec::name)
      .def_readonly("dtype", &CaptureSpec::dtype)
      .def_readonly("dims", &CaptureSpec::dims)
      .def("__repr__", [](const CaptureSpec& c) {
        std::string dims;
        for (const std::string& d : c.dims) dims += (dims.empty() ? "" : ", ") + d;
        return "CaptureSpec('" + c.name + "', '" + c.dtype + "', [" + dims + "])";
      });

  py::class_<ParamSpec>(m, "ParamSpec")
      .def(py::init([](std::string name, std::string type, double default_value, bool is_const) {
             return ParamSpec{std::move(name), std::move(type), default_value, is_const};
           }),
           py::arg("name"), py::arg("type") = "float", py::arg("default") = 0.0,
           py::arg("const") = false)
      .def_readonly("name", &ParamSpec::name)
      .def_readonly("type", &ParamSpec::type)
      .def_readonly("default", &ParamSpec::default_value)
      .def_readonly("const", &ParamSpec::is_const);

  py::class_<Variant>(m, "Variant")
      .def_static("from_strings", &Variant::from_strings, py::arg("score_mod"),
                  py::arg("mask_mod") = "true", py::arg("captures") = std::vector<CaptureSpec>{},
                  py::arg("params") = std::vector<ParamSpec>{}, py::arg("name") = "custom",
                  "A variant from two expressions; flexc.Error with diagnostics on bad input.")
      .def_static("from_json", &Variant::from_json, py::arg("text"), py::arg("origin") = "<json>")
      .def_static("from_catalogue", &Variant::from_catalogue, py::arg("name"))
      .def_static("catalogue_names", &Variant::catalogue_names)
      .def_property_readonly("name", &Variant::name)
      .def_property_readonly("description", &Variant::description)
      .def_property_readonly("captures", &Variant::captures)
      .def_property_readonly("params", &Variant::params)
      .def_property_readonly("score_mod", &Variant::score_mod_text)
      .def_property_readonly("mask_mod", &Variant::mask_mod_text)
      .def_property_readonly("score_grad", &Variant::score_grad_text)
      .def_property_readonly("precision", &Variant::precision)
      .def("with_precision", &Variant::with_precision, py::arg("precision"))
      .def("renamed", &Variant::renamed, py::arg("name"))
      .def("__and__", [](const Variant& a, const Variant& b) { return and_masks(a, b); })
      .def("__or__", [](const Variant& a, const Variant& b) { return or_masks(a, b); })
      .def("__invert__", [](const Variant& a) { return not_mask(a); })
      .def("__repr__", [](const Variant& v) {
        return "Variant('" + v.name() + "', score_mod='" + v.score_mod_text() + "', mask_mod='" +
               v.mask_mod_text() + "')";
      });
  m.def("compose", &compose, py::arg("outer"), py::arg("inner"));

  py::class_<LinearVariant>(m, "LinearVariant")
      .def_static("load", &LinearVariant::load, py::arg("config"),
                  "A linear-attention config: '@name' of the catalogue or a JSON file's path "
                  "(docs/linear.md, \"Configs\").")
      .def_static("from_json", &LinearVariant::from_json, py::arg("text"),
                  py::arg("origin") = "<json>")
      .def_static("catalogue_names", &LinearVariant::catalogue_names)
      .def_property_readonly("name", &LinearVariant::name)
      .def_property_readonly("description", &LinearVariant::description)
      .def_property_readonly("gate", [](const LinearVariant& v) { return to_string(v.gate()); })
      .def_property_readonly("log_decay", &LinearVariant::log_decay_text)
      .def_property_readonly("scale", &LinearVariant::scale)
      .def_property_readonly(
          "feature_map",
          [](const LinearVariant& v) -> std::optional<std::string> {
            if (!v.feature_map()) return std::nullopt;
            return v.feature_map()->text();
          },
          "the feature map on q and k (an expression of x), or None")
      .def("head_log_decays", &LinearVariant::head_log_decays, py::arg("heads"),
           "per_head: log_decay at h = 0 .. heads - 1 (float64, rounded to float32).")
      .def("__repr__", [](const LinearVariant& v) {
        return "LinearVariant('" + v.name() + "', gate='" + std::string(to_string(v.gate())) +
               "')";
      });

  py::class_<KernelInfo>(m, "KernelInfo")
      .def_readonly("name", &KernelInfo::name)
      .def_readonly("description", &KernelInfo::description)
      .def_readonly("only_arch", &KernelInfo::only_arch);
  m.def("kernel_templates", &kernel_templates, py::arg("arch") = "");
  m.def("add_nvrtc_search_dir", &add_nvrtc_search_dir, py::arg("dir"),
        "A directory searched for NVRTC after the CUDA toolkit's (docs/jit.md); before the first "
        "compile only.");

  py::class_<CompiledKernel>(m, "CompiledKernel")
      .def_readonly("arch", &CompiledKernel::arch)
      .def_readonly("key", &CompiledKernel::key)
      .def_readonly("source", &CompiledKernel::source)
      .def_readonly("ptx", &CompiledKernel::ptx)
      .def_property_readonly("cubin",
                             [](const CompiledKernel& c) { return py::bytes(c.cubin); })
      .def_readonly("compile_seconds", &CompiledKernel::compile_seconds);
  m.def(
      "compile",
      [](const Variant& v, const std::string& kernel, const std::string& arch,
         const std::string& dtype, int head_dim, int v_head_dim, bool use_cache, bool positions,
         bool f32_out, bool accumulate) {
        const KernelBuild b{kernel, arch,      dtype,   head_dim,
                            v_head_dim, positions, f32_out, accumulate};
        py::gil_scoped_release release;  // NVRTC takes a while; other Python threads may run
        return compile_kernels(v, {&b, 1}, use_cache).front();
      },
      py::arg("variant"), py::arg("kernel"), py::arg("arch") = "", py::arg("dtype") = "bf16",
      py::arg("head_dim") = 128, py::arg("v_head_dim") = 0, py::arg("use_cache") = true,
      py::arg("positions") = false, py::arg("f32_out") = false, py::arg("accumulate") = false,
      "Compiles one kernel template for the variant (no GPU needed when arch is named); "
      "positions: the attention kernels' build for blocks of a longer sequence; f32_out: with "
      "float32 outputs; accumulate: the backward's adding into them (ring attention runs "
      "positions with both).");

  py::enum_<TileKind>(m, "TileKind")
      .value("EMPTY", TileKind::Empty)
      .value("PARTIAL", TileKind::Partial)
      .value("FULL", TileKind::Full);

  py::class_<BlockMask>(m, "BlockMask")
      .def_property_readonly("shape", [](const BlockMask& b) {
        return py::make_tuple(b.nb(), b.nh(), b.q_len(), b.kv_len());
      })
      .def_property_readonly("tile_size", [](const BlockMask& b) {
        return py::make_tuple(b.q_tile(), b.kv_tile());
      })
      .def_property_readonly("q_offset", &BlockMask::q_offset)
      .def_property_readonly("kv_offset", &BlockMask::kv_offset)
      .def_property_readonly("seq_q_len", &BlockMask::seq_q_len)
      .def_property_readonly("seq_kv_len", &BlockMask::seq_kv_len)
      .def_property_readonly("num_tiles", [](const BlockMask& b) {
        return py::make_tuple(b.num_q_tiles(), b.num_kv_tiles());
      })
      .def("tile", &BlockMask::tile, py::arg("b"), py::arg("h"), py::arg("q_tile"),
           py::arg("kv_tile"))
      .def("count", &BlockMask::count, py::arg("kind"))
      .def("sparsity", &BlockMask::sparsity)
      .def("to_string", &BlockMask::to_string, py::arg("max_rows") = 32, py::arg("max_cols") = 32,
           py::arg("max_heads") = 4)
      .def("_kv_lists_raw", [](const BlockMask& b) {
        // FlexAttention's (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) as
        // int32 bytes; flexc/__init__.py shapes them [nb, nh, num_q_tiles(, num_kv_tiles)].
        const BlockMask::Host& h = b.host();
        return py::make_tuple(raw(h.kv_num), raw(h.kv_idx), raw(h.full_kv_num),
                              raw(h.full_kv_idx));
      })
      .def("__repr__", [](const BlockMask& b) { return b.to_string(8, 8, 1); });

  m.def(
      "create_block_mask",
      [](const Variant& v, int64_t B, int64_t H, int64_t q_len, int64_t kv_len,
         const std::map<std::string, py::buffer>& captures,
         const std::map<std::string, double>& params, int64_t q_tile, int64_t kv_tile,
         int64_t q_offset, const std::string& device, const py::dict& device_captures,
         std::optional<int64_t> stream, int64_t kv_offset, int64_t seq_q_len, int64_t seq_kv_len) {
        BlockMaskOptions o;
        o.q_tile = q_tile, o.kv_tile = kv_tile, o.q_offset = q_offset, o.kv_offset = kv_offset;
        o.seq_q_len = seq_q_len, o.seq_kv_len = seq_kv_len;
        if (device == "cpu") o.device = BuildDevice::Cpu;
        else if (device == "gpu") o.device = BuildDevice::Gpu;
        else if (device == "auto") o.device = BuildDevice::Auto;
        else throw Error("create_block_mask: device must be 'cpu', 'gpu' or 'auto'; got '" + device + "'");
        for (const auto& [name, value] : params) o.params[name] = value;
        std::vector<py::buffer_info> infos;
        o.captures = mask_captures(v, captures, infos);
        // Device copies (DLPack) of host captures, for a GPU build's element evaluation.
        const Stream st(stream);
        Borrowed b;
        for (auto [key, value] : device_captures) {
          const std::string name = py::str(key);
          auto it = o.captures.find(name);
          if (it == o.captures.end())
            throw Error("create_block_mask: device_captures['" + name +
                        "'] has no host copy in captures");
          const TensorView t = b.view(value, "device_captures['" + name + "']", st.dlpack, true);
          const TensorView host{nullptr, t.dtype, it->second.shape, it->second.strides};
          bool same = t.shape == host.shape;
          for (size_t i = 0; same && i < t.rank(); ++i) same = t.stride(i) == host.stride(i);
          if (!same)
            throw Error("create_block_mask: device_captures['" + name + "'] is " + t.describe() +
                        "; it must have its host copy's shape and strides");
          if (o.device != BuildDevice::Cpu) it->second.device = t.data;
        }
        py::gil_scoped_release release;
        return create_block_mask(v, B, H, q_len, kv_len, o, st.cuda);
      },
      py::arg("variant"), py::arg("B"), py::arg("H"), py::arg("q_len"), py::arg("kv_len"),
      py::arg("captures") = std::map<std::string, py::buffer>{},
      py::arg("params") = std::map<std::string, double>{}, py::arg("q_tile") = 128,
      py::arg("kv_tile") = 128, py::arg("q_offset") = 0, py::arg("device") = "cpu",
      py::arg("device_captures") = py::dict(), py::arg("stream") = py::none(),
      py::arg("kv_offset") = 0, py::arg("seq_q_len") = 0, py::arg("seq_kv_len") = 0,
      "The variant's BlockMask: interval analysis on the CPU, then the undecided tiles element by "
      "element on the CPU (device='cpu') or the GPU ('gpu', enqueued on `stream`). Captures: "
      "numpy arrays in their declared dtype (bf16 as uint16 bits); device_captures: the same "
      "tensors on the GPU (DLPack), read by a GPU build. q_offset, kv_offset, seq_q_len, "
      "seq_kv_len: the positions of a block of a longer sequence, as attention() takes them.");

  py::class_<RingBlock>(m, "RingBlock")
      .def_readonly("kv_rank", &RingBlock::kv_rank)
      .def_readonly("full_tiles", &RingBlock::full_tiles)
      .def_readonly("partial_tiles", &RingBlock::partial_tiles)
      .def_readonly("density", &RingBlock::density)
      .def_property_readonly("computes", &RingBlock::computes);
  py::class_<RingStep>(m, "RingStep")
      .def_readonly("blocks", &RingStep::blocks)
      .def_readonly("sends", &RingStep::sends)
      .def_readonly("passes", &RingStep::passes)
      .def_readonly("bytes_sent", &RingStep::bytes_sent)
      .def_readonly("rows_sent", &RingStep::rows_sent)
      .def_readonly("grad_to", &RingStep::grad_to)
      .def_readonly("grad_chunks", &RingStep::grad_chunks)
      .def_readonly("grad_early", &RingStep::grad_early)
      .def_readonly("grad_rows", &RingStep::grad_rows)
      .def_readonly("grad_sends", &RingStep::grad_sends)
      .def_readonly("grad_bytes_sent", &RingStep::grad_bytes_sent);
  py::class_<RingPlan>(m, "RingPlan")
      .def_readonly("chunk_len", &RingPlan::chunk_len)
      .def_readonly("chunks", &RingPlan::chunks)
      .def_readonly("steps", &RingPlan::steps)
      .def_readonly("computed_blocks", &RingPlan::computed_blocks)
      .def_readonly("skipped_blocks", &RingPlan::skipped_blocks)
      .def_readonly("skipped_sends", &RingPlan::skipped_sends)
      .def_readonly("rank_tiles", &RingPlan::rank_tiles)
      .def_readonly("rank_elements", &RingPlan::rank_elements)
      .def_readonly("imbalance", &RingPlan::imbalance)
      .def("__str__", [](const RingPlan& p) { return to_string(p); });
  m.def(
      "plan_ring",
      [](const Variant& v, int64_t ranks, int64_t seq_len, const std::string& sharding,
         int64_t batch, int64_t q_heads, std::optional<int64_t> kv_heads, int64_t head_dim,
         const std::string& dtype, int64_t tile, const std::map<std::string, double>& params,
         const std::map<std::string, py::buffer>& captures, int64_t send_cost_bytes) {
        const RingShape s =
            ring_shape(ranks, seq_len, sharding, batch, q_heads, kv_heads, head_dim, 0, dtype);
        RingPlanOptions o;
        o.tile = tile;
        o.send_cost_bytes = send_cost_bytes;
        for (const auto& [name, value] : params) o.params[name] = value;
        std::vector<py::buffer_info> infos;
        o.captures = mask_captures(v, captures, infos);
        py::gil_scoped_release release;
        return plan_ring(v, s, o);
      },
      py::arg("variant"), py::arg("ranks"), py::arg("seq_len"), py::arg("sharding") = "zigzag",
      py::arg("batch") = 1, py::arg("q_heads") = 1, py::arg("kv_heads") = py::none(),
      py::arg("head_dim") = 128, py::arg("dtype") = "bf16", py::arg("tile") = 128,
      py::arg("params") = std::map<std::string, double>{},
      py::arg("captures") = std::map<std::string, py::buffer>{},
      py::arg("send_cost_bytes") = RingPlanOptions{}.send_cost_bytes,
      "Ring attention's schedule for the variant over `ranks` GPUs (docs/ring.md): per step the "
      "K/V shard each rank holds and its block's tiles, the sends still needed, the balance. "
      "str() prints it as `flexc ring-plan` does.");

  py::class_<RingStats>(m, "RingStats")
      .def_readonly("blocks_computed", &RingStats::blocks_computed)
      .def_readonly("blocks_skipped", &RingStats::blocks_skipped)
      .def_readonly("sends", &RingStats::sends)
      .def_readonly("sends_skipped", &RingStats::sends_skipped)
      .def_readonly("grad_sends", &RingStats::grad_sends);
  py::class_<RingAttention>(m, "RingAttention",
                            "One rank's side of ring attention over an NCCL communicator "
                            "(flexc::RingAttention, docs/ring.md). Collective: every rank of the "
                            "communicator constructs it and calls it with the same arguments.")
      .def(py::init([](const Variant& v, int64_t comm, int64_t ranks, int64_t seq_len,
                       const std::string& sharding, int64_t batch, int64_t q_heads,
                       std::optional<int64_t> kv_heads, int64_t head_dim, int64_t v_head_dim,
                       const std::string& dtype, int64_t tile,
                       const std::map<std::string, double>& params,
                       const std::map<std::string, py::buffer>& captures,
                       int64_t send_cost_bytes) {
             const RingShape s = ring_shape(ranks, seq_len, sharding, batch, q_heads, kv_heads,
                                            head_dim, v_head_dim, dtype);
             RingPlanOptions o;
             o.tile = tile;
             o.send_cost_bytes = send_cost_bytes;
             for (const auto& [name, value] : params) o.params[name] = value;
             std::vector<py::buffer_info> infos;
             o.captures = mask_captures(v, captures, infos);
             py::gil_scoped_release release;
             return std::make_unique<RingAttention>(v, reinterpret_cast<ncclComm*>(comm), s, o);
           }),
           py::arg("variant"), py::arg("comm"), py::arg("ranks"), py::arg("seq_len"),
           py::kw_only(), py::arg("sharding") = "zigzag", py::arg("batch") = 1,
           py::arg("q_heads") = 1, py::arg("kv_heads") = py::none(), py::arg("head_dim") = 128,
           py::arg("v_head_dim") = 0, py::arg("dtype") = "bf16", py::arg("tile") = 128,
           py::arg("params") = std::map<std::string, double>{},
           py::arg("captures") = std::map<std::string, py::buffer>{},
           py::arg("send_cost_bytes") = RingPlanOptions{}.send_cost_bytes,
           "comm: the ncclComm_t as an int (torch: the process group's backend's _comm_ptr()); "
           "the current CUDA device must be the communicator's. captures: the mask's captures "
           "over the whole sequence, numpy arrays (the BlockMasks are built here).")
      .def(
          "forward",
          [](RingAttention& r, py::handle q, py::handle k, py::handle v, py::handle out,
             py::handle lse, const py::dict& captures, std::optional<double> scale,
             std::optional<int64_t> stream, const std::string& kernel) {
            const Stream st(stream);
            Borrowed b;
            RingForwardOptions o = ring_options<RingForwardOptions>(b, st, captures, scale, kernel);
            o.lse = b.view_or_none(lse, "lse", st.dlpack, true);
            const TensorView tq = b.view(q, "q", st.dlpack, true),
                             tk = b.view(k, "k", st.dlpack, true),
                             tv = b.view(v, "v", st.dlpack, true),
                             to = b.view(out, "out", st.dlpack, true);
            py::gil_scoped_release release;
            r.forward(tq, tk, tv, to, o);
          },
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::kw_only(),
          py::arg("lse") = py::none(), py::arg("captures") = py::dict(),
          py::arg("scale") = py::none(), py::arg("stream") = py::none(),
          py::arg("kernel") = "auto",
          "This rank's shard's output (and LSE), CUDA tensors as attention() takes them, of the "
          "shard's rows (plan.chunks[rank]); collective.")
      .def(
          "backward",
          [](RingAttention& r, py::handle q, py::handle k, py::handle v, py::handle out,
             py::handle lse, py::handle dout, py::handle dq, py::handle dk, py::handle dv,
             const py::dict& captures, const py::dict& capture_grads,
             std::optional<double> scale, std::optional<int64_t> stream,
             std::optional<bool> deterministic, const std::string& kernel) {
            const Stream st(stream);
            Borrowed b;
            RingBackwardOptions o =
                ring_options<RingBackwardOptions>(b, st, captures, scale, kernel);
            o.deterministic = deterministic;
            const auto view = [&](py::handle x, const char* n) {
              return b.view(x, n, st.dlpack, true);
            };
            AttentionGrads g{view(dq, "dq"), view(dk, "dk"), view(dv, "dv"),
                             capture_views(b, capture_grads, st)};
            const TensorView tq = view(q, "q"), tk = view(k, "k"), tv = view(v, "v"),
                             to = view(out, "out"), tl = view(lse, "lse"), td = view(dout, "dout");
            py::gil_scoped_release release;
            r.backward(tq, tk, tv, to, tl, td, g, o);
          },
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"),
          py::arg("dout"), py::arg("dq"), py::arg("dk"), py::arg("dv"), py::kw_only(),
          py::arg("captures") = py::dict(), py::arg("capture_grads") = py::dict(),
          py::arg("scale") = py::none(), py::arg("stream") = py::none(),
          py::arg("deterministic") = py::none(), py::arg("kernel") = "auto",
          "The shard's dq, dk, dv (written) and this rank's share of the float32 capture_grads "
          "(added); collective.")
      .def_property_readonly("plan", &RingAttention::plan)
      .def_property_readonly("rank", &RingAttention::rank)
      .def_property_readonly("stats", &RingAttention::stats);

  m.def(
      "_reference_attention",
      [](const Variant& v, const py::buffer& q, const py::buffer& k, const py::buffer& val,
         const std::map<std::string, py::buffer>& captures,
         const std::map<std::string, double>& params, std::optional<double> scale,
         const std::string& dtype) {
        const py::buffer_info qi = q.request(), ki = k.request(), vi = val.request();
        std::vector<int64_t> qs, ks, vs;
        ReferenceProblem p;
        p.q = floats4(qi, "q", qs), p.k = floats4(ki, "k", ks), p.v = floats4(vi, "v", vs);
        p.batch = qs[0], p.q_heads = qs[1], p.q_len = qs[2], p.head_dim = qs[3];
        p.kv_heads = ks[1], p.kv_len = ks[2], p.v_head_dim = vs[3];
        p.scale = scale;
        p.dtype = parse_dtype(dtype);
        for (const auto& [name, value] : params) p.params[name] = value;
        std::vector<py::buffer_info> infos;
        infos.reserve(captures.size());
        for (const auto& [name, a] : captures) {
          infos.push_back(a.request());
          p.captures[name] = host_view(infos.back(), dtype_of(infos.back(), declared_dtype(v, name)));
        }
        ReferenceResult r;
        {
          py::gil_scoped_release release;
          r = reference_attention(v, p);
        }
        return py::make_tuple(raw(r.gold_out), raw(r.gold_lse),
                              py::make_tuple(p.batch, p.q_heads, p.q_len, p.v_head_dim));
      },
      py::arg("variant"), py::arg("q"), py::arg("k"), py::arg("v"),
      py::arg("captures") = std::map<std::string, py::buffer>{},
      py::arg("params") = std::map<std::string, double>{}, py::arg("scale") = py::none(),
      py::arg("dtype") = "bf16");

  // ---- the kernels, on CUDA tensors from any DLPack producer (torch, JAX, CuPy)

  m.def(
      "_dlpack_view",
      [](py::handle x) {
        Borrowed b;
        const TensorView t = b.view(x, "x", 1, false);
        std::vector<int64_t> strides;
        for (size_t i = 0; i < t.rank(); ++i) strides.push_back(t.stride(i));
        return py::make_tuple(std::string(dtype_name(t.dtype)), t.shape, strides);
      },
      "(dtype, shape, strides in elements) of a DLPack tensor as flexc reads it (tests).");

  m.def(
      "attention",
      [](py::handle q, py::handle k, py::handle v, py::handle out, const Variant& variant,
         const BlockMask* block_mask, const py::dict& captures,
         const std::map<std::string, double>& params, std::optional<double> scale, py::handle lse,
         std::optional<int64_t> stream, const std::string& kernel, int64_t q_offset,
         int64_t kv_offset, int64_t seq_q_len, int64_t seq_kv_len, bool prepare) {
        const Stream st(stream);
        Borrowed b;
        AttentionOptions o;
        set_common(o, b, st, captures, params, scale);
        o.block_mask = block_mask;
        if (!lse.is_none()) o.lse = b.view(lse, "lse", st.dlpack, true);
        o.kernel = parse_fwd_kernel(kernel);
        o.q_offset = q_offset, o.kv_offset = kv_offset;
        o.seq_q_len = seq_q_len, o.seq_kv_len = seq_kv_len;
        const TensorView tq = b.view(q, "q", st.dlpack, true), tk = b.view(k, "k", st.dlpack, true),
                         tv = b.view(v, "v", st.dlpack, true),
                         to = b.view(out, "out", st.dlpack, true);
        py::gil_scoped_release release;
        (prepare ? flexc::prepare_attention : flexc::attention)(tq, tk, tv, to, variant, o);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("variant"), py::kw_only(),
      py::arg("block_mask") = nullptr, py::arg("captures") = py::dict(),
      py::arg("params") = std::map<std::string, double>{}, py::arg("scale") = py::none(),
      py::arg("lse") = py::none(), py::arg("stream") = py::none(), py::arg("kernel") = "auto",
      py::arg("q_offset") = 0, py::arg("kv_offset") = 0, py::arg("seq_q_len") = 0,
      py::arg("seq_kv_len") = 0, py::arg("prepare") = false,
      "flexc::attention on CUDA tensors: q [B, Hq, Q_LEN, D], k / v [B, Hkv, KV_LEN, D / Dv], out "
      "[B, Hq, Q_LEN, Dv] (bf16 / fp16), lse float32 [B, Hq, Q_LEN]; enqueued on `stream` (an int "
      "cudaStream_t; None: the legacy default stream). q_offset, kv_offset, seq_q_len, "
      "seq_kv_len: positions (chunked prefill; a block of a longer sequence). prepare=True: "
      "flexc::prepare_attention, everything but the launch (checks, the build the call picks, "
      "compiled and loaded; before a CUDA graph's capture). docs/attention.md.");

  m.def(
      "attention_backward",
      [](py::handle q, py::handle k, py::handle v, py::handle out, py::handle lse, py::handle dout,
         py::handle dq, py::handle dk, py::handle dv, const Variant& variant,
         const BlockMask* block_mask, const py::dict& captures, const py::dict& capture_grads,
         const std::map<std::string, double>& params, std::optional<double> scale, py::handle dlse,
         std::optional<int64_t> stream, std::optional<bool> deterministic,
         const std::string& kernel, const py::object& workspace, int64_t q_offset,
         int64_t kv_offset, int64_t seq_q_len, int64_t seq_kv_len, bool prepare) {
        const Stream st(stream);
        Borrowed b;
        BackwardOptions o;
        o.q_offset = q_offset, o.kv_offset = kv_offset;
        o.seq_q_len = seq_q_len, o.seq_kv_len = seq_kv_len;
        set_common(o, b, st, captures, params, scale);
        o.workspace = workspace_from(workspace);
        o.block_mask = block_mask;
        if (!dlse.is_none()) o.dlse = b.view(dlse, "dlse", st.dlpack, true);
        o.deterministic = deterministic;
        o.kernel = parse_fwd_kernel(kernel);
        AttentionGrads g;
        g.dq = b.view(dq, "dq", st.dlpack, true);
        g.dk = b.view(dk, "dk", st.dlpack, true);
        g.dv = b.view(dv, "dv", st.dlpack, true);
        g.captures = capture_views(b, capture_grads, st);
        const auto view = [&](py::handle x, const char* n) { return b.view(x, n, st.dlpack, true); };
        const TensorView tq = view(q, "q"), tk = view(k, "k"), tv = view(v, "v"),
                         to = view(out, "out"), tl = view(lse, "lse"), td = view(dout, "dout");
        py::gil_scoped_release release;
        (prepare ? flexc::prepare_attention_backward : flexc::attention_backward)(
            tq, tk, tv, to, tl, td, g, variant, o);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dout"),
      py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("variant"), py::kw_only(),
      py::arg("block_mask") = nullptr, py::arg("captures") = py::dict(),
      py::arg("capture_grads") = py::dict(), py::arg("params") = std::map<std::string, double>{},
      py::arg("scale") = py::none(), py::arg("dlse") = py::none(), py::arg("stream") = py::none(),
      py::arg("deterministic") = py::none(), py::arg("kernel") = "auto",
      py::arg("workspace") = py::none(), py::arg("q_offset") = 0, py::arg("kv_offset") = 0,
      py::arg("seq_q_len") = 0, py::arg("seq_kv_len") = 0, py::arg("prepare") = false,
      "flexc::attention_backward on CUDA tensors: writes dq, dk, dv and adds into the float32 "
      "capture_grads (docs/attention.md). workspace: a callable (bytes -> device pointer kept "
      "valid on the stream) for the temporaries; None: flexc's pool. Positions as attention()'s; "
      "prepare=True: flexc::prepare_attention_backward.");

  m.def(
      "decode",
      [](py::handle q, py::handle k, py::handle v, py::handle kv_lens, py::handle out,
         const Variant& variant, py::handle page_table, py::handle q_offsets,
         const py::dict& captures, const std::map<std::string, double>& params,
         std::optional<double> scale, py::handle lse, std::optional<int64_t> stream, int num_splits,
         int64_t max_kv_len, bool check_device_args, const py::object& workspace, bool prepare) {
        const Stream st(stream);
        Borrowed b;
        const auto view = [&](py::handle x, const char* n) { return b.view(x, n, st.dlpack, true); };
        KvCache cache;
        cache.k = view(k, "k");
        cache.v = view(v, "v");
        cache.kv_lens = view(kv_lens, "kv_lens");
        cache.page_table = b.view_or_none(page_table, "page_table", st.dlpack, true);
        cache.q_offsets = b.view_or_none(q_offsets, "q_offsets", st.dlpack, true);
        DecodeOptions o;
        set_common(o, b, st, captures, params, scale);
        o.lse = b.view_or_none(lse, "lse", st.dlpack, true);
        o.num_splits = num_splits;
        o.max_kv_len = max_kv_len;
        o.check_device_args = check_device_args;
        o.workspace = workspace_from(workspace);
        const TensorView tq = view(q, "q"), to = view(out, "out");
        py::gil_scoped_release release;
        (prepare ? flexc::prepare_decode : flexc::decode)(tq, cache, to, variant, o);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("kv_lens"), py::arg("out"),
      py::arg("variant"), py::kw_only(), py::arg("page_table") = py::none(),
      py::arg("q_offsets") = py::none(), py::arg("captures") = py::dict(),
      py::arg("params") = std::map<std::string, double>{}, py::arg("scale") = py::none(),
      py::arg("lse") = py::none(), py::arg("stream") = py::none(), py::arg("num_splits") = 0,
      py::arg("max_kv_len") = 0, py::arg("check_device_args") = false,
      py::arg("workspace") = py::none(), py::arg("prepare") = false,
      "flexc::decode on CUDA tensors: a contiguous [B, Hkv, CAP, D] or paged [PAGES, Hkv, "
      "PAGE_SIZE, D] cache with int32 kv_lens [B] (page_table [B, MAX_PAGES], q_offsets [B]) "
      "(docs/decode.md). prepare=True: flexc::prepare_decode, everything but the launch.");

  m.def(
      "linear_attention",
      [](py::handle q, py::handle k, py::handle v, py::handle out, py::handle g,
         py::handle initial_state, py::handle final_state, std::optional<double> scale,
         std::optional<int64_t> stream, const py::object& workspace,
         const std::optional<LinearVariant>& variant) {
        const Stream st(stream);
        Borrowed b;
        const auto view = [&](py::handle x, const char* n) { return b.view(x, n, st.dlpack, true); };
        const TensorView tq = view(q, "q"), tk = view(k, "k"), tv = view(v, "v"),
                         to = view(out, "out");
        LinearOptions o;
        o.g = b.view_or_none(g, "g", st.dlpack, true);
        o.initial_state = b.view_or_none(initial_state, "initial_state", st.dlpack, true);
        o.final_state = b.view_or_none(final_state, "final_state", st.dlpack, true);
        o.scale = scale;
        if (variant) o.feature_map = variant->feature_map();
        o.stream = st.cuda;
        o.workspace = workspace_from(workspace);
        py::gil_scoped_release release;
        flexc::linear_attention(tq, tk, tv, to, o);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::kw_only(),
      py::arg("g") = py::none(), py::arg("initial_state") = py::none(),
      py::arg("final_state") = py::none(), py::arg("scale") = py::none(),
      py::arg("stream") = py::none(), py::arg("workspace") = py::none(),
      py::arg("variant") = py::none(),
      "flexc::linear_attention on CUDA tensors: gated linear attention, chunkwise; g [B, H, T, "
      "DK] or [B, H, T] log gates; variant: its feature map applies to q and k "
      "(docs/linear.md).");

  m.def(
      "linear_attention_backward",
      [](py::handle q, py::handle k, py::handle v, py::handle dout, py::handle dq, py::handle dk,
         py::handle dv, py::handle g, py::handle dg, py::handle initial_state,
         py::handle d_initial_state, py::handle d_final_state, std::optional<double> scale,
         std::optional<int64_t> stream, const py::object& workspace,
         const std::optional<LinearVariant>& variant) {
        const Stream st(stream);
        Borrowed b;
        const auto view = [&](py::handle x, const char* n) { return b.view(x, n, st.dlpack, true); };
        const TensorView tq = view(q, "q"), tk = view(k, "k"), tv = view(v, "v"),
                         tdo = view(dout, "dout");
        LinearGradients grads;
        grads.dq = view(dq, "dq");
        grads.dk = view(dk, "dk");
        grads.dv = view(dv, "dv");
        grads.dg = b.view_or_none(dg, "dg", st.dlpack, true);
        grads.d_initial_state =
            b.view_or_none(d_initial_state, "d_initial_state", st.dlpack, true);
        LinearBackwardOptions o;
        o.g = b.view_or_none(g, "g", st.dlpack, true);
        o.initial_state = b.view_or_none(initial_state, "initial_state", st.dlpack, true);
        o.d_final_state = b.view_or_none(d_final_state, "d_final_state", st.dlpack, true);
        o.scale = scale;
        if (variant) o.feature_map = variant->feature_map();
        o.stream = st.cuda;
        o.workspace = workspace_from(workspace);
        py::gil_scoped_release release;
        flexc::linear_attention_backward(tq, tk, tv, tdo, grads, o);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("dout"), py::arg("dq"), py::arg("dk"),
      py::arg("dv"), py::kw_only(), py::arg("g") = py::none(), py::arg("dg") = py::none(),
      py::arg("initial_state") = py::none(), py::arg("d_initial_state") = py::none(),
      py::arg("d_final_state") = py::none(), py::arg("scale") = py::none(),
      py::arg("stream") = py::none(), py::arg("workspace") = py::none(),
      py::arg("variant") = py::none(),
      "flexc::linear_attention_backward on CUDA tensors: recomputes from q, k, v, g and "
      "initial_state, and writes dq, dk, dv, dg (required exactly when g is given, g's shape) and "
      "d_initial_state (optional) given dout and d_final_state (None: zeros) (docs/linear.md).");

  m.def(
      "linear_attention_step",
      [](py::handle q, py::handle k, py::handle v, py::handle state, py::handle out,
         py::handle g, std::optional<double> scale, std::optional<int64_t> stream,
         const std::optional<LinearVariant>& variant) {
        const Stream st(stream);
        Borrowed b;
        const auto view = [&](py::handle x, const char* n) { return b.view(x, n, st.dlpack, true); };
        const TensorView tq = view(q, "q"), tk = view(k, "k"), tv = view(v, "v"),
                         ts = view(state, "state"), to = view(out, "out");
        LinearOptions o;
        o.g = b.view_or_none(g, "g", st.dlpack, true);
        o.scale = scale;
        if (variant) o.feature_map = variant->feature_map();
        o.stream = st.cuda;
        py::gil_scoped_release release;
        flexc::linear_attention_step(tq, tk, tv, ts, to, o);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("state"), py::arg("out"), py::kw_only(),
      py::arg("g") = py::none(), py::arg("scale") = py::none(), py::arg("stream") = py::none(),
      py::arg("variant") = py::none(),
      "flexc::linear_attention_step on CUDA tensors: the recurrence over q's T tokens, the "
      "float32 state [B, H, DK, DV] updated in place (docs/linear.md).");
}
