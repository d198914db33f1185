// The dynamic table's index (../_hashindex.py) on one shard, in C++ through XLA FFI (see
// ../_hashindex_cpu.py).
//
// `Find` and `Update` give the same outputs as `_hashindex.find` and `_hashindex.update`, bit
// for bit. `OwnedDistinct`, then `FindDistinct` or `ResolveUpdate`, are what a shard does
// with a table's gathered ids (`_dynamic.lookup_rows`, `update_rows`): locate them and keep
// the distinct ones it owns, then run `Find` or `Update` on those. The XLA update decides
// every bucket at once with sorts; here one sweep over the ids, grouped by bucket, decides
// the same, bucket after bucket (A, B and C of one bucket, then the next), then D:
//
//   A. Each id's hit lane, its own expired ("stale") lane, miss, admission (probability
//      hash, filter sightings), from the old index.
//   B. Writes of hits (last = max(last, now), count + 1) and clears of the stale slots of
//      admitted ids, done as A reaches each id: the slot is the id's own, which no other id
//      reads.
//   C. Per bucket, its admitted ids in (priority, hi, lo) order and its slot order (free by
//      lane; expired by (last, priority); unless "none", live slots with last < now, lru by
//      last, lfu by (count, last), ties by priority; the rest unavailable) computed on the
//      index after B, and the k-th admitted id takes the k-th slot.
//   D. The filter: sightings written (a placed id's entry freed), then first sightings in
//      (filter bucket, priority) order take free entries, else the unsighted one of lowest
//      (count, priority). Every entry sighted or taken gets filter_last = now, as the XLA
//      update's calls mark it.
//
// Computing the slot order after B is the XLA order: a slot hit this step has last >= now, so
// it is neither expired nor evictable (XLA marks it unavailable), and a cleared slot is empty
// (XLA marks it free); nothing else that B writes is read by C. A, B and C of an id or bucket
// read and write only that bucket's slots (and A the filter, which only D writes), so the
// buckets can go one after another. The index arrays are the donated operands (aliased to
// the results), so a step reads and writes O(ids) memory.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr uint32_t kPad = 0xFFFFFFFFu;
constexpr int kStats = 9;  // _hashindex.STAT_NAMES, in order:
enum Stat {
  kHits,
  kMisses,
  kAdmitted,
  kRejected,
  kFailed,
  kEvicted,
  kExpired,
  kFilterEvicted,
  kFilterFailed
};
enum Eviction { kLru = 0, kLfu = 1, kNone = 2 };

// `_storage.mix32` (lowbias32) in uint32 arithmetic.
inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// `_hashindex._hash`: a keyed hash of the whole id.
inline uint32_t Hash(uint32_t key, uint32_t hi, uint32_t lo) { return Mix32(Mix32(lo ^ key) ^ hi); }

inline bool IsPad(uint32_t hi, uint32_t lo) { return (hi & lo) == kPad; }

inline uint64_t Join(uint32_t hi, uint32_t lo) { return (uint64_t(hi) << 32) | lo; }

// Block-interleaved keys (IndexState.keys, filter_keys): the bucket whose first slot is
// `base` (g*b: its slots are g*b + j in `last` and `count`) has its b hi words at
// keys[2*base, 2*base + b), then its b lo words.
template <typename T>
inline T* HiWords(T* keys, int64_t base) {
  return keys + 2 * base;
}
template <typename T>
inline T* LoWords(T* keys, int64_t base, int64_t b) {
  return keys + 2 * base + b;
}

// int32 in an order-preserving uint32.
inline uint32_t Ordered(int32_t x) { return uint32_t(x) ^ 0x80000000u; }

// `_hashindex._expired`: now - last >= ttl_steps in int32 arithmetic (ttl < 0: no TTL).
struct Ttl {
  int64_t steps;
  // `last` is read only with a TTL: callers pass it straight from the index (`kt[...]`),
  // and without a TTL that read was a cache miss per found id (nothing prefetches it then).
  bool Expired(const int32_t& last, int32_t now) const {
    return steps >= 0 && int64_t(int32_t(uint32_t(now) - uint32_t(last))) >= steps;
  }
};

// `jnp.clip(x, 0, n - 1)`: the local bucket of an id, as the XLA index clips it.
inline int64_t Clamp(int32_t x, int64_t n) {
  return std::min<int64_t>(std::max<int64_t>(x, 0), n - 1);
}

// Bit k set where p[k] == v, for the lanes [0, n), n <= 8: the first pass of a bucket scan
// (its `lo` words), eight lanes at a time.
inline uint32_t Match8(const uint32_t* p, int64_t n, uint32_t v) {
#ifdef __AVX2__
  if (n == 8) {
    __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    __m256i eq = _mm256_cmpeq_epi32(x, _mm256_set1_epi32(int32_t(v)));
    return uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(eq)));
  }
#endif
  uint32_t m = 0;
  for (int64_t k = 0; k < n; ++k) m |= uint32_t(p[k] == v) << k;
  return m;
}

// The first lane in [from, b) of a bucket whose `lo` word is l; b if none.
inline int64_t FirstLoMatch(const uint32_t* keys_lo, int64_t b, int64_t from, uint32_t l) {
  for (int64_t j0 = from; j0 < b; j0 += 8) {
    const uint32_t m = Match8(keys_lo + j0, std::min<int64_t>(8, b - j0), l);
    if (m) return j0 + __builtin_ctz(m);
  }
  return b;
}

// Calls f(lane) for the lanes of a bucket of b slots whose `lo` word is l, in lane order,
// until f returns true. The lanes come from a bit mask of the lanes, a machine word's worth at
// a time, all compared: a scan that stops at the first match (FirstLoMatch) mispredicts where
// it stops, about once a call.
template <typename F>
inline void ForEachLoMatch(const uint32_t* keys_lo, int64_t b, uint32_t l, F f) {
  for (int64_t j0 = 0; j0 < b; j0 += 64) {
    const int64_t n = std::min<int64_t>(64, b - j0);
    uint64_t m = 0;
    for (int64_t j = 0; j < n; j += 8) {
      m |= uint64_t(Match8(keys_lo + j0 + j, std::min<int64_t>(8, n - j), l)) << j;
    }
    for (; m; m &= m - 1) {
      if (f(j0 + __builtin_ctzll(m))) return;
    }
  }
}

// Calls f(lane) for the lanes of a bucket of b slots holding key (h, l), in lane order from
// `from` (a lane at or before the first match, found by FirstLoMatch on the index as it
// was: both words are checked again), until f returns true.
template <typename F>
inline void ForEachMatch(const uint32_t* keys_hi, const uint32_t* keys_lo, int64_t b,
                         int64_t from, uint32_t h, uint32_t l, F f) {
  for (int64_t j = from; j < b; j = FirstLoMatch(keys_lo, b, j + 1, l)) {
    if (keys_lo[j] == l && keys_hi[j] == h && f(j)) return;
  }
}

