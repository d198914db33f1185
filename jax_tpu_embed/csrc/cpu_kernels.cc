// CPU kernels of jax_tpu_embed, called through XLA FFI (see ../_cpu_kernels.py).
//
// They run inside shard_map, on one device's shard, and mirror the portable backend
// (_xla_backend.py): `SumDuplicates` is `sum_duplicates` bit for bit, `SparseUpdate` is
// `sum_duplicates` followed by `apply_rows` for SGD, Adagrad and RowwiseAdagrad, in place on
// the donated table and slot (touching only the rows in the batch), and `PooledLookup` is the
// gather + weighted sum of the XLA lookup for non-sequence features.
//
// Keys are shard-local rows; keys >= 2**30 mark positions this shard does not own. Gradients
// of one row are summed in position order starting from +0.0f, as XLA's scatter-add does, so
// the sums are bit-identical. Built with -ffp-contract=off: no fused multiply-adds, so each
// operation rounds as XLA's does.

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
  int32_t lo = INT32_MAX;
  size_t count = 0;
  for (int64_t i = 0; i < m; ++i) {
    if ((keys[i] >= kNotMine) == high) {
      lo = std::min(lo, keys[i]);
      ++count;
    }
  }
  if (count == 0) return;
  std::vector<uint32_t> k;
  std::vector<int32_t> p;
  k.reserve(count);
  p.reserve(count);
  for (int64_t i = 0; i < m; ++i) {
    if ((keys[i] >= kNotMine) == high) {
      k.push_back(uint32_t(int64_t(keys[i]) - lo));
      p.push_back(int32_t(i));
    }
  }
  RadixSort(k, p);
  for (size_t i = 0; i < count; ++i) {
    out_key.push_back(int32_t(int64_t(k[i]) + lo));
    out_pos.push_back(p[i]);
  }
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
};

struct Params {
  int32_t kind, flags;
  float eps, clip_limit, clip_lo, clip_hi, decay, w_min, w_max;
};

void UpdateRows(const int32_t* keys, int64_t m, const float* scale, const float* g,
                int64_t per, int64_t d, const float* scalars, float* table, float* slot, int64_t s_rows,
                const Params& p) {
  Segments s = Segment(keys, m, /*mine_only=*/true);
  const float lr = scalars[0], mult = scalars[1];
  float decay = p.decay;
  if (p.flags & kDecayByLr) decay = decay * lr;
  std::vector<float> gs(d), upd(d);
  for (size_t j = 0; j < s.key.size(); ++j) {
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
    float* w = table + int64_t(r) * d;
    if (p.kind == kSGD) {
      for (int64_t c = 0; c < d; ++c) upd[c] = w[c] - lr * gs[c];
    } else if (p.kind == kAdagrad) {
      float* a = slot + int64_t(r) * d;
      for (int64_t c = 0; c < d; ++c) {
        float acc = a[c] + gs[c] * gs[c];
        a[c] = acc;
        // XLA's rsqrt(acc) as 1/sqrt(acc): may differ from it in the last bit.
        upd[c] = w[c] - lr * gs[c] * (1.0f / std::sqrt(acc));
      }
    } else {
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
    std::memcpy(w, upd.data(), sizeof(float) * size_t(d));
  }
}

#define JTE_PARAMS_ATTRS                                                                \
  .Attr<int32_t>("kind").Attr<int32_t>("flags").Attr<float>("eps").Attr<float>(       \
      "clip_limit").Attr<float>("clip_lo").Attr<float>("clip_hi").Attr<float>("decay") \
      .Attr<float>("w_min").Attr<float>("w_max")

ffi::Error UpdateNoSlotImpl(ffi::Buffer<ffi::S32> keys, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::F32> g,
                            ffi::Buffer<ffi::F32> scalars, ffi::Buffer<ffi::F32> table_in,
                            ffi::ResultBuffer<ffi::F32> table, int32_t kind, int32_t flags,
                            float eps, float clip_limit, float clip_lo, float clip_hi,
                            float decay, float w_min, float w_max) {
  if (table->typed_data() != table_in.typed_data())
    std::memcpy(table->typed_data(), table_in.typed_data(), table_in.size_bytes());
  int64_t m = keys.element_count();
  auto dims = table_in.dimensions();
  Params p{kind, flags, eps, clip_limit, clip_lo, clip_hi, decay, w_min, w_max};
  int64_t rows = int64_t(g.dimensions()[0]);
  int64_t per = rows > 0 ? m / rows : 1;  // Positions per gradient row.
  UpdateRows(keys.typed_data(), m, scale.typed_data(), g.typed_data(), per, dims[1],
             scalars.typed_data(),
             table->typed_data(), nullptr, dims[0], p);
  return ffi::Error::Success();
}

ffi::Error UpdateOneSlotImpl(ffi::Buffer<ffi::S32> keys, ffi::Buffer<ffi::F32> scale,
                             ffi::Buffer<ffi::F32> g,
                             ffi::Buffer<ffi::F32> scalars, ffi::Buffer<ffi::F32> table_in,
                             ffi::Buffer<ffi::F32> slot_in, ffi::ResultBuffer<ffi::F32> table,
                             ffi::ResultBuffer<ffi::F32> slot, int32_t kind, int32_t flags,
                             float eps, float clip_limit, float clip_lo, float clip_hi,
                             float decay, float w_min, float w_max) {
  // XLA passes the same buffer in and out when it honours the alias (donated state);
  // otherwise it hands a fresh output that must start as a copy of the input.
  if (table->typed_data() != table_in.typed_data())
    std::memcpy(table->typed_data(), table_in.typed_data(), table_in.size_bytes());
  if (slot->typed_data() != slot_in.typed_data())
    std::memcpy(slot->typed_data(), slot_in.typed_data(), slot_in.size_bytes());
  int64_t m = keys.element_count();
  auto dims = table_in.dimensions();
  Params p{kind, flags, eps, clip_limit, clip_lo, clip_hi, decay, w_min, w_max};
  int64_t rows = int64_t(g.dimensions()[0]);
  int64_t per = rows > 0 ? m / rows : 1;  // Positions per gradient row.
  UpdateRows(keys.typed_data(), m, scale.typed_data(), g.typed_data(), per, dims[1],
             scalars.typed_data(),
             table->typed_data(), slot->typed_data(), dims[0], p);
  return ffi::Error::Success();
}

ffi::Error PooledLookupImpl(ffi::Buffer<ffi::S32> keys, ffi::Buffer<ffi::F32> scale,
                            ffi::Buffer<ffi::F32> table, ffi::ResultBuffer<ffi::F32> out) {
  auto kd = keys.dimensions();
  int64_t b = kd[0], l = kd.size() > 1 ? kd[1] : 1;
  auto td = table.dimensions();
  int64_t s_rows = td[0], d = td[1];
  const int32_t* k = keys.typed_data();
  const float* w = scale.typed_data();
  const float* t = table.typed_data();
  float* o = out->typed_data();
  for (int64_t i = 0; i < b; ++i) {
    float* oi = o + i * d;
    for (int64_t c = 0; c < d; ++c) oi[c] = 0.0f;
    for (int64_t j = 0; j < l; ++j) {
      int32_t r = k[i * l + j];
      if (r < 0 || r >= s_rows) continue;  // Not this shard's: its scale is 0.
      float sc = w[i * l + j];
      const float* row = t + int64_t(r) * d;
      for (int64_t c = 0; c < d; ++c) oi[c] += sc * row[c];
    }
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
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JTE_PARAMS_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JteUpdateOneSlot, UpdateOneSlotImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>() JTE_PARAMS_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JtePooledLookup, PooledLookupImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
