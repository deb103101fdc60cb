// Paged attention on CPU, reading K/V pages where they lie: the XLA FFI custom calls behind
// `jaxcpp.kernels.cpu_attention` (which builds this file with the host's C++ compiler), one for a step's
// decode rows and one for its prefill chunks.
//
// XLA:CPU can only read pages through a gather that copies every page a query block sees into a fresh
// operand, each layer, each step (and transposes it for its batched dot); these kernels read each K and V
// position from the cache itself, as vLLM's CPU attention does.
//
// Decode: one task per decode row: each query head scores every visible position 16 at a time (their
// products kept as vectors and reduced together), then a softmax over the whole row and the weighted sum
// of V in registers.
//
// Prefill: one task per (query block of one chunk, KV head): the block's rows (its tokens x the query
// heads of that KV head) fold the chunk's visible KV positions in blocks of kKvBlock into an online
// softmax. Queries are held transposed ([head_dim, rows]) and scores too ([position, row]), so that q.k
// is multiply-adds along 16 rows at once and the softmax runs along rows with no reduction across a
// vector; p.v is a register tile of rows x head_dim.
//
// fp32 throughout. A row's result depends on its own inputs only, never on the rows beside it. Tasks are
// shared with XLA's intra-op thread pool: the calling thread claims tasks too and only waits for tasks
// other threads are running, so a pool whose threads are all busy cannot stall it.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Tasks claimed from one counter by the caller and by pool threads alike; `run_tasks` returns when all
// `total` are done.
struct Work {
  std::function<void(int64_t)> task;
  int64_t total = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;

  void run() {
    int64_t i;
    while ((i = next.fetch_add(1)) < total) {
      task(i);
      if (done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(mu);
        all_done.notify_all();
      }
    }
  }
};

void run_tasks(ffi::ThreadPool& pool, int64_t total, std::function<void(int64_t)> task) {
  if (total <= 0) return;
  auto work = std::make_shared<Work>();
  work->task = std::move(task);
  work->total = total;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  std::unique_lock<std::mutex> lock(work->mu);
  work->all_done.wait(lock, [&] { return work->done.load() == work->total; });
}

constexpr int64_t kLanes = 16;  // floats in a vector register (AVX-512; two AVX2 registers elsewhere)
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IntVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

// exp(x) for x <= 0 (a score minus its row's max), on a vector of floats, within 2 ulp of std::exp:
// Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial of r, times 2^n built in the
// exponent bits). std::exp is a library call per element and was the largest part of a small-head row
// (head_dim 32: one exp per 64 multiply-adds), and a loop of scalar calls to this formula was left
// unvectorized by the compiler. Below -87.3 (2^-126, the smallest normal float) it returns that instead
// of underflowing further: a term of 1e-38 beside the max's own term of 1 changes no float32 sum.
inline Vec exp_nonpositive(Vec x) {
  x = x < -87.3f ? Vec{} - 87.3f : x;
  Vec n = x * 1.44269504088896341f + 0.5f;  // then rounded down: its integer part, minus 1 below zero
  const Vec whole = __builtin_convertvector(__builtin_convertvector(n, IntVec), Vec);
  n = whole > n ? whole - 1.0f : whole;
  Vec r = x - n * 0.693359375f;  // ln 2 in two parts (Cody-Waite), exact in n * hi
  r = r - n * -2.12194440e-4f;
  Vec p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * reinterpret_cast<Vec>((__builtin_convertvector(n, IntVec) + 127) << 23);  // times 2^n
}

// Where positions [0, count) of a sequence lie in a page pool, page by page (no division per position):
// position j's [kv_heads, head_dim] row starts offsets[j] floats into the pool. Page ids are clamped into
// the pool, as XLA's gather clamps them.
void position_offsets(const int32_t* seq_pages, int64_t count, int64_t page_size, int64_t num_pages,
                      int64_t row_floats, std::vector<int64_t>& offsets) {
  offsets.resize(count);
  for (int64_t j = 0, page = 0; j < count; ++page) {
    const int64_t first = std::clamp<int64_t>(seq_pages[page], 0, num_pages - 1) * page_size;
    for (int64_t o = 0; o < page_size && j < count; ++o, ++j) offsets[j] = (first + o) * row_floats;
  }
}