// `Find` scans buckets in two passes over the ids so that the memory reads of many ids are in
// flight at once: the first finds each id's first lane whose lo word matches (its bucket's lo
// words prefetched kAhead ids ahead), the second checks hi (and last) from there (that
// lane's hi and last prefetched kAhead ids ahead). `Update` goes bucket by bucket, the
// buckets up to kAhead on prefetched.
constexpr int64_t kAhead = 8;

// The b 4-byte words of a bucket, into the cache.
inline void PrefetchBucket(const void* words, int64_t b) {
  const char* p = static_cast<const char*>(words);
  for (int64_t j = 0; j < b; j += 16) __builtin_prefetch(p + 4 * j);
}

// A sort key of a slot or filter entry: (a, b, c) lexicographic, no two lanes equal.
struct LaneKey {
  uint64_t a, b, c;
  int32_t lane;
  bool operator<(const LaneKey& o) const {
    if (a != o.a) return a < o.a;
    if (b != o.b) return b < o.b;
    return c < o.c;
  }
};

// Appends to `order` the lanes of the `take` smallest keys. The keys come with their priority
// (the low word of b) zero: it is computed, prio(lane), only for the keys at or below the
// take-th smallest on (a, b), the only ones that can be among the `take` smallest (slots
// updated in the same step tie on last, and need it).
template <typename P>
void AppendSmallest(LaneKey* first_key, LaneKey* last_key, size_t take, P prio,
                    std::vector<int32_t>& order) {
  if (take == 0) return;
  const LaneKey* const begin = first_key;
  const LaneKey* const end_key = last_key;
  auto coarse = [](const LaneKey& x, const LaneKey& y) {
    return x.a != y.a ? x.a < y.a : x.b < y.b;
  };
  // t: the take-th smallest coarse key. Few slots are taken per bucket and step: find the
  // smallest distinct coarse keys one scan each, while they cover fewer than `take` keys.
  LaneKey t{};
  if (take <= 4) {
    size_t covered = 0;
    bool first = true;
    while (covered < take) {
      const LaneKey* m = nullptr;
      for (const LaneKey* x = begin; x != end_key; ++x) {
        if ((first || coarse(t, *x)) && (m == nullptr || coarse(*x, *m))) m = x;
      }
      t = *m;
      first = false;
      for (const LaneKey* x = begin; x != end_key; ++x) {
        covered += !coarse(*x, t) && !coarse(t, *x);
      }
    }
  } else {
    std::nth_element(first_key, first_key + (take - 1), last_key, coarse);
    t = first_key[take - 1];
  }
  LaneKey* end =
      std::partition(first_key, last_key, [&](const LaneKey& x) { return !coarse(t, x); });
  for (LaneKey* it = first_key; it != end; ++it) it->b |= prio(it->lane);
  std::partial_sort(first_key, first_key + take, end);
  for (size_t k = 0; k < take; ++k) order.push_back(first_key[k].lane);
}

// More slots than this taken from one class of a bucket go through AppendSmallest.
constexpr size_t kFewTakes = 4;

// The key of a slot outside the class, in TakeSmallest's `key`: no slot of the class has it.
constexpr uint64_t kNotInClass = ~uint64_t(0);

// Appends to `order` the lanes of the `take` smallest slots of one class of a bucket
// (expired, or evictable) in (key, priority, id) order, and returns how many it appended
// (fewer where the class has fewer slots). key[j] is lane j's key in the class's order, or
// kNotInClass: by lane rather than a list of the class's slots, so that the pass that
// computes the keys has no branch nor running count, and the scans here vectorize. `key` is
// overwritten, and `scratch` (room for b). A bucket takes one or two slots of a class in
// most steps: a minimum scan finds each, and only the slots that tie on it (slots updated in
// the same step, under lru) have their priority hashed and are sorted. More takes go to
// AppendSmallest, which selects them in one pass rather than a scan each.
template <typename P, typename I>
size_t TakeSmallest(uint64_t* key, int64_t b, size_t take, P prio, I id, LaneKey* scratch,
                    std::vector<int32_t>& order) {
  if (take > kFewTakes) {
    size_t n = 0;
    for (int64_t j = 0; j < b; ++j) {
      if (key[j] != kNotInClass) scratch[n++] = {key[j], 0, id(int32_t(j)), int32_t(j)};
    }
    take = std::min(take, n);
    AppendSmallest(scratch, scratch + n, take, prio, order);
    return take;
  }
  size_t taken = 0;
  while (taken < take) {
    uint64_t m = kNotInClass;
    for (int64_t j = 0; j < b; ++j) m = std::min(m, key[j]);
    if (m == kNotInClass) break;  // The class has no slot left.
    // The slots of key m (usually one: counted first), taken out of `key` into scratch.
    size_t ties = 0;
    for (int64_t j = 0; j < b; ++j) ties += key[j] == m;
    size_t t = 0;
    for (int64_t j = 0; t < ties; ++j) {
      if (key[j] != m) continue;
      scratch[t++].lane = int32_t(j);
      key[j] = kNotInClass;
    }
    if (ties > 1) {
      for (size_t k = 0; k < ties; ++k) {
        scratch[k] = {prio(scratch[k].lane), id(scratch[k].lane), 0, scratch[k].lane};
      }
      std::sort(scratch, scratch + ties);
    }
    for (size_t k = 0; k < ties && taken < take; ++k, ++taken) order.push_back(scratch[k].lane);
  }
  return taken;
}

// A candidate of a bucket: ordered by (bucket, priority, hi, lo).
struct Candidate {
  uint64_t bucket_prio, id;
  int32_t index;
  bool operator<(const Candidate& o) const {
    if (bucket_prio != o.bucket_prio) return bucket_prio < o.bucket_prio;
    return id < o.id;
  }
};

template <typename T>
void CopyIfNotAliased(const T* in, T* out, int64_t n) {
  if (in != out && n > 0) std::memcpy(out, in, sizeof(T) * size_t(n));
}

// ------------------------------------------------------------------------------------ find

// `Find` on raw arrays: n queries (ids qh, ql; local buckets qb) against the flat index of
// nbl buckets of b slots.
void FindCore(int64_t n, const uint32_t* qh, const uint32_t* ql, const int32_t* qb, int32_t now,
              const uint32_t* keys, const int32_t* kt, int64_t nbl, int64_t b, const Ttl ttl,
              int32_t* out_row, bool* out_found) {
  // Pass 1: each query's first lane whose lo word matches, in out_row (-1: none).
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) PrefetchBucket(LoWords(keys, Clamp(qb[i + kAhead], nbl) * b, b), b);
    const int64_t base = Clamp(qb[i], nbl) * b;
    const int64_t j =
        IsPad(qh[i], ql[i]) ? b : FirstLoMatch(LoWords(keys, base, b), b, 0, ql[i]);
    out_row[i] = j < b ? int32_t(j) : -1;
  }
  // Pass 2: hi and TTL from there.
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n && out_row[i + kAhead] >= 0) {
      const int64_t ahead = Clamp(qb[i + kAhead], nbl) * b;
      __builtin_prefetch(HiWords(keys, ahead) + out_row[i + kAhead]);
      if (ttl.steps >= 0) __builtin_prefetch(kt + ahead + out_row[i + kAhead]);
    }
    const int64_t from = out_row[i];
    int32_t r = -1;
    if (from >= 0) {
      const int64_t base = Clamp(qb[i], nbl) * b;
      const uint32_t *bh = HiWords(keys, base), *bl = LoWords(keys, base, b);
      ForEachMatch(bh, bl, b, from, qh[i], ql[i], [&](int64_t j) {
        if (ttl.Expired(kt[base + j], now)) return false;
        r = int32_t(base + j);
        return true;
      });
    }
    out_row[i] = r;
    out_found[i] = r >= 0;
  }
}

