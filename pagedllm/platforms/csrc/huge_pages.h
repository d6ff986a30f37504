// Weight buffers on 2 MiB pages where the OS gives them (Linux transparent huge pages in `madvise` mode, the
// common default): a decode step streams every weight once, and on 4 KiB pages the CPU's prefetchers stop at
// each page boundary and each page costs a TLB walk. Measured on Zen 4/5, one row of x against Q4_0 repacked
// weights (benchmarks/huge_pages_gemv.py, two interleaved rounds): 1536 x 2048 (1.7 MB) 22.3 / 24.4 -> 24.2 / 26.4
// GB/s, 6144 x 2048 22.8 / 25.6 -> 26.9 / 27.1 GB/s. Elsewhere: an ordinary allocation.
#pragma once
#include <torch/types.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

// a zeroed contiguous tensor whose data starts on a 2 MiB boundary, advised for huge pages before its pages
// are first touched (the advice applies to pages faulted in afterwards); the slack before it is never touched
inline torch::Tensor zeros_on_huge_pages(at::IntArrayRef sizes, const at::TensorOptions& options) {
  constexpr int64_t kHuge = int64_t{2} << 20;
  int64_t n = 1;
  for (auto s : sizes) n *= s;
  const int64_t bytes = n * static_cast<int64_t>(c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes >= kHuge) {
    auto raw = torch::empty({bytes + kHuge}, options.dtype(torch::kUInt8));
    const auto p = reinterpret_cast<uintptr_t>(raw.data_ptr<uint8_t>());
    const int64_t off = static_cast<int64_t>(((p + kHuge - 1) & ~static_cast<uintptr_t>(kHuge - 1)) - p);
    madvise(reinterpret_cast<void*>(p + off), static_cast<size_t>(bytes), MADV_HUGEPAGE);  // advice: may fail
    auto out = raw.narrow(0, off, bytes).view(c10::typeMetaToScalarType(options.dtype())).view(sizes);
    out.zero_();
    return out;
  }
#endif
  return torch::zeros(sizes, options);
}