// Ask for the cache lines of positions [from, to) (those below offsets.size()), columns [0, width) of
// each, ahead of their use. A page of K or V rows is a few KB, the size of the memory pages hardware
// prefetchers stop at, and the next page of a sequence lies anywhere in the pool: without this every
// page of a row starts with cache misses.
inline void prefetch_rows(const float* base, const std::vector<int64_t>& offsets, int64_t from, int64_t to,
                          int64_t width) {
  to = std::min<int64_t>(to, offsets.size());
  for (int64_t j = from; j < to; ++j)
    for (int64_t i = 0; i < width; i += kLanes) __builtin_prefetch(base + offsets[j] + i);
}

// ---- Decode rows ----

struct DecodeProblem {
  const float* q;         // [rows, kv_heads, group, head_dim], scaled
  const float* k_pages;   // [num_pages, page_size, kv_heads, head_dim]
  const float* v_pages;   // [num_pages, page_size, kv_heads, head_dim]
  const int32_t* pages;   // [rows, pages_per_row]
  const int32_t* visible; // [rows]: KV positions each row sees (0: the row comes out 0)
  float* out;             // [rows, kv_heads, group, head_dim]
  int64_t rows, kv_heads, group, head_dim, num_pages, page_size, pages_per_row;
};

// The lane sums of 16 vectors as one vector: lane t holds the sum of in[t]'s lanes. A network of
// 15 folds (each two shuffles and an add) where summing each vector alone would take 16 reductions of 4
// dependent steps each; `fold<w>` adds each 2w-lane group's halves, a's into the group's first w lanes
// and b's into its last w.
template <int w, int... lane>
constexpr IntVec fold_mask(std::integer_sequence<int, lane...>, int shift) {
  return IntVec{(lane / (2 * w) * (2 * w) + (lane % (2 * w) < w ? lane % (2 * w) : kLanes + lane % (2 * w) - w) +
                 shift)...};
}

template <int w>
inline Vec fold(Vec a, Vec b) {  // masks known at compile time: the compiler picks the cheapest shuffles
  constexpr auto lanes = std::make_integer_sequence<int, kLanes>();
  return __builtin_shuffle(a, b, fold_mask<w>(lanes, 0)) + __builtin_shuffle(a, b, fold_mask<w>(lanes, w));
}

inline Vec lane_sums(const Vec* in) {
  Vec v[kLanes];
  for (int t = 0; t < kLanes; ++t) {  // the folds leave input k's sum in lane bit_reverse(k): feed them so
    const int reversed = ((t & 1) << 3) | ((t & 2) << 1) | ((t & 4) >> 1) | ((t & 8) >> 3);
    v[t] = in[reversed];
  }
  for (int k = 0; k < 8; ++k) v[k] = fold<8>(v[2 * k], v[2 * k + 1]);
  for (int k = 0; k < 4; ++k) v[k] = fold<4>(v[2 * k], v[2 * k + 1]);
  for (int k = 0; k < 2; ++k) v[k] = fold<2>(v[2 * k], v[2 * k + 1]);
  return fold<1>(v[0], v[1]);
}