ffi::Error FindImpl(ffi::Buffer<ffi::U32> hi, ffi::Buffer<ffi::U32> lo, ffi::Buffer<ffi::S32> lb,
                    ffi::Buffer<ffi::S32> now_buf, ffi::Buffer<ffi::U32> keys,
                    ffi::Buffer<ffi::S32> last, ffi::ResultBuffer<ffi::S32> row,
                    ffi::ResultBuffer<ffi::PRED> found, int64_t ttl_steps, int64_t bucket_size) {
  // The index arrays are flat (IndexState): bucket g's slots at [g*b, (g+1)*b).
  const int64_t b = bucket_size, nbl = last.element_count() / b;
  if (nbl == 0) return ffi::Error::InvalidArgument("jte hashindex find: empty index");
  FindCore(hi.element_count(), hi.typed_data(), lo.typed_data(), lb.typed_data(),
           now_buf.typed_data()[0], keys.typed_data(), last.typed_data(), nbl, b,
           Ttl{ttl_steps}, row->typed_data(), found->typed_data());
  return ffi::Error::Success();
}

// x / d and x % d for a fixed 32-bit d, by multiplication (Lemire, Kaser and Kurz, "Faster
// remainder by direct computation", 2019): exact for every 32-bit x and d >= 2. A hardware
// division per id and word was most of `find_owned`'s time.
struct Divisor {
  uint32_t d;
  uint64_t m;  // ceil(2^64 / d); unused when d == 1.
  explicit Divisor(uint32_t d_) : d(d_), m(d_ > 1 ? ~uint64_t(0) / d_ + 1 : 0) {}
  uint32_t Div(uint32_t x) const {
    return d == 1 ? x : uint32_t((static_cast<unsigned __int128>(m) * x) >> 64);
  }
  uint32_t Mod(uint32_t x) const {
    return d == 1 ? 0 : uint32_t((static_cast<unsigned __int128>(m * x) * d) >> 64);
  }
};

// Where ids live: `_hashindex.locate`'s global bucket, owner shard and local bucket.
struct Locator {
  uint32_t key;  // `_hashindex._key(seed, _SALT_BUCKET)`.
  Divisor buckets, per;  // Global buckets, and buckets per shard.
  Locator(int64_t key_, int64_t buckets_, int64_t num_shards)
      : key(uint32_t(key_)),
        buckets(uint32_t(buckets_)),
        per(uint32_t(buckets_ / num_shards)) {}
};

// The distinct ids that shard `me` owns among n gathered ones (padding skipped), in order
// of first appearance, with their local buckets (u_hi, u_lo, u_lb: the first `count`
// entries of n), and each position's index among them (where: -1, not owned).
struct Owned {
  int32_t* where;
  uint32_t *u_hi, *u_lo;
  int32_t* u_lb;
};

// Three passes rather than one, each simpler for the CPU: the keyed hashes of all ids (a
// loop the compiler vectorizes), then each id's owner and local bucket with the owned
// positions compacted without a branch (whether an id is owned is a coin toss for the
// branch predictor), then one probe per owned position of a table sized to them. In one
// loop the hash did not vectorize and the owner test mispredicted half the time
// (docs/design.md). Scratch kept in a thread_local to save the allocations cost more than
// them: GCC looked the thread's address up through `__tls_get_addr` at each use.
int64_t OwnedDistinct(const Locator& at, int32_t me, int64_t n, const uint32_t* __restrict hi,
                      const uint32_t* __restrict lo, const Owned& o) {
  std::fill(o.where, o.where + n, -1);
  if (n == 0) return 0;
  const size_t len = size_t(n);
  std::vector<uint32_t> hash(len);
  std::vector<int32_t> pos(len), pos_lb(len);
  uint32_t* __restrict x = hash.data();
  const uint32_t key = at.key;
  for (int64_t i = 0; i < n; ++i) x[i] = Hash(key, hi[i], lo[i]);
  const Divisor buckets = at.buckets, per = at.per;
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t g = buckets.Mod(x[i]);
    const uint32_t owner = per.Div(g);
    pos[size_t(c)] = int32_t(i);
    pos_lb[size_t(c)] = int32_t(g - owner * per.d);
    c += int64_t((owner == uint32_t(me)) & !IsPad(hi[i], lo[i]));
  }
  // Entries of 8 bytes (the keyed hash, and the index into o.hi, o.lo; all ones: empty),
  // so that the table clears by memset and takes half the cache; a probe compares the
  // hash, and the whole id only where the hashes are equal.
  struct Entry {
    uint32_t hash;
    int32_t k;
  };
  int bits = 4;
  while ((int64_t(1) << bits) < 2 * c) ++bits;  // At most half full: c ids at most.
  const size_t mask = (size_t(1) << bits) - 1;
  std::unique_ptr<Entry[]> table(new Entry[mask + 1]);  // Not value-initialized: memset.
  std::memset(table.get(), 0xFF, (mask + 1) * sizeof(Entry));
  int32_t u = 0;
  for (int64_t j = 0; j < c; ++j) {
    const int64_t i = pos[size_t(j)];
    const uint32_t h = hi[i], l = lo[i], xi = x[i];
    // The slot from the top bits of the keyed hash times an odd constant: its low bits
    // are the bucket's, which the owned ids share a range of.
    for (size_t s = size_t(uint32_t(xi * 0x9E3779B1u) >> (32 - bits));; s = (s + 1) & mask) {
      Entry& e = table[s];
      if (e.k < 0) {
        e = {xi, u};
        o.where[i] = u;
        o.u_hi[u] = h;
        o.u_lo[u] = l;
        o.u_lb[u] = pos_lb[size_t(j)];
        ++u;
        break;
      }
      if (e.hash == xi && o.u_hi[e.k] == h && o.u_lo[e.k] == l) {
        o.where[i] = e.k;
        break;
      }
    }
  }
  return u;
}

