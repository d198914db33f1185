// CPU kernels of jax_tpu_embed, called through XLA FFI (see ../_cpu_kernels.py).
//
// They run inside shard_map, on one device's shard, and mirror the portable backend
// (_xla_backend.py): `SumDuplicates` is `sum_duplicates` bit for bit, `SparseUpdate` is
// `sum_duplicates` followed by `apply_rows` for SGD, Adagrad and RowwiseAdagrad, in place on
// the donated table and slot (touching only the rows in the batch), and `PooledLookup` is the
// gather + weighted sum of the XLA lookup for non-sequence features.
//
// Tables are float32 or bfloat16 (raw uint16 bits); slots are float32. A bfloat16 row is
// widened to float32 exactly, and its update is rounded back as `_xla_backend.apply_rows`
// rounds it: stochastically with the bits of `_storage.random_bits` (mix32 ported below),
// or to nearest even as XLA's convert does.
//
// Keys are shard-local rows; keys >= 2**30 mark positions this shard does not own. Gradients
// of one row are summed in position order starting from +0.0f, as XLA's scatter-add does, so
// the sums are bit-identical. Built with -ffp-contract=off: a multiply and an add are fused
// only where written (MulAdd), where XLA:CPU fuses them too on a host with FMA.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int32_t kNotMine = 1 << 30;

// Stable LSD radix sort of (key, position) pairs by key; keys are offsets >= 0 from the
// group's minimum. Positions come in ascending order, so equal keys keep position order.
void RadixSort(std::vector<uint32_t>& keys, std::vector<int32_t>& pos) {
  size_t n = keys.size();
  if (n < 2) return;
  uint32_t max_key = 0;
  for (uint32_t k : keys) max_key = std::max(max_key, k);
  int bits = 0;
  while (bits < 32 && (max_key >> bits) != 0) ++bits;
  if (bits == 0) return;  // All keys equal.
  int passes = (bits + 10) / 11;
  int digit = (bits + passes - 1) / passes;
  uint32_t mask = (1u << digit) - 1;
  std::vector<uint32_t> k2(n);
  std::vector<int32_t> p2(n);
  std::vector<uint32_t> count(size_t(1) << digit);
  for (int shift = 0; shift < bits; shift += digit) {
    std::fill(count.begin(), count.end(), 0);
    for (size_t i = 0; i < n; ++i) ++count[(keys[i] >> shift) & mask];
    uint32_t sum = 0;
    for (auto& c : count) {
      uint32_t t = c;
      c = sum;
      sum += t;
    }
    for (size_t i = 0; i < n; ++i) {
      uint32_t d = (keys[i] >> shift) & mask;
      uint32_t at = count[d]++;
      k2[at] = keys[i];
      p2[at] = pos[i];
    }
    keys.swap(k2);
    pos.swap(p2);
  }
}

// Sorts the positions of one group (keys below or at/above kNotMine); appends to out_key and
// out_pos in ascending (key, position) order.
void SortGroup(const int32_t* keys, int64_t m, bool high, std::vector<int32_t>& out_key,
               std::vector<int32_t>& out_pos) {
  // Without branches on the keys: which group a key is in is a coin toss for the branch
  // predictor when half the gathered keys are another device's.
  int32_t lo = INT32_MAX;
  size_t count = 0;
  for (int64_t i = 0; i < m; ++i) {
    const bool take = (keys[i] >= kNotMine) == high;
    lo = take ? std::min(lo, keys[i]) : lo;
    count += take;
  }
  if (count == 0) return;
  // Every key is written, and the next write overwrites one not taken: one spare entry.
  std::vector<uint32_t> k(count + 1);
  std::vector<int32_t> p(count + 1);
  size_t c = 0;
  for (int64_t i = 0; i < m; ++i) {
    k[c] = uint32_t(int64_t(keys[i]) - lo);
    p[c] = int32_t(i);
    c += size_t((keys[i] >= kNotMine) == high);
  }
  k.resize(count);
  p.resize(count);
  RadixSort(k, p);
  const size_t at = out_key.size();
  out_key.resize(at + count);
  for (size_t i = 0; i < count; ++i) out_key[at + i] = int32_t(int64_t(k[i]) + lo);
  out_pos.insert(out_pos.end(), p.begin(), p.end());
}

// Distinct keys in ascending order and, for each, [begin, end) into pos.
struct Segments {
  std::vector<int32_t> key, pos, begin;  // begin has one extra entry: the end.
};