// Row `row`: out[row] = softmax(q k^T) v over the row's visible positions, head by head; positions in
// tiles of kLanes: a head's products with a tile's K rows are kept as vectors of partial sums and reduced
// together (`lane_sums`), the softmax runs on vectors, and a head's weighted sum of V stays in registers
// across the positions. head_dim as a template argument where it is a common size (the loops unroll);
// any other size runs the same code with a scalar tail.
template <int64_t kHeadDim>
void attend_decode(const DecodeProblem& p, int64_t row) {
  const int64_t d = kHeadDim > 0 ? kHeadDim : p.head_dim, full = d / kLanes * kLanes;
  const int64_t heads = p.kv_heads * p.group;  // query heads; query head x reads KV head x / group
  const float* q = p.q + row * heads * d;
  float* out = p.out + row * heads * d;
  std::fill(out, out + heads * d, 0.0f);
  const int64_t len = std::min<int64_t>(p.visible[row], p.pages_per_row * p.page_size);
  if (len <= 0) return;
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;
  thread_local std::vector<float> scores;  // [heads, padded]
  thread_local std::vector<int64_t> offsets;
  scores.resize(heads * padded);
  position_offsets(p.pages + row * p.pages_per_row, len, p.page_size, p.num_pages, p.kv_heads * d, offsets);
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + h * d;
    const int64_t kv = h / p.group * d;
    const bool first_of_group = h % p.group == 0;  // the group's other heads find its rows in cache
    float* s = scores.data() + h * padded;
    for (int64_t j0 = 0; j0 < padded; j0 += kLanes) {
      if (first_of_group) prefetch_rows(p.k_pages + kv, offsets, j0 + kLanes, j0 + 2 * kLanes, d);
      Vec part[kLanes];
      for (int t = 0; t < kLanes; ++t) {
        const float* k = p.k_pages + offsets[std::min(j0 + t, len - 1)] + kv;  // past len: the last again
        Vec sum = {};
        for (int64_t i = 0; i < full; i += kLanes) sum += load(qh + i) * load(k + i);
        for (int64_t i = full; i < d; ++i) sum[0] += qh[i] * k[i];
        part[t] = sum;
      }
      store(s + j0, lane_sums(part));
    }
    Vec max = Vec{} - INFINITY;
    for (int64_t j = 0; j < padded; j += kLanes) {
      const Vec x = load(s + j);
      max = x > max ? x : max;
    }
    float row_max = -INFINITY;
    for (int l = 0; l < kLanes; ++l) row_max = std::max(row_max, max[l]);
    for (int64_t j = 0; j < padded; j += kLanes) store(s + j, exp_nonpositive(load(s + j) - row_max));
    std::fill(s + len, s + padded, 0.0f);  // past the row: the last tile repeated its last position
    Vec sum = {};
    for (int64_t j = 0; j < padded; j += kLanes) sum += load(s + j);
    float denom = 0.0f;  // >= 1: the max's own term is exp(0)
    for (int l = 0; l < kLanes; ++l) denom += sum[l];
    float* o = out + h * d;
    for (int64_t c = 0; c < full; c += 4 * kLanes) {  // up to 4 vectors of the output in registers,
      const int64_t n = std::min<int64_t>(4, (full - c) / kLanes);  // 4 positions' sums apart (no waiting
      Vec acc[4][4] = {};                                           // on one chain of adds)
      const float* v = p.v_pages + kv + c;  // + a position's offset: its head's columns [c, c + 64)
      int64_t j = 0;
      for (; j + 4 <= len; j += 4) {
        if (first_of_group) prefetch_rows(v, offsets, j + kLanes, j + kLanes + 4, n * kLanes);
        for (int u = 0; u < 4; ++u)
          for (int64_t t = 0; t < n; ++t) acc[u][t] += s[j + u] * load(v + offsets[j + u] + t * kLanes);
      }
      for (; j < len; ++j)
        for (int64_t t = 0; t < n; ++t) acc[0][t] += s[j] * load(v + offsets[j] + t * kLanes);
      for (int64_t t = 0; t < n; ++t)
        store(o + c + t * kLanes, ((acc[0][t] + acc[1][t]) + (acc[2][t] + acc[3][t])) / denom);
    }
    for (int64_t i = full; i < d; ++i) {
      float acc = 0.0f;
      for (int64_t j = 0; j < len; ++j) acc += s[j] * p.v_pages[offsets[j] + kv + i];
      o[i] = acc / denom;
    }
  }
}