// `OwnedDistinct` as a call of its own: a pure function of the gathered ids, so that when a
// step's lookup and update resolve the same ids, XLA computes it once for both (CSE merges
// equal calls without side effects). The entries past `count` are left as they are.
ffi::Error OwnedDistinctImpl(ffi::Buffer<ffi::U32> hi, ffi::Buffer<ffi::U32> lo,
                             ffi::Buffer<ffi::S32> me_buf, ffi::ResultBuffer<ffi::S32> where,
                             ffi::ResultBuffer<ffi::U32> u_hi, ffi::ResultBuffer<ffi::U32> u_lo,
                             ffi::ResultBuffer<ffi::S32> u_lb, ffi::ResultBuffer<ffi::S32> count,
                             int64_t bucket_key, int64_t buckets, int64_t num_shards) {
  const Locator at(bucket_key, buckets, num_shards);
  const Owned o{where->typed_data(), u_hi->typed_data(), u_lo->typed_data(),
                u_lb->typed_data()};
  count->typed_data()[0] = int32_t(OwnedDistinct(at, me_buf.typed_data()[0],
                                                 hi.element_count(), hi.typed_data(),
                                                 lo.typed_data(), o));
  return ffi::Error::Success();
}

// `find` of the distinct owned ids `OwnedDistinctImpl` gives: each gathered position's local
// row, -1 where another shard owns it, it is padding, or it is not held. Each distinct id's
// bucket is read once. (What `_dynamic.lookup_rows` does with XLA ops around `Find`.)
ffi::Error FindDistinctImpl(ffi::Buffer<ffi::S32> where_buf, ffi::Buffer<ffi::U32> u_hi,
                            ffi::Buffer<ffi::U32> u_lo, ffi::Buffer<ffi::S32> u_lb,
                            ffi::Buffer<ffi::S32> count, ffi::Buffer<ffi::S32> now_buf,
                            ffi::Buffer<ffi::U32> keys, ffi::Buffer<ffi::S32> last,
                            ffi::ResultBuffer<ffi::S32> row, int64_t ttl_steps,
                            int64_t bucket_size) {
  const int64_t n = where_buf.element_count();
  const int64_t b = bucket_size, nbl = last.element_count() / b;
  if (nbl == 0) return ffi::Error::InvalidArgument("jte hashindex find_owned: empty index");
  const int64_t u = count.typed_data()[0];
  // u_row[0] = -1 and each distinct id's row after it, so that positions map to rows by
  // where + 1 without a branch (whether a position is owned is a coin toss).
  std::vector<int32_t> u_row(size_t(u + 1), -1);
  std::unique_ptr<bool[]> found(new bool[size_t(std::max<int64_t>(u, 1))]);
  FindCore(u, u_hi.typed_data(), u_lo.typed_data(), u_lb.typed_data(), now_buf.typed_data()[0],
           keys.typed_data(), last.typed_data(), nbl, b, Ttl{ttl_steps}, u_row.data() + 1,
           found.get());
  int32_t* out = row->typed_data();
  const int32_t* where = where_buf.typed_data();
  for (int64_t i = 0; i < n; ++i) out[i] = u_row[size_t(where[i] + 1)];
  return ffi::Error::Success();
}

// The positions of the first `k` set entries of `mask`, in order, `n` (the mask's size) past
// them: `_dynamic._first` on CPU, which XLA:CPU would run as a running sum over the whole
// mask to find a few positions.
ffi::Error FirstSetImpl(ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::S32> at) {
  const int64_t n = mask.element_count(), k = at->element_count();
  const bool* m = mask.typed_data();
  int32_t* out = at->typed_data();
  int64_t j = 0;
  for (int64_t i = 0; i < n && j < k; ++i) {
    if (m[i]) out[j++] = int32_t(i);
  }
  for (; j < k; ++j) out[j] = int32_t(n);
  return ffi::Error::Success();
}

// Sorts (key, index) pairs by key: LSD radix sort, 11 bits a pass, the passes whose digit is
// the same for every key skipped; std::sort for few pairs. Stable (not needed here).
void SortPairs(std::vector<std::pair<uint64_t, int32_t>>& pairs) {
  const size_t n = pairs.size();
  if (n < 2048) {
    std::sort(pairs.begin(), pairs.end());
    return;
  }
  constexpr int kBits = 11, kPasses = 6;  // 66 >= 64 bits
  constexpr size_t kDigits = size_t(1) << kBits;
  std::vector<uint32_t> count(kPasses * kDigits, 0);
  auto digit = [](uint64_t key, int k) { return size_t(key >> (k * kBits)) & (kDigits - 1); };
  for (const auto& p : pairs) {
    for (int k = 0; k < kPasses; ++k) ++count[k * kDigits + digit(p.first, k)];
  }
  std::vector<std::pair<uint64_t, int32_t>> other(n);
  for (int k = 0; k < kPasses; ++k) {
    uint32_t* c = count.data() + k * kDigits;
    if (c[digit(pairs[0].first, k)] == n) continue;  // One digit.
    uint32_t sum = 0;
    for (size_t d = 0; d < kDigits; ++d) {
      const uint32_t t = c[d];
      c[d] = sum;
      sum += t;
    }
    for (const auto& p : pairs) other[c[digit(p.first, k)]++] = p;
    pairs.swap(other);
  }
}

// Sorts words (bucket << 32 | index), which come in index order, by bucket, then index: LSD
// radix sort on the bucket's `bits` bits (the stable passes keep the index order within a
// bucket) in as few passes as digits no wider than SortPairs' need, the bits split evenly
// between them (narrower digits: fewer places a pass scatters to); std::sort for few words.
void SortByBucket(std::vector<uint64_t>& words, int bits) {
  const size_t n = words.size();
  if (bits == 0) return;  // One bucket: in index order already.
  if (n < 1024) {
    std::sort(words.begin(), words.end());
    return;
  }
  const int passes = (bits + 10) / 11, width = (bits + passes - 1) / passes;
  const size_t digits = size_t(1) << width;
  auto digit = [&](uint64_t w, int k) { return size_t(w >> (32 + k * width)) & (digits - 1); };
  std::vector<uint32_t> count(size_t(passes) * digits, 0);
  for (const uint64_t w : words) {
    for (int k = 0; k < passes; ++k) ++count[size_t(k) * digits + digit(w, k)];
  }
  std::vector<uint64_t> other(n);
  for (int k = 0; k < passes; ++k) {
    uint32_t* c = count.data() + size_t(k) * digits;
    uint32_t sum = 0;
    for (size_t d = 0; d < digits; ++d) {
      const uint32_t t = c[d];
      c[d] = sum;
      sum += t;
    }
    for (const uint64_t w : words) other[c[digit(w, k)]++] = w;
    words.swap(other);
  }
}

// Sorts candidates by (bucket, priority, id): SortPairs on (bucket, priority), then runs
// that tie on it (a 32-bit priority collision in one bucket) by id.
void SortCandidates(std::vector<Candidate>& cands) {
  std::vector<std::pair<uint64_t, int32_t>> pairs(cands.size());
  for (size_t k = 0; k < cands.size(); ++k) pairs[k] = {cands[k].bucket_prio, int32_t(k)};
  SortPairs(pairs);
  std::vector<Candidate> sorted(cands.size());
  for (size_t k = 0; k < cands.size(); ++k) sorted[k] = cands[size_t(pairs[k].second)];
  for (size_t k = 0; k + 1 < sorted.size();) {
    size_t end = k + 1;
    while (end < sorted.size() && sorted[end].bucket_prio == sorted[k].bucket_prio) ++end;
    if (end - k > 1) std::sort(sorted.begin() + k, sorted.begin() + end);
    k = end;
  }
  cands.swap(sorted);
}