Segments Segment(const int32_t* keys, int64_t m, bool mine_only) {
  Segments s;
  s.key.reserve(m);
  s.pos.reserve(m);
  SortGroup(keys, m, false, s.key, s.pos);
  if (!mine_only) SortGroup(keys, m, true, s.key, s.pos);
  std::vector<int32_t> distinct;
  for (size_t i = 0; i < s.key.size(); ++i) {
    if (i == 0 || s.key[i] != s.key[i - 1]) {
      s.begin.push_back(int32_t(i));
      distinct.push_back(s.key[i]);
    }
  }
  s.begin.push_back(int32_t(s.key.size()));
  s.key.swap(distinct);
  return s;
}

// Sums the gradients of one segment in position order, from +0.0f.
inline void SumSegment(const Segments& s, size_t j, const float* g, int64_t d, float* out) {
  for (int64_t c = 0; c < d; ++c) out[c] = 0.0f;
  for (int32_t i = s.begin[j]; i < s.begin[j + 1]; ++i) {
    const float* row = g + int64_t(s.pos[i]) * d;
    for (int64_t c = 0; c < d; ++c) out[c] += row[c];
  }
}

// The same with position p's gradient given as scale[p] * grads[p / per] (a pooled feature's
// gradient expanded to its positions, as XLA computes it), without forming it.
inline void SumScaledSegment(const Segments& s, size_t j, const float* scale, const float* grads,
                             int64_t per, int64_t d, float* out) {
  for (int64_t c = 0; c < d; ++c) out[c] = 0.0f;
  for (int32_t i = s.begin[j]; i < s.begin[j + 1]; ++i) {
    int64_t p = s.pos[i];
    const float* row = grads + (p / per) * d;
    const float w = scale[p];
    for (int64_t c = 0; c < d; ++c) out[c] += w * row[c];
  }
}

ffi::Error SumDuplicatesImpl(ffi::Buffer<ffi::S32> keys, ffi::Buffer<ffi::F32> g,
                             ffi::ResultBuffer<ffi::S32> rows,
                             ffi::ResultBuffer<ffi::F32> g_sum) {
  int64_t m = keys.element_count();
  int64_t d = m ? int64_t(g.element_count()) / m : 0;
  Segments s = Segment(keys.typed_data(), m, /*mine_only=*/false);
  int32_t* r = rows->typed_data();
  float* out = g_sum->typed_data();
  int64_t n = int64_t(s.key.size());
  for (int64_t j = 0; j < n; ++j) {
    r[j] = s.key[j] < kNotMine ? s.key[j] : kNotMine + int32_t(j);
    SumSegment(s, size_t(j), g.typed_data(), d, out + j * d);
  }
  for (int64_t j = n; j < m; ++j) r[j] = kNotMine + int32_t(j);
  std::memset(out + n * d, 0, sizeof(float) * size_t((m - n) * d));
  return ffi::Error::Success();
}