void attend_decode(const DecodeProblem& p, int64_t row) {
  switch (p.head_dim) {
    case 32: return attend_decode<32>(p, row);
    case 64: return attend_decode<64>(p, row);
    case 128: return attend_decode<128>(p, row);
    default: return attend_decode<0>(p, row);
  }
}

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
  const DecodeProblem problem{q.typed_data(), k_pages.typed_data(), v_pages.typed_data(), pages.typed_data(),
                              visible.typed_data(), out->typed_data(), qd[0], qd[1], qd[2], qd[3],
                              kd[0], kd[1], pd[1]};
  run_tasks(pool, qd[0], [&problem](int64_t row) { attend_decode(problem, row); });
  return ffi::Error::Success();
}

// ---- Prefill chunks ----

constexpr int64_t kQueryRows = 64;  // rows (tokens x query heads of one KV head) a task owns, at most
constexpr int64_t kKvBlock = 128;   // KV positions folded into the online softmax at once
constexpr int64_t kWidth = 2 * kLanes;  // V's head_dim is padded to a multiple of this in the task's buffer

struct PrefillProblem {
  const float* q;           // [tokens, kv_heads, group, head_dim], scaled
  const float* k_pages;     // [num_pages, page_size, kv_heads, head_dim]
  const float* v_pages;
  const int32_t* cu_q_lens; // [seqs + 1]: where each sequence's query tokens start
  const int32_t* kv_lens;   // [seqs]: cached prefix + new tokens
  const int32_t* pages;     // [seqs, pages_per_seq]
  float* out;               // [tokens, kv_heads, group, head_dim]
  int64_t tokens, kv_heads, group, head_dim, num_pages, page_size, pages_per_seq;
};

struct QueryBlock {  // tokens [first, first + count) of sequence `seq`, one KV head
  int64_t seq, first, count, kv_head, visible_end;  // visible_end: KV positions its last token sees
};

// scores[j][rows] = k[j] . qt[:, rows] for 4 positions and kChunks x kLanes rows: up to 16 accumulators in
// registers, each multiply-add along the rows (Q is held transposed, [head_dim][stride]).
template <int kChunks>
inline void score_tile(const float* const* k, const float* qt, float* scores, int64_t d, int64_t stride) {
  Vec acc[4][kChunks] = {};
  for (int64_t i = 0; i < d; ++i) {
    Vec q[kChunks];
    for (int c = 0; c < kChunks; ++c) q[c] = load(qt + i * stride + c * kLanes);
    for (int j = 0; j < 4; ++j) {
      const float kj = k[j][i];
      for (int c = 0; c < kChunks; ++c) acc[j][c] += kj * q[c];
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int c = 0; c < kChunks; ++c) store(scores + j * stride + c * kLanes, acc[j][c]);
}

inline void score_tiles(const float* const* k, const float* qt, float* scores, int64_t d, int64_t stride) {
  for (int64_t r = 0; r < stride; r += 4 * kLanes) {  // more than 64 rows only where group > 64
    switch (std::min<int64_t>(4, (stride - r) / kLanes)) {
      case 1: score_tile<1>(k, qt + r, scores + r, d, stride); break;
      case 2: score_tile<2>(k, qt + r, scores + r, d, stride); break;
      case 3: score_tile<3>(k, qt + r, scores + r, d, stride); break;
      default: score_tile<4>(k, qt + r, scores + r, d, stride);
    }
  }
}

// out[r][cols] += sum_j p[j][r] v[j][cols] for 8 rows and kWidth columns: 16 accumulators in registers.
inline void weigh_tile(const float* p, const float* v, float* out, int64_t positions, int64_t stride,
                       int64_t width) {
  Vec acc[8][2];
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < 2; ++c) acc[r][c] = load(out + r * width + c * kLanes);
  for (int64_t j = 0; j < positions; ++j) {
    const Vec v0 = load(v + j * width), v1 = load(v + j * width + kLanes);
    for (int r = 0; r < 8; ++r) {
      const float w = p[j * stride + r];
      acc[r][0] += w * v0;
      acc[r][1] += w * v1;
    }
  }
  for (int r = 0; r < 8; ++r)
    for (int c = 0; c < 2; ++c) store(out + r * width + c * kLanes, acc[r][c]);
}