// ---------------------------------------------------------------------------------- update

struct Config {
  int64_t ttl_steps;
  int32_t eviction, min_count;
  int64_t threshold;  // Admission threshold of the probability hash; < 0: admit all.
  uint32_t prio_key, admit_key;
};

// The index's arrays on one shard (flat: bucket g's slots at [g*b, (g+1)*b); the keys
// block-interleaved, see HiWords), written in place.
struct IndexArrays {
  uint32_t* k;
  int32_t *kt, *kc;
  uint32_t* fk;
  int32_t *fc, *fl;
  int64_t nbl, b, nfl, bf;
};

// `Update` on raw arrays: u distinct ids (hi, lo; local buckets lb; valid) against the index
// `x`, in place. Writes each id's local row (-1: none) and fresh flag, and adds the step's
// counts to `tally`.
//
// A, B and C go bucket by bucket (see the top of the file), over the ids sorted by bucket: a
// bucket's memory is then fetched once a step, in address order, and its admitted ids are
// sorted among themselves. Id by id, a bucket was fetched again for each of its ids and once
// more for C, and all the admitted ids sorted together.
void UpdateCore(const Config& c, const IndexArrays& x, int64_t u, const uint32_t* hi,
                const uint32_t* lo, const int32_t* lb, const bool* valid, int32_t now,
                int32_t* row, bool* fresh, int64_t* tally) {
  const Ttl ttl{c.ttl_steps};
  const bool filter = c.min_count > 1;
  uint32_t *keys = x.k, *fkeys = x.fk;
  int32_t *kt = x.kt, *kc = x.kc, *fc = x.fc, *fl = x.fl;
  const int64_t b = x.b, nbl = x.nbl, bf = x.bf, nfl = x.nfl;
  // What D reads of each id: whether it missed, its priority, its filter lane and sightings.
  std::vector<uint8_t> miss;
  std::vector<int32_t> f_lane, sightings;
  std::vector<uint32_t> prio;
  if (filter) {
    miss.assign(size_t(u), 0);
    prio.assign(size_t(u), 0);
    f_lane.assign(size_t(u), -1);
    sightings.assign(size_t(u), 0);
  }
  const uint32_t admit_now = Mix32(uint32_t(now));
  // The ids to look up (valid, not padding) by bucket: words (bucket << 32 | index), listed
  // without a branch (each written, kept where the count moves past it).
  std::vector<uint64_t> by_bucket(static_cast<size_t>(u));
  size_t m = 0;
  for (int64_t i = 0; i < u; ++i) {
    row[i] = -1;
    fresh[i] = false;
    by_bucket[m] = (uint64_t(Clamp(lb[i], nbl)) << 32) | uint64_t(i);
    m += valid[i] && !IsPad(hi[i], lo[i]);
  }
  by_bucket.resize(m);
  int bits = 0;
  while ((int64_t(1) << bits) < nbl) ++bits;
  SortByBucket(by_bucket, bits);
  // Their ids in that order, gathered in a pass of its own: read in the sweep below, hi and
  // lo were cache misses, evicted by the index it streams through the cache.
  std::vector<uint64_t> ids(m);
  for (size_t k = 0; k < m; ++k) {
    const uint32_t i = uint32_t(by_bucket[k]);
    ids[k] = Join(hi[i], lo[i]);
  }

  // A bucket's admitted ids, by (priority, hi, lo): all of one bucket, bucket_prio holds the
  // priority alone.
  std::vector<Candidate> admitted;
  std::vector<int32_t> order;
  std::vector<LaneKey> keyed(static_cast<size_t>(std::max(b, bf)));  // The keyed lanes.
  const size_t nb = static_cast<size_t>(b);
  std::vector<uint8_t> cls(nb);
  // A bucket's slots' keys (TakeSmallest) in the expired class, (last), and in the evictable
  // one, (last) under lru and (count, last) under lfu: the slot order within each class,
  // before priority and id.
  std::vector<uint64_t> expired_keys(nb), evictable_keys(nb);
  // The buckets up to kAhead on are prefetched whole (keys, last, count; the filter bucket):
  // `ahead` is the next id not yet looked at for that, `fetched` how many buckets were, and
  // `done` how many the sweep has finished.
  size_t ahead = 0, fetched = 0, done = 0;
  for (size_t start = 0; start < m; ++done) {
    for (; ahead < m && fetched <= done + kAhead; ++ahead) {
      const uint64_t g = by_bucket[ahead] >> 32;
      if (ahead > 0 && (by_bucket[ahead - 1] >> 32) == g) continue;
      ++fetched;
      const int64_t s = int64_t(g) * b;
      PrefetchBucket(HiWords(keys, s), 2 * b);
      PrefetchBucket(kt + s, b);
      PrefetchBucket(kc + s, b);
      if (filter) PrefetchBucket(HiWords(fkeys, int64_t(g) / (nbl / nfl) * bf), 2 * bf);
    }
    const uint64_t bucket = by_bucket[start] >> 32;
    size_t end = start + 1;
    while (end < m && (by_bucket[end] >> 32) == bucket) ++end;
    const int64_t g = int64_t(bucket), s0 = g * b;
    uint32_t *bh = HiWords(keys, s0), *bl = LoWords(keys, s0, b);
    int32_t *bt = kt + s0, *bc = kc + s0;

    // A and B, id by id.
    admitted.clear();
    for (size_t k = start; k < end; ++k) {
      const int32_t i = int32_t(uint32_t(by_bucket[k]));
      const uint32_t h = uint32_t(ids[k] >> 32), l = uint32_t(ids[k]);
      // The id's first lane that is not expired (a hit; the scan stops there), else its first
      // expired one (stale), which only a miss needs.
      int32_t hit_lane = -1, stale_lane = -1;
      ForEachLoMatch(bl, b, l, [&](int64_t j) {
        if (bh[j] != h) return false;
        if (!ttl.Expired(bt[j], now)) {
          hit_lane = int32_t(j);
          return true;
        }
        if (stale_lane < 0) stale_lane = int32_t(j);
        return false;
      });
      if (hit_lane >= 0) {
        // B (for hits). No other id reads this slot.
        ++tally[kHits];
        row[i] = int32_t(s0 + hit_lane);
        bt[hit_lane] = std::max(bt[hit_lane], now);
        bc[hit_lane] = int32_t(uint32_t(bc[hit_lane]) + 1u);
        continue;
      }
      ++tally[kMisses];
      const uint32_t p = Hash(c.prio_key, h, l);  // Only misses are placed (C) or enter D.
      bool ok = true;
      if (c.threshold >= 0) ok = int64_t(Mix32(Hash(c.admit_key, h, l) ^ admit_now)) < c.threshold;
      if (filter) {
        miss[size_t(i)] = 1;
        prio[size_t(i)] = p;
        const int64_t fb = g / (nbl / nfl);
        const uint32_t *gl = LoWords(fkeys, fb * bf, bf), *gh = HiWords(fkeys, fb * bf);
        const int32_t* gc = fc + fb * bf;
        uint32_t sum = 0;  // int32 sum, wrapping as XLA's does.
        for (int64_t j = 0; j < bf; ++j) {
          if (gl[j] == l && gh[j] == h) {
            if (f_lane[size_t(i)] < 0) f_lane[size_t(i)] = int32_t(j);
            sum += uint32_t(gc[j]);
          }
        }
        sightings[size_t(i)] = std::min(int32_t(sum + 1u), c.min_count);
        ok = ok && sightings[size_t(i)] >= c.min_count;
      }
      if (!ok) {
        ++tally[kRejected];
        continue;
      }
      // B (for admitted ids): the id's own expired slot is cleared. No other id reads it.
      if (stale_lane >= 0) {
        bh[stale_lane] = kPad;
        bl[stale_lane] = kPad;
        bt[stale_lane] = 0;
        bc[stale_lane] = 0;
        ++tally[kExpired];
      }
      admitted.push_back({p, Join(h, l), i});
    }
    start = end;
    if (admitted.empty()) continue;

    // C. The bucket's admitted ids take its slots in order.
    std::sort(admitted.begin(), admitted.end());
    const size_t want = admitted.size();
    order.clear();
    // Free slots first, in lane order (lo words of PAD found by a mask, hi checked): in a
    // table with room they suffice, and no other slot is looked at.
    ForEachLoMatch(bl, b, kPad, [&](int64_t j) {
      if (bh[j] == kPad) order.push_back(int32_t(j));
      return order.size() == want;
    });
    const bool classed = order.size() < want;
    if (classed) {  // Free slots do not suffice: expired, then evictable ones.
      // Each slot's class (0 free, 1 expired, 2 evictable, 3 unavailable) and its key in its
      // class, never kNotInClass: an expired slot's key is its last alone, and an evictable
      // slot's last is below now.
      const bool evicts = c.eviction != kNone, lfu = c.eviction == kLfu;
      for (int64_t j = 0; j < b; ++j) {
        const int32_t t = bt[j];
        const bool pad = IsPad(bh[j], bl[j]);
        const bool expired = !pad & ttl.Expired(t, now);
        const bool evictable = !pad & !expired & evicts & (t < now);
        cls[j] = pad ? 0 : expired ? 1 : evictable ? 2 : 3;
        expired_keys[j] = expired ? Ordered(t) : kNotInClass;
        const uint64_t k2 = lfu ? Join(Ordered(bc[j]), Ordered(t)) : Ordered(t);
        evictable_keys[j] = evictable ? k2 : kNotInClass;
      }
      auto prio_of = [&](int32_t j) { return Hash(c.prio_key, bh[j], bl[j]); };
      auto id_of = [&](int32_t j) { return Join(bh[j], bl[j]); };
      const size_t need = want - order.size();
      const size_t got =
          TakeSmallest(expired_keys.data(), b, need, prio_of, id_of, keyed.data(), order);
      TakeSmallest(evictable_keys.data(), b, need - got, prio_of, id_of, keyed.data(), order);
    }
    for (size_t k = 0; k < want; ++k) {
      const int32_t i = admitted[k].index;
      if (k >= order.size()) {
        ++tally[kFailed];
        continue;
      }
      const int32_t j = order[k];
      const uint8_t cj = classed ? cls[j] : 0;  // Unclassed: every slot taken is free.
      if (cj == 1) ++tally[kExpired];
      if (cj == 2) ++tally[kEvicted];
      ++tally[kAdmitted];
      bh[j] = uint32_t(admitted[k].id >> 32);
      bl[j] = uint32_t(admitted[k].id);
      bt[j] = now;
      bc[j] = 1;
      row[i] = int32_t(s0 + j);
      fresh[i] = true;
    }
  }

  // D. The admission filter.
  if (filter) {
    const int64_t per = nbl / nfl;
    std::vector<int64_t> sighted;  // Filter slots sighted this step that keep their id.
    std::vector<Candidate> firsts;
    for (int64_t i = 0; i < u; ++i) {
      if (!miss[i]) continue;
      const int64_t fb = Clamp(lb[i], nbl) / per;
      if (f_lane[i] >= 0) {
        const int64_t s = fb * bf + f_lane[i];
        fl[s] = now;  // As `_hashindex.admission` marks it (read where the rules run apart).
        uint32_t* eh = HiWords(fkeys, fb * bf) + f_lane[i];
        uint32_t* el = LoWords(fkeys, fb * bf, bf) + f_lane[i];
        if (fresh[i]) {
          *eh = kPad;
          *el = kPad;
          fc[s] = 0;
        } else {
          *eh = hi[i];
          *el = lo[i];
          fc[s] = sightings[i];
          sighted.push_back(s);
        }
      } else {
        firsts.push_back({(uint64_t(fb) << 32) | prio[i], Join(hi[i], lo[i]), int32_t(i)});
      }
    }
    std::sort(sighted.begin(), sighted.end());
    SortCandidates(firsts);
    std::vector<uint8_t> fcls(static_cast<size_t>(bf));
    for (size_t start = 0; start < firsts.size();) {
      const uint64_t fb = firsts[start].bucket_prio >> 32;
      size_t end = start + 1;
      while (end < firsts.size() && (firsts[end].bucket_prio >> 32) == fb) ++end;
      const size_t want = end - start;
      const int64_t s0 = int64_t(fb) * bf;
      uint32_t *gh = HiWords(fkeys, s0), *gl = LoWords(fkeys, s0, bf);
      auto mark = std::lower_bound(sighted.begin(), sighted.end(), s0);
      order.clear();
      size_t n = 0;
      for (int64_t j = 0; j < bf; ++j) {
        const int64_t s = s0 + j;
        while (mark != sighted.end() && *mark < s) ++mark;
        if (IsPad(gh[j], gl[j])) {
          fcls[j] = 0;
          order.push_back(int32_t(j));
        } else if (mark != sighted.end() && *mark == s) {
          fcls[j] = 3;
        } else {
          fcls[j] = 1;
          keyed[n++] = {Ordered(fc[s]), 0, Join(gh[j], gl[j]), int32_t(j)};
        }
      }
      if (order.size() < want) {
        const size_t take = std::min(n, want - order.size());
        auto prio_of = [&](int32_t j) { return Hash(c.prio_key, gh[j], gl[j]); };
        AppendSmallest(keyed.data(), keyed.data() + n, take, prio_of, order);
      }
      for (size_t k = 0; k < want; ++k) {
        if (k >= order.size()) {
          ++tally[kFilterFailed];
          continue;
        }
        const int32_t j = order[k];
        const int64_t s = s0 + j;
        if (fcls[j] == 1) ++tally[kFilterEvicted];
        gh[j] = uint32_t(firsts[start + k].id >> 32);
        gl[j] = uint32_t(firsts[start + k].id);
        fc[s] = 1;
        fl[s] = now;
      }
      start = end;
    }
  }

}

