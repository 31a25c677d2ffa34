// Uses flexc as a dependency: a variant from expressions and one from the catalogue, composed,
// then its BlockMask built on the CPU (no GPU needed). Prints what it built; exits 1 on a wrong
// result.
#include <flexc/flexc.h>

#include <cstdio>

int main() {
  try {
    const flexc::Variant window =
        flexc::Variant::from_strings("score", "q_idx - kv_idx < 256", {}, {}, "window");
    const flexc::Variant causal_window =
        flexc::and_masks(flexc::Variant::from_catalogue("causal"), window);
    flexc::BlockMaskOptions opts;
    opts.device = flexc::BuildDevice::Cpu;
    const flexc::BlockMask mask = flexc::create_block_mask(causal_window, 1, 1, 1024, 1024, opts);
    std::printf("%s: mask_mod %s, sparsity %.1f%%\n%s", causal_window.name().c_str(),
                causal_window.mask_mod_text().c_str(), mask.sparsity(), mask.to_string().c_str());
    // 8 x 8 tiles of 128: q tile i keeps kv tiles i - 2 .. i (q - kv reaches 257 only from
    // i - 3 on), 8 + 7 + 6 = 21 of 64.
    const double want = 100.0 * (64 - 21) / 64;
    if (mask.sparsity() < want - 1e-9 || mask.sparsity() > want + 1e-9) {
      std::printf("expected sparsity %.4f%%\n", want);
      return 1;
    }
  } catch (const flexc::Error& e) {
    std::fprintf(stderr, "flexc_consumer: %s\n", e.what());
    return 1;
  }
  return 0;
}