// One task: the block's rows (token-major: row r is token first + r / group, query head
// kv_head * group + r % group) attend to KV positions [0, position + 1) each, in blocks of kKvBlock.
// Scores are held transposed, [position][row], so that the online softmax (max, exp, sum, correction)
// runs along kLanes rows at once and never reduces across a vector. Rows are padded to a multiple of
// kLanes (padding rows: a zero query at the last row's position, never written out), V's head_dim to
// a multiple of kWidth.
void attend_prefill(const PrefillProblem& p, const QueryBlock& b) {
  const int64_t d = p.head_dim, width = (d + kWidth - 1) / kWidth * kWidth;
  const int64_t rows = b.count * p.group, stride = (rows + kLanes - 1) / kLanes * kLanes;
  thread_local std::vector<float> qt, v, scores, acc, position, row_max, denom;
  thread_local std::vector<int64_t> offsets;
  position_offsets(p.pages + b.seq * p.pages_per_seq, b.visible_end, p.page_size, p.num_pages, p.kv_heads * d,
                   offsets);
  qt.assign(d * stride, 0.0f);                // [head_dim, stride]: Q transposed
  v.assign(kKvBlock * width, 0.0f);           // [kKvBlock, width]
  scores.resize(kKvBlock * stride);           // [kKvBlock, stride]
  acc.assign(stride * width, 0.0f);           // [stride, width]
  position.resize(stride);                    // of each row's token (float: exact below 2^24)
  row_max.assign(stride, -INFINITY);
  denom.assign(stride, 0.0f);
  auto row_at = [&](int64_t r) {  // row r's [head_dim] offset in q and out ([tokens, kv_heads, group, head_dim])
    return (((b.first + r / p.group) * p.kv_heads + b.kv_head) * p.group + r % p.group) * d;
  };
  for (int64_t r = 0; r < stride; ++r) {
    position[r] = static_cast<float>(b.visible_end - b.count + std::min(r, rows - 1) / p.group);
    if (r >= rows) continue;
    for (int64_t i = 0; i < d; ++i) qt[i * stride + r] = p.q[row_at(r) + i];
  }
  auto at = [&](const float* pool, int64_t j) { return pool + offsets[j] + b.kv_head * d; };  // [head_dim]

  for (int64_t j0 = 0; j0 < b.visible_end; j0 += kKvBlock) {
    const int64_t n = std::min(kKvBlock, b.visible_end - j0);
    for (int64_t j = 0; j < n; ++j) std::copy_n(at(p.v_pages, j0 + j), d, v.data() + j * width);
    for (int64_t j = 0; j < n; j += 4) {  // positions past n repeat the last one: masked below
      const float* k[4];
      for (int t = 0; t < 4; ++t) k[t] = at(p.k_pages, j0 + std::min(j + t, n - 1));
      score_tiles(k, qt.data(), scores.data() + j * stride, d, stride);
    }
    // The online softmax, kLanes rows at a time; position j0 + j is seen by rows at or past it (causal).
    for (int64_t c = 0; c < stride; c += kLanes) {
      const Vec row_position = load(position.data() + c);
      Vec block_max = Vec{} - INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const Vec s = load(scores.data() + j * stride + c);
        block_max = (row_position >= static_cast<float>(j0 + j) && s > block_max) ? s : block_max;
      }
      const Vec old_max = load(row_max.data() + c);
      const Vec new_max = old_max > block_max ? old_max : block_max;  // finite: every row sees position 0
      const Vec correction = exp_nonpositive(old_max - new_max);      // the rows' first block: times ~0
      Vec sum = {};
      for (int64_t j = 0; j < n; ++j) {
        float* s = scores.data() + j * stride + c;
        const Vec e = row_position >= static_cast<float>(j0 + j) ? exp_nonpositive(load(s) - new_max) : Vec{};
        store(s, e);
        sum += e;
      }
      store(row_max.data() + c, new_max);
      store(denom.data() + c, load(denom.data() + c) * correction + sum);
      for (int64_t r = 0; r < kLanes; ++r) {
        float* o = acc.data() + (c + r) * width;
        for (int64_t i = 0; i < width; ++i) o[i] *= correction[r];
      }
    }
    for (int64_t r = 0; r < stride; r += 8)
      for (int64_t c = 0; c < width; c += kWidth)
        weigh_tile(scores.data() + r, v.data() + c, acc.data() + r * width + c, n, stride, width);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = p.out + row_at(r);
    const float inv = 1.0f / denom[r];  // >= 1: a row sees position 0 at least, and its max's own term
    for (int64_t i = 0; i < d; ++i) dst[i] = acc[r * width + i] * inv;
  }
}