// The index operands (donated) and results (aliased to them) of an update.
struct IndexIn {
  ffi::Buffer<ffi::U32> keys;
  ffi::Buffer<ffi::S32> last, count;
  ffi::Buffer<ffi::U32> fkeys;
  ffi::Buffer<ffi::S32> fcount, flast, stats;
};
struct IndexOut {
  ffi::ResultBuffer<ffi::U32> keys;
  ffi::ResultBuffer<ffi::S32> last, count;
  ffi::ResultBuffer<ffi::U32> fkeys;
  ffi::ResultBuffer<ffi::S32> fcount, flast, stats;
};

// Runs `run(index arrays, tally)` on the index in place (copied first where XLA did not alias
// it), then adds the tally to every shard row of stats (XLA broadcasts the counts the same
// way).
template <typename F>
ffi::Error OnIndex(const char* what, const Config& c, IndexIn& in, IndexOut& out,
                   int64_t bucket_size, int64_t filter_bucket_size, F run) {
  const int64_t b = bucket_size, nbl = in.last.element_count() / b;
  const int64_t bf = filter_bucket_size, nfl = in.fcount.element_count() / bf;
  const int64_t slots = nbl * b, fslots = nfl * bf;
  if (nbl == 0 || (c.min_count > 1 && nfl == 0)) {
    return ffi::Error::InvalidArgument(std::string("jte hashindex ") + what + ": empty index");
  }
  IndexArrays x{out.keys->typed_data(),   out.last->typed_data(),
                out.count->typed_data(),  out.fkeys->typed_data(),
                out.fcount->typed_data(), out.flast->typed_data(),
                nbl,                      b,
                nfl,                      bf};
  int32_t* st = out.stats->typed_data();
  CopyIfNotAliased(in.keys.typed_data(), x.k, 2 * slots);
  CopyIfNotAliased(in.last.typed_data(), x.kt, slots);
  CopyIfNotAliased(in.count.typed_data(), x.kc, slots);
  CopyIfNotAliased(in.fkeys.typed_data(), x.fk, 2 * fslots);
  CopyIfNotAliased(in.fcount.typed_data(), x.fc, fslots);
  CopyIfNotAliased(in.flast.typed_data(), x.fl, fslots);
  CopyIfNotAliased(in.stats.typed_data(), st, int64_t(in.stats.element_count()));
  int64_t tally[kStats] = {};
  run(x, tally);
  const int64_t stat_rows = int64_t(in.stats.element_count()) / kStats;
  for (int64_t r = 0; r < stat_rows; ++r) {
    for (int k = 0; k < kStats; ++k) {
      st[r * kStats + k] = int32_t(uint32_t(st[r * kStats + k]) + uint32_t(tally[k]));
    }
  }
  return ffi::Error::Success();
}