// bfloat16 <-> float32 on raw bits. XLA's convert turns every NaN into the quiet NaN of its
// sign; `_storage.round_stochastically` keeps NaN as NaN, through the same convert.
inline float Widen(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

inline uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline uint16_t NanToBf16(uint32_t u) { return uint16_t(((u >> 16) & 0x8000u) | 0x7FC0u); }

inline uint16_t RoundNearestEven(float x) {
  uint32_t u = Bits(x);
  if (std::isnan(x)) return NanToBf16(u);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// `_storage.mix32` (lowbias32) in uint32 arithmetic.
inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// `_storage.round_stochastically(x, random_bits(key, [row], D))` for one row's lane `lane`,
// with `row_mix` = mix32(key ^ mix32(global row)).
inline uint16_t RoundStochastically(float x, uint32_t row_mix, uint32_t lane) {
  uint32_t u = Bits(x);
  if (std::isnan(x)) return NanToBf16(u);
  uint32_t bits = Mix32(row_mix ^ (lane + 0x9E3779B9u));
  return uint16_t((u + (bits & 0xFFFFu)) >> 16);
}

// x * y + z as XLA:CPU computes it where it fuses the two: rounded once on a machine with
// FMA (the kernels are built with -mfma there, as XLA targets the host), twice without.
inline float MulAdd(float x, float y, float z) {
#ifdef __FMA__
  return std::fma(x, y, z);
#else
  return x * y + z;
#endif
}

// Optimizer kinds and the flags of the gradient and row extras (see _cpu_kernels.py).
enum Kind { kSGD = 0, kAdagrad = 1, kRowwiseAdagrad = 2 };
enum Flags {
  kMultiplier = 1,
  kClipLimit = 2,
  kClipValue = 4,
  kDecay = 8,
  kDecayByLr = 16,
  kWeightMin = 32,
  kWeightMax = 64,
  kStochastic = 128,
};

struct Params {
  int32_t kind, flags;
  float eps, clip_limit, clip_lo, clip_hi, decay, w_min, w_max;
};

// How a bfloat16 table's new rows are rounded: rounding[0] is the step key's bits; local row
// r is global row rounding[1] + r * rounding[2] ("div": first row, 1; "mod": shard, N).
struct Rounding {
  uint32_t key;
  int32_t first, stride;
};

// Rows of a large table are read at random: each read would wait for memory. The loops below
// ask for the row they will read kRowsAhead rows later (every cache line of it) first.
constexpr int64_t kRowsAhead = 8;

// kWrite: whether the row will be written (a template argument: __builtin_prefetch takes
// only a constant).
template <bool kWrite, typename T>
inline void PrefetchRow(const T* row, int64_t d) {
  // Every 64-byte line the row touches, from the one holding its first byte.
  const uintptr_t first = reinterpret_cast<uintptr_t>(row);
  const uintptr_t end = first + uintptr_t(d) * sizeof(T);
  for (uintptr_t line = first & ~uintptr_t(63); line < end; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), kWrite);
}

inline void LoadRow(const float* w, int64_t d, float* out) {
  std::memcpy(out, w, sizeof(float) * size_t(d));
}
inline void LoadRow(const uint16_t* w, int64_t d, float* out) {
  for (int64_t c = 0; c < d; ++c) out[c] = Widen(w[c]);
}

inline void StoreRow(const float* v, int64_t d, int32_t, int32_t, const Rounding&, float* w) {
  std::memcpy(w, v, sizeof(float) * size_t(d));
}
inline void StoreRow(const float* v, int64_t d, int32_t r, int32_t flags, const Rounding& rd,
                     uint16_t* w) {
  if (flags & kStochastic) {
    // Global ids are below 2**31, so int32 arithmetic as in `_layout.global_ids`.
    uint32_t row = uint32_t(rd.first + r * rd.stride);
    uint32_t row_mix = Mix32(rd.key ^ Mix32(row));
    for (int64_t c = 0; c < d; ++c) w[c] = RoundStochastically(v[c], row_mix, uint32_t(c));
  } else {
    for (int64_t c = 0; c < d; ++c) w[c] = RoundNearestEven(v[c]);
  }
}

template <typename T>
void UpdateRows(const int32_t* keys, int64_t m, const float* scale, const float* g,
                int64_t per, int64_t d, const float* scalars, T* table, float* slot,
                int64_t s_rows, const Params& p, const Rounding& rd) {
  Segments s = Segment(keys, m, /*mine_only=*/true);
  const float lr = scalars[0], mult = scalars[1];
  float decay = p.decay;
  if (p.flags & kDecayByLr) decay = decay * lr;
  std::vector<float> gs(d), upd(d), row(d);
  for (size_t j = 0; j < s.key.size(); ++j) {
    if (j + kRowsAhead < s.key.size()) {
      const int32_t ahead = s.key[j + kRowsAhead];
      if (ahead >= 0 && ahead < s_rows) {
        PrefetchRow<true>(table + int64_t(ahead) * d, d);
        if (p.kind == kAdagrad) PrefetchRow<true>(slot + int64_t(ahead) * d, d);
      }
    }
    int32_t r = s.key[j];
    if (r < 0 || r >= s_rows) continue;  // Gathers fill, scatters drop: no effect.
    SumScaledSegment(s, j, scale, g, per, d, gs.data());
    if (p.flags & kMultiplier)
      for (int64_t c = 0; c < d; ++c) gs[c] = gs[c] * mult;
    if (p.flags & kClipLimit)
      for (int64_t c = 0; c < d; ++c)
        gs[c] = std::min(std::max(gs[c], -p.clip_limit), p.clip_limit);
    if (p.flags & kClipValue)
      for (int64_t c = 0; c < d; ++c) gs[c] = std::min(std::max(gs[c], p.clip_lo), p.clip_hi);
    T* stored = table + int64_t(r) * d;
    LoadRow(stored, d, row.data());
    const float* w = row.data();
    if (p.kind == kSGD) {
      for (int64_t c = 0; c < d; ++c) upd[c] = w[c] - lr * gs[c];
    } else if (p.kind == kAdagrad) {
      // Restrict pointers and eps in a local, the branch outside the loops: with `p.eps`
      // read through a reference that the slot's stores might alias, the loop reloaded it
      // per element and did not vectorize. Vector sqrt and division round as scalar ones.
      float* __restrict a = slot + int64_t(r) * d;
      float* __restrict u = upd.data();
      const float* __restrict gr = gs.data();
      const float* __restrict wr = w;
      const float eps = p.eps;
      if (eps > 0.0f) {  // FBGEMM's EXACT_ADAGRAD: lr * g / (sqrt(a) + eps).
        for (int64_t c = 0; c < d; ++c) {
          const float acc = MulAdd(gr[c], gr[c], a[c]);
          a[c] = acc;
          u[c] = wr[c] - lr * gr[c] / (std::sqrt(acc) + eps);
        }
      } else {
        // XLA's rsqrt(acc) as 1/sqrt(acc): may differ from it in the last bit.
        for (int64_t c = 0; c < d; ++c) {
          const float acc = MulAdd(gr[c], gr[c], a[c]);
          a[c] = acc;
          u[c] = wr[c] - lr * gr[c] * (1.0f / std::sqrt(acc));
        }
      }
    } else {
      // XLA:CPU vectorises mean(g²) and multiplies by 1 / D: the accumulator may differ
      // from it in the last bit.
      float sq = 0.0f;
      for (int64_t c = 0; c < d; ++c) sq += gs[c] * gs[c];
      float acc = slot[r] + sq / float(d);
      slot[r] = acc;
      float denom = std::sqrt(acc) + p.eps;
      for (int64_t c = 0; c < d; ++c) upd[c] = w[c] - lr * gs[c] / denom;
    }
    if (p.flags & kDecay)
      for (int64_t c = 0; c < d; ++c) upd[c] = upd[c] - decay * w[c];
    if (p.flags & kWeightMin)
      for (int64_t c = 0; c < d; ++c) upd[c] = std::max(upd[c], p.w_min);
    if (p.flags & kWeightMax)
      for (int64_t c = 0; c < d; ++c) upd[c] = std::min(upd[c], p.w_max);
    StoreRow(upd.data(), d, r, p.flags, rd, stored);
  }
}

// The table's dtype picks UpdateRows' row type; the other arguments as UpdateRows takes them.
ffi::Error UpdateTable(ffi::Buffer<ffi::S32> keys, ffi::Buffer<ffi::F32> scale,
                       ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> scalars,
                       ffi::Buffer<ffi::S32> rounding, ffi::AnyBuffer table_in, void* table,
                       float* slot, const Params& p) {
  int64_t m = keys.element_count();
  auto dims = table_in.dimensions();
  int64_t rows = int64_t(g.dimensions()[0]);
  int64_t per = rows > 0 ? m / rows : 1;  // Positions per gradient row.
  const int32_t* rw = rounding.typed_data();
  Rounding rd{uint32_t(rw[0]), rw[1], rw[2]};
  if (table_in.element_type() == ffi::DataType::F32) {
    UpdateRows(keys.typed_data(), m, scale.typed_data(), g.typed_data(), per, dims[1],
               scalars.typed_data(), static_cast<float*>(table), slot, dims[0], p, rd);
  } else if (table_in.element_type() == ffi::DataType::BF16) {
    UpdateRows(keys.typed_data(), m, scale.typed_data(), g.typed_data(), per, dims[1],
               scalars.typed_data(), static_cast<uint16_t*>(table), slot, dims[0], p, rd);
  } else {
    return ffi::Error::InvalidArgument("jte update: tables must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

#define JTE_PARAMS_ATTRS                                                                \
  .Attr<int32_t>("kind").Attr<int32_t>("flags").Attr<float>("eps").Attr<float>(       \
      "clip_limit").Attr<float>("clip_lo").Attr<float>("clip_hi").Attr<float>("decay") \
      .Attr<float>("w_min").Attr<float>("w_max")

// XLA passes the same buffer in and out when it honours the alias (donated state);
// otherwise it hands a fresh output that must start as a copy of the input.
void CopyUnlessAliased(const ffi::AnyBuffer& in, void* out) {
  if (out != in.untyped_data()) std::memcpy(out, in.untyped_data(), in.size_bytes());
}

ffi::Error UpdateNoSlotImpl(ffi::Buffer<ffi::S32> keys, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> scalars,
                            ffi::Buffer<ffi::S32> rounding, ffi::AnyBuffer table_in,
                            ffi::Result<ffi::AnyBuffer> table, int32_t kind, int32_t flags,
                            float eps, float clip_limit, float clip_lo, float clip_hi,
                            float decay, float w_min, float w_max) {
  CopyUnlessAliased(table_in, table->untyped_data());
  Params p{kind, flags, eps, clip_limit, clip_lo, clip_hi, decay, w_min, w_max};
  return UpdateTable(keys, scale, g, scalars, rounding, table_in, table->untyped_data(),
                     nullptr, p);
}

ffi::Error UpdateOneSlotImpl(ffi::Buffer<ffi::S32> keys, ffi::Buffer<ffi::F32> scale,
                             ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> scalars,
                             ffi::Buffer<ffi::S32> rounding, ffi::AnyBuffer table_in,
                             ffi::Buffer<ffi::F32> slot_in, ffi::Result<ffi::AnyBuffer> table,
                             ffi::ResultBuffer<ffi::F32> slot, int32_t kind, int32_t flags,
                             float eps, float clip_limit, float clip_lo, float clip_hi,
                             float decay, float w_min, float w_max) {
  CopyUnlessAliased(table_in, table->untyped_data());
  if (slot->typed_data() != slot_in.typed_data())
    std::memcpy(slot->typed_data(), slot_in.typed_data(), slot_in.size_bytes());
  Params p{kind, flags, eps, clip_limit, clip_lo, clip_hi, decay, w_min, w_max};
  return UpdateTable(keys, scale, g, scalars, rounding, table_in, table->untyped_data(),
                     slot->typed_data(), p);
}

// One example at a time: out[b] = Σ_l scale[b, l] · float32(table[keys[b, l]]), in position
// order from +0.0f, as the XLA lookup's scatter-add sums them.
template <typename T>
void PooledLookupRows(const int32_t* k, const float* w, const T* t, int64_t b, int64_t l,
                      int64_t s_rows, int64_t d, float* o) {
  std::vector<float> row(d);
  const int64_t n = b * l;
  for (int64_t i = 0; i < b; ++i) {
    float* oi = o + i * d;
    for (int64_t c = 0; c < d; ++c) oi[c] = 0.0f;
    for (int64_t j = 0; j < l; ++j) {
      if (i * l + j + kRowsAhead < n) {
        const int32_t ahead = k[i * l + j + kRowsAhead];
        if (ahead >= 0 && ahead < s_rows) PrefetchRow<false>(t + int64_t(ahead) * d, d);
      }
      int32_t r = k[i * l + j];
      if (r < 0 || r >= s_rows) continue;  // Not this shard's: its scale is 0.
      float sc = w[i * l + j];
      LoadRow(t + int64_t(r) * d, d, row.data());
      for (int64_t c = 0; c < d; ++c) oi[c] += sc * row[c];
    }
  }
}

ffi::Error PooledLookupImpl(ffi::Buffer<ffi::S32> keys, ffi::Buffer<ffi::F32> scale,
                            ffi::AnyBuffer table, ffi::ResultBuffer<ffi::F32> out) {
  auto kd = keys.dimensions();
  int64_t b = kd[0], l = kd.size() > 1 ? kd[1] : 1;
  auto td = table.dimensions();
  int64_t s_rows = td[0], d = td[1];
  if (table.element_type() == ffi::DataType::F32) {
    PooledLookupRows(keys.typed_data(), scale.typed_data(),
                     static_cast<const float*>(table.untyped_data()), b, l, s_rows, d,
                     out->typed_data());
  } else if (table.element_type() == ffi::DataType::BF16) {
    PooledLookupRows(keys.typed_data(), scale.typed_data(),
                     static_cast<const uint16_t*>(table.untyped_data()), b, l, s_rows, d,
                     out->typed_data());
  } else {
    return ffi::Error::InvalidArgument("jte pooled lookup: tables must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JteSumDuplicates, SumDuplicatesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JteUpdateNoSlot, UpdateNoSlotImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>() JTE_PARAMS_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JteUpdateOneSlot, UpdateOneSlotImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JTE_PARAMS_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtePooledLookup, PooledLookupImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