// The step's query blocks of prefill sequences [first_seq, last_seq), costliest (furthest-seeing) first so
// that the last tasks claimed are short ones.
std::vector<QueryBlock> query_blocks(const PrefillProblem& p, int64_t first_seq, int64_t last_seq) {
  const int64_t block_tokens = std::max<int64_t>(1, kQueryRows / p.group);
  std::vector<QueryBlock> blocks;
  for (int64_t s = first_seq; s < last_seq; ++s) {
    const int64_t start = std::clamp<int64_t>(p.cu_q_lens[s], 0, p.tokens);
    const int64_t end = std::clamp<int64_t>(p.cu_q_lens[s + 1], start, p.tokens);
    const int64_t kv_len = std::min<int64_t>(p.kv_lens[s], p.pages_per_seq * p.page_size);
    const int64_t prefix = kv_len - (end - start);  // cached positions before the chunk
    for (int64_t t = start; t < end; t += block_tokens) {
      const int64_t count = std::min(block_tokens, end - t);
      const int64_t visible_end = prefix + (t - start) + count;
      if (visible_end - count < 0) continue;  // inconsistent lengths: leave the rows 0
      for (int64_t h = 0; h < p.kv_heads; ++h) blocks.push_back({s, t, count, h, visible_end});
    }
  }
  std::stable_sort(blocks.begin(), blocks.end(),
                   [](const QueryBlock& a, const QueryBlock& b) { return a.visible_end > b.visible_end; });
  return blocks;
}

ffi::Error PagedPrefillAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                                 ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> cu_q_lens,
                                 ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> pages,
                                 ffi::Buffer<ffi::S32> seq_range, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), vd = v_pages.dimensions(), pd = pages.dimensions();
  const auto cd = cu_q_lens.dimensions(), ld = kv_lens.dimensions(), rd = seq_range.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || !std::equal(kd.begin(), kd.end(), vd.begin()) ||
      kd[2] != qd[1] || kd[3] != qd[3] || pd.size() != 2 || ld.size() != 1 || ld[0] != pd[0] || cd.size() != 1 ||
      cd[0] != pd[0] + 1 || rd.size() != 1 || rd[0] != 2) {
    return ffi::Error::InvalidArgument(
        "paged_prefill_attention: want q [tokens, kv_heads, group, head_dim], pages [num_pages, page_size, "
        "kv_heads, head_dim] (K and V alike), cu_q_lens [seqs + 1], kv_lens [seqs], page table [seqs, "
        "pages_per_seq], seq_range [2] (the prefill sequences [first, last))");
  }
  const PrefillProblem problem{q.typed_data(), k_pages.typed_data(), v_pages.typed_data(),
                               cu_q_lens.typed_data(), kv_lens.typed_data(), pages.typed_data(),
                               out->typed_data(), qd[0], qd[1], qd[2], qd[3], kd[0], kd[1], pd[1]};
  std::fill(problem.out, problem.out + qd[0] * qd[1] * qd[2] * qd[3], 0.0f);  // decode and padding rows: 0
  const int32_t* range = seq_range.typed_data();
  const std::vector<QueryBlock> blocks =
      query_blocks(problem, std::clamp<int64_t>(range[0], 0, pd[0]), std::clamp<int64_t>(range[1], 0, pd[0]));
  run_tasks(pool, static_cast<int64_t>(blocks.size()), [&](int64_t i) { attend_prefill(problem, blocks[i]); });
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcppPagedPrefillAttention, PagedPrefillAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