ffi::Error UpdateImpl(ffi::Buffer<ffi::U32> hi, ffi::Buffer<ffi::U32> lo,
                      ffi::Buffer<ffi::S32> lb, ffi::Buffer<ffi::PRED> valid,
                      ffi::Buffer<ffi::S32> now, ffi::Buffer<ffi::U32> in_keys,
                      ffi::Buffer<ffi::S32> in_last, ffi::Buffer<ffi::S32> in_count,
                      ffi::Buffer<ffi::U32> in_fkeys, ffi::Buffer<ffi::S32> in_fcount,
                      ffi::Buffer<ffi::S32> in_flast, ffi::Buffer<ffi::S32> in_stats,
                      ffi::ResultBuffer<ffi::U32> out_keys,
                      ffi::ResultBuffer<ffi::S32> out_last, ffi::ResultBuffer<ffi::S32> out_count,
                      ffi::ResultBuffer<ffi::U32> out_fkeys,
                      ffi::ResultBuffer<ffi::S32> out_fcount,
                      ffi::ResultBuffer<ffi::S32> out_flast,
                      ffi::ResultBuffer<ffi::S32> out_stats, ffi::ResultBuffer<ffi::S32> row,
                      ffi::ResultBuffer<ffi::PRED> fresh, int64_t ttl_steps,
                      int32_t eviction, int32_t min_count, int64_t threshold, int64_t prio_key,
                      int64_t admit_key, int64_t bucket_size, int64_t filter_bucket_size) {
  const Config c{ttl_steps, eviction, min_count, threshold, uint32_t(prio_key),
                 uint32_t(admit_key)};
  IndexIn in{in_keys, in_last, in_count, in_fkeys, in_fcount, in_flast, in_stats};
  IndexOut out{out_keys, out_last, out_count, out_fkeys, out_fcount, out_flast, out_stats};
  return OnIndex("update", c, in, out, bucket_size, filter_bucket_size,
                 [&](const IndexArrays& x, int64_t* tally) {
                   UpdateCore(c, x, hi.element_count(), hi.typed_data(), lo.typed_data(),
                              lb.typed_data(), valid.typed_data(), now.typed_data()[0],
                              row->typed_data(), fresh->typed_data(), tally);
                 });
}

// ------------------------------------------------------------------------- resolve_update

