// Decode attention on CPU, reading K/V pages where they lie: the XLA FFI custom call behind
// `jaxcpp.kernels.cpu_decode_attention` (which builds this file with the host's C++ compiler).
//
// XLA:CPU can only read pages through a gather that copies every page of every decode row into a fresh
// operand, each layer, each step (and transposes it for its batched dot); this kernel reads each row's
// K and V once, from the cache itself, as vLLM's CPU attention does.
//
// One task per decode row, all its KV heads at once (a position's K, and its V, of every head lie
// together in the page): each query head scores every visible position, then a softmax over the whole
// row (max, exp, sum: two passes over a row's scores, one over its K and one over its V) and the
// probability-weighted sum of V. fp32 throughout. A row's result depends on its own
// inputs only, never on the rows beside it. Tasks are shared with XLA's intra-op thread pool: the
// calling thread claims tasks too and only waits for tasks other threads are running, so a pool whose
// threads are all busy cannot stall it.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float* q;         // [rows, kv_heads, group, head_dim], scaled
  const float* k_pages;   // [num_pages, page_size, kv_heads, head_dim]
  const float* v_pages;   // [num_pages, page_size, kv_heads, head_dim]
  const int32_t* pages;   // [rows, pages_per_row]
  const int32_t* visible; // [rows]: KV positions each row sees (0: the row comes out 0)
  float* out;             // [rows, kv_heads, group, head_dim]
  int64_t rows, kv_heads, group, head_dim, num_pages, page_size, pages_per_row;
};

// head_dim as a template argument where it is a common size: loops the compiler unrolls and vectorizes
// whole (0: any size, read from the problem).
template <int64_t kHeadDim>
float dot(const float* a, const float* b, int64_t n) {
  if constexpr (kHeadDim > 0) n = kHeadDim;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// exp(x) for x <= 0 (a score minus its row's max), within 2 ulp of std::exp: Cephes' expf (x = n ln2 + r,
// |r| <= ln2 / 2, a degree-6 polynomial of r, times 2^n built in the exponent bits), written so that the
// compiler vectorizes the softmax loop over it; std::exp is a library call per element and was the
// largest part of a small-head row (head_dim 32: one exp per 64 multiply-adds). Below -87.3 (2^-126,
// the smallest normal float) it returns that instead of underflowing further: a term of 1e-38 beside
// the max's own term of 1 changes no float32 sum.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;  // ln 2 in two parts (Cody-Waite), exact in n * hi
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// Row `row`: out[row] = softmax(q k^T) v over the row's visible positions, every KV head at once, so that
// each position's K (then V) of all heads, contiguous in the page, is read in one sweep.
template <int64_t kHeadDim>
void attend(const Problem& p, int64_t row) {
  const int64_t d = kHeadDim > 0 ? kHeadDim : p.head_dim;
  const int64_t heads = p.kv_heads * p.group;  // query heads; query head x reads KV head x / group
  const float* q = p.q + row * heads * d;
  float* out = p.out + row * heads * d;
  std::fill(out, out + heads * d, 0.0f);
  const int64_t len = std::min<int64_t>(p.visible[row], p.pages_per_row * p.page_size);
  if (len <= 0) return;
  const int32_t* row_pages = p.pages + row * p.pages_per_row;
  auto position = [&](const float* pool, int64_t j) {  // [kv_heads, head_dim] of position j
    const int64_t page = std::clamp<int64_t>(row_pages[j / p.page_size], 0, p.num_pages - 1);
    return pool + (page * p.page_size + j % p.page_size) * p.kv_heads * d;
  };

  thread_local std::vector<float> scores;  // [heads, len]: each head's softmax runs over contiguous scores
  scores.resize(heads * len);
  for (int64_t j = 0; j < len; ++j) {
    const float* k = position(p.k_pages, j);
    for (int64_t h = 0; h < heads; ++h) scores[h * len + j] = dot<kHeadDim>(q + h * d, k + h / p.group * d, d);
  }
  thread_local std::vector<float> denom;
  denom.assign(heads, 0.0f);
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores.data() + h * len;
    float max = -INFINITY;
#pragma omp simd reduction(max : max)
    for (int64_t j = 0; j < len; ++j) max = std::max(max, s[j]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < len; ++j) {
      s[j] = exp_nonpositive(s[j] - max);
      sum += s[j];
    }
    denom[h] = sum;  // >= 1: the max's own term is exp(0)
  }
  for (int64_t j = 0; j < len; ++j) {
    const float* v = position(p.v_pages, j);
    for (int64_t h = 0; h < heads; ++h) {
      const float weight = scores[h * len + j];
      const float* vh = v + h / p.group * d;
      float* o = out + h * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] += weight * vh[i];
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = 1.0f / denom[h];
    float* o = out + h * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) o[i] *= inv;
  }
}

void attend(const Problem& p, int64_t row) {
  switch (p.head_dim) {
    case 64: return attend<64>(p, row);
    case 128: return attend<128>(p, row);
    default: return attend<0>(p, row);
  }
}

// Tasks claimed from one counter by the caller and by pool threads alike.
struct Work {
  Problem problem;
  int64_t total = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;

  void run() {
    int64_t i;
    while ((i = next.fetch_add(1)) < total) {
      attend(problem, i);
      if (done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(mu);
        all_done.notify_all();
      }
    }
  }
};

ffi::Error PagedDecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                                ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> pages,
                                ffi::Buffer<ffi::S32> visible, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), vd = v_pages.dimensions(), pd = pages.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin()) ||
      pd.size() != 2 || kd[2] != qd[1] || kd[3] != qd[3] || pd[0] != qd[0] || visible.dimensions().size() != 1 ||
      visible.dimensions()[0] != qd[0]) {
    return ffi::Error::InvalidArgument(
        "paged_decode_attention: want q [rows, kv_heads, group, head_dim], pages [num_pages, page_size, "
        "kv_heads, head_dim] (K and V alike), page table [rows, pages_per_row], visible [rows]");
  }
  auto work = std::make_shared<Work>();
  work->problem = Problem{q.typed_data(), k_pages.typed_data(), v_pages.typed_data(), pages.typed_data(),
                          visible.typed_data(), out->typed_data(), qd[0], qd[1], qd[2], qd[3],
                          kd[0], kd[1], pd[1]};
  work->total = qd[0];
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  std::unique_lock<std::mutex> lock(work->mu);
  work->all_done.wait(lock, [&] { return work->done.load() == work->total; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcppPagedDecodeAttention, PagedDecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