// The gathered ids' whole update on a shard (what `_dynamic.update_rows` does with `locate`,
// a sort for the distinct ids and `Update`): the distinct ids it owns (`OwnedDistinctImpl`'s;
// none when `keep` is false), in order of first appearance, updated by `UpdateCore`, whose
// results do not depend on the order of its ids. Returns each position's local row (-1: not
// owned, or no row), and the rows given to new ids with those ids, compacted: the first
// `fresh_count` entries of fresh_row, fresh_hi, fresh_lo (the rest -1 and padding).
ffi::Error ResolveUpdateImpl(
    ffi::Buffer<ffi::S32> where_buf, ffi::Buffer<ffi::U32> u_hi_buf,
    ffi::Buffer<ffi::U32> u_lo_buf, ffi::Buffer<ffi::S32> u_lb_buf, ffi::Buffer<ffi::S32> u_count,
    ffi::Buffer<ffi::PRED> keep_buf, ffi::Buffer<ffi::S32> now_buf, ffi::Buffer<ffi::U32> in_keys,
    ffi::Buffer<ffi::S32> in_last, ffi::Buffer<ffi::S32> in_count,
    ffi::Buffer<ffi::U32> in_fkeys, ffi::Buffer<ffi::S32> in_fcount,
    ffi::Buffer<ffi::S32> in_flast, ffi::Buffer<ffi::S32> in_stats,
    ffi::ResultBuffer<ffi::U32> out_keys, ffi::ResultBuffer<ffi::S32> out_last,
    ffi::ResultBuffer<ffi::S32> out_count, ffi::ResultBuffer<ffi::U32> out_fkeys,
    ffi::ResultBuffer<ffi::S32> out_fcount, ffi::ResultBuffer<ffi::S32> out_flast,
    ffi::ResultBuffer<ffi::S32> out_stats, ffi::ResultBuffer<ffi::S32> row_buf,
    ffi::ResultBuffer<ffi::S32> fresh_count, ffi::ResultBuffer<ffi::S32> fresh_row,
    ffi::ResultBuffer<ffi::U32> fresh_hi, ffi::ResultBuffer<ffi::U32> fresh_lo,
    int64_t ttl_steps, int32_t eviction, int32_t min_count, int64_t threshold, int64_t prio_key,
    int64_t admit_key, int64_t bucket_size, int64_t filter_bucket_size) {
  const Config c{ttl_steps, eviction, min_count, threshold, uint32_t(prio_key),
                 uint32_t(admit_key)};
  const int64_t n = where_buf.element_count();
  const bool keep = keep_buf.typed_data()[0];
  const int32_t* where = where_buf.typed_data();
  const uint32_t* u_hi = u_hi_buf.typed_data();
  const uint32_t* u_lo = u_lo_buf.typed_data();
  int32_t* row = row_buf->typed_data();

  // Without `keep`, no id: every position's row -1, and the index as it was.
  const int64_t owned = u_count.typed_data()[0], u = keep ? owned : 0;
  std::vector<int32_t> u_row_at(size_t(owned + 1), -1);  // As in FindDistinctImpl: -1 first.
  int32_t* u_row = u_row_at.data() + 1;
  std::unique_ptr<bool[]> u_valid(new bool[size_t(std::max<int64_t>(u, 1))]);
  std::unique_ptr<bool[]> u_fresh(new bool[size_t(std::max<int64_t>(u, 1))]);
  std::fill(u_valid.get(), u_valid.get() + u, true);

  IndexIn in{in_keys, in_last, in_count, in_fkeys, in_fcount, in_flast, in_stats};
  IndexOut out{out_keys, out_last, out_count, out_fkeys, out_fcount, out_flast, out_stats};
  ffi::Error err = OnIndex("resolve_update", c, in, out, bucket_size, filter_bucket_size,
                           [&](const IndexArrays& x, int64_t* tally) {
                             UpdateCore(c, x, u, u_hi, u_lo, u_lb_buf.typed_data(),
                                        u_valid.get(), now_buf.typed_data()[0], u_row,
                                        u_fresh.get(), tally);
                           });
  if (!err.success()) return err;
  for (int64_t i = 0; i < n; ++i) row[i] = u_row_at[size_t(where[i] + 1)];
  int32_t* f_row = fresh_row->typed_data();
  uint32_t* f_hi = fresh_hi->typed_data();
  uint32_t* f_lo = fresh_lo->typed_data();
  int64_t m = 0;
  for (int64_t k = 0; k < u; ++k) {
    if (!u_fresh[size_t(k)] || u_row[k] < 0) continue;
    f_row[m] = u_row[k];
    f_hi[m] = u_hi[k];
    f_lo[m] = u_lo[k];
    ++m;
  }
  fresh_count->typed_data()[0] = int32_t(m);
  for (int64_t k = m; k < n; ++k) {
    f_row[k] = -1;
    f_hi[k] = kPad;
    f_lo[k] = kPad;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JteHashindexFind, FindImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::S32>>()  // last
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int64_t>("ttl_steps")
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JteHashindexUpdate, UpdateImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()   // hi
                                  .Arg<ffi::Buffer<ffi::U32>>()   // lo
                                  .Arg<ffi::Buffer<ffi::S32>>()   // local bucket
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // valid
                                  .Arg<ffi::Buffer<ffi::S32>>()   // now, (1,)
                                  .Arg<ffi::Buffer<ffi::U32>>()   // the IndexState, donated
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()  // the new IndexState
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()   // local row
                                  .Ret<ffi::Buffer<ffi::PRED>>()  // fresh
                                  .Attr<int64_t>("ttl_steps")
                                  .Attr<int32_t>("eviction")
                                  .Attr<int32_t>("min_count")
                                  .Attr<int64_t>("threshold")
                                  .Attr<int64_t>("prio_key")
                                  .Attr<int64_t>("admit_key")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<int64_t>("filter_bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JteHashindexFirstSet, FirstSetImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask
                                  .Ret<ffi::Buffer<ffi::S32>>());  // positions, (k,)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JteHashindexOwnedDistinct, OwnedDistinctImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()  // hi, gathered
                                  .Arg<ffi::Buffer<ffi::U32>>()  // lo
                                  .Arg<ffi::Buffer<ffi::S32>>()  // me, (1,)
                                  .Ret<ffi::Buffer<ffi::S32>>()  // where
                                  .Ret<ffi::Buffer<ffi::U32>>()  // distinct hi
                                  .Ret<ffi::Buffer<ffi::U32>>()  // distinct lo
                                  .Ret<ffi::Buffer<ffi::S32>>()  // their local buckets
                                  .Ret<ffi::Buffer<ffi::S32>>()  // count, (1,)
                                  .Attr<int64_t>("bucket_key")
                                  .Attr<int64_t>("buckets")
                                  .Attr<int64_t>("num_shards"));

namespace {
// The operands that take `OwnedDistinctImpl`'s results: where, distinct hi and lo, their
// local buckets, count (1,).
template <typename B>
auto DistinctArgs(B binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::U32>>()
      .template Arg<ffi::Buffer<ffi::U32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JteHashindexFindDistinct, FindDistinctImpl,
                              DistinctArgs(ffi::Ffi::Bind())
                                  .Arg<ffi::Buffer<ffi::S32>>()  // now, (1,)
                                  .Arg<ffi::Buffer<ffi::U32>>()  // keys
                                  .Arg<ffi::Buffer<ffi::S32>>()  // last
                                  .Ret<ffi::Buffer<ffi::S32>>()  // local row
                                  .Attr<int64_t>("ttl_steps")
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JteHashindexResolveUpdate, ResolveUpdateImpl,
                              DistinctArgs(ffi::Ffi::Bind())
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // keep, (1,)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // now, (1,)
                                  .Arg<ffi::Buffer<ffi::U32>>()   // the IndexState, donated
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()  // the new IndexState
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()  // local row per position
                                  .Ret<ffi::Buffer<ffi::S32>>()  // fresh count, (1,)
                                  .Ret<ffi::Buffer<ffi::S32>>()  // fresh rows
                                  .Ret<ffi::Buffer<ffi::U32>>()  // their ids
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Attr<int64_t>("ttl_steps")
                                  .Attr<int32_t>("eviction")
                                  .Attr<int32_t>("min_count")
                                  .Attr<int64_t>("threshold")
                                  .Attr<int64_t>("prio_key")
                                  .Attr<int64_t>("admit_key")
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<int64_t>("filter_bucket_size"));
