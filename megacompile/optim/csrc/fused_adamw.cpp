// Host-side fused AdamW over flat FP32 masters.
//
// One pass over memory per parameter: read grad (2 or 4 B), master, exp_avg, exp_avg_sq (12 B);
// write master, exp_avg, exp_avg_sq (12 B) and optionally the new master in the compute dtype
// (2 or 4 B). With a bf16 grad and a bf16 copy-out that is 28 B per parameter.
//
// The arithmetic repeats torch.optim.AdamW (_single_tensor_adam, decoupled weight decay) operation
// by operation in float32, with a fused multiply-add exactly where ATen's CPU kernels have one
// (lerp, addcmul). Built with -ffp-contract=off so the compiler adds no others: the vector body
// and the scalar tail round identically, and both round like torch. (torch's float32 sqrt on CPU
// comes from MKL and is not always correctly rounded; ours is, so masters may differ by an ulp.)
//
// Built at first use by megacompile/optim/fused_adamw.py and called through ctypes.

#include <pthread.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

struct AdamScalars {
  float decay;          // 1 - lr * weight_decay
  float lerp_coeff;     // torch's lerp: weight if weight < 0.5 else weight - 1
  bool lerp_from_m;     // torch's lerp: base is exp_avg (weight < 0.5) or grad
  float beta2;
  float one_minus_beta2;
  float bc2_sqrt;       // sqrt(1 - beta2**step); divided by, as torch does, not multiplied by 1/x
  float eps;
  float neg_step_size;  // -lr / (1 - beta1**step)
  float grad_scale;
};

struct NoOut {};

// ---- scalar element: the reference for the vector bodies and the code for tails -------------

inline float to_float(float x) { return x; }

inline float to_float(uint16_t bf16) {
  uint32_t bits = uint32_t(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

inline void put(float* dst, float x) { *dst = x; }

// Round to nearest even, as torch's .to(torch.bfloat16); a NaN stays a quiet NaN with its sign.
inline void put(uint16_t* dst, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  uint32_t quiet_nan = (bits >> 16) | 0x40u;
  *dst = uint16_t((bits & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

template <typename Grad, typename Out>
inline void update_one(float* master, const Grad* grad, float* exp_avg, float* exp_avg_sq,
                       Out* out, int64_t i, const AdamScalars& s) {
  float g = to_float(grad[i]) * s.grad_scale;
  float p = master[i] * s.decay;
  float m = exp_avg[i];
  m = std::fmaf(s.lerp_coeff, g - m, s.lerp_from_m ? m : g);
  float v = std::fmaf(s.one_minus_beta2 * g, g, exp_avg_sq[i] * s.beta2);
  float denom = std::sqrt(v) / s.bc2_sqrt + s.eps;
  p = p + s.neg_step_size * m / denom;
  exp_avg[i] = m;
  exp_avg_sq[i] = v;
  master[i] = p;
  if constexpr (!std::is_same_v<Out, NoOut>) put(out + i, p);
}

// ---- vector element: the same operations, kLanes at a time ----------------------------------

#if defined(__AVX512F__)
#define MEGACOMPILE_VECTOR 1
constexpr int64_t kLanes = 16;
using VecF = __m512;

inline VecF vset(float x) { return _mm512_set1_ps(x); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vload(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, VecF x) { _mm512_storeu_ps(p, x); }
inline VecF vadd(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF vsub(VecF a, VecF b) { return _mm512_sub_ps(a, b); }
inline VecF vmul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF vdiv(VecF a, VecF b) { return _mm512_div_ps(a, b); }
inline VecF vsqrt(VecF a) { return _mm512_sqrt_ps(a); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }

// As put(uint16_t*, float), 16 at a time.
inline __m256i to_bf16(VecF x) {
  __m512i bits = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet_nan));
}

// Two vectors of results into a 64-byte-aligned `p`, one whole line per store.
inline void stream2(uint16_t* p, VecF a, VecF b) {
  __m512i line = _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(a)), to_bf16(b), 1);
  _mm512_stream_si512(reinterpret_cast<__m512i*>(p), line);
}
inline void stream2(float* p, VecF a, VecF b) {
  _mm512_stream_ps(p, a);
  _mm512_stream_ps(p + kLanes, b);
}

#elif defined(__AVX2__) && defined(__FMA__)
#define MEGACOMPILE_VECTOR 1
constexpr int64_t kLanes = 8;
using VecF = __m256;

inline VecF vset(float x) { return _mm256_set1_ps(x); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vload(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, VecF x) { _mm256_storeu_ps(p, x); }
inline VecF vadd(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline VecF vsub(VecF a, VecF b) { return _mm256_sub_ps(a, b); }
inline VecF vmul(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF vdiv(VecF a, VecF b) { return _mm256_div_ps(a, b); }
inline VecF vsqrt(VecF a) { return _mm256_sqrt_ps(a); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }

inline __m128i to_bf16(VecF x) {
  __m256i bits = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  __m256i half = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
  // packus interleaves the two 128-bit halves; the permute puts the 8 results in order.
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(half, half), 0xD8);
  return _mm256_castsi256_si128(packed);
}

inline void stream2(uint16_t* p, VecF a, VecF b) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm256_set_m128i(to_bf16(b), to_bf16(a)));
}
inline void stream2(float* p, VecF a, VecF b) {
  _mm256_stream_ps(p, a);
  _mm256_stream_ps(p + kLanes, b);
}
#endif

#ifdef MEGACOMPILE_VECTOR
struct VecScalars {
  VecF decay, lerp_coeff, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size, grad_scale;
  bool lerp_from_m;
  explicit VecScalars(const AdamScalars& s)
      : decay(vset(s.decay)), lerp_coeff(vset(s.lerp_coeff)), beta2(vset(s.beta2)),
        one_minus_beta2(vset(s.one_minus_beta2)), bc2_sqrt(vset(s.bc2_sqrt)), eps(vset(s.eps)),
        neg_step_size(vset(s.neg_step_size)), grad_scale(vset(s.grad_scale)),
        lerp_from_m(s.lerp_from_m) {}
};

// Returns the new master; the caller stores its compute-dtype copy.
template <typename Grad>
inline VecF update_vec(float* master, const Grad* grad, float* exp_avg, float* exp_avg_sq,
                       int64_t i, const VecScalars& s) {
  VecF g = vmul(vload(grad + i), s.grad_scale);
  VecF p = vmul(vload(master + i), s.decay);
  VecF m = vload(exp_avg + i);
  m = vfma(s.lerp_coeff, vsub(g, m), s.lerp_from_m ? m : g);
  VecF v = vfma(vmul(s.one_minus_beta2, g), g, vmul(vload(exp_avg_sq + i), s.beta2));
  VecF denom = vadd(vdiv(vsqrt(v), s.bc2_sqrt), s.eps);
  p = vadd(p, vdiv(vmul(s.neg_step_size, m), denom));
  vstore(exp_avg + i, m);
  vstore(exp_avg_sq + i, v);
  vstore(master + i, p);
  return p;
}

// The hardware prefetchers stop at every 4 KiB page; asking for each input stream 8 KiB ahead
// keeps the next page's lines in flight (a few percent here, more when bandwidth is plentiful).
constexpr int64_t kPrefetchAhead = 2048;

template <typename T>
inline void prefetch_lines(const T* p, int64_t count) {
  for (int64_t k = 0; k < count; k += 64 / sizeof(T))
    _mm_prefetch(reinterpret_cast<const char*>(p + k), _MM_HINT_T0);
}
#endif

// Elements [begin, end): scalar until `out` sits on a cache-line boundary, then two vectors at a
// time, so that each line of the staging buffer is written by one streaming store (or two
// adjacent ones): the staging buffer is written, never read, and streaming stores neither read
// its lines first (2 B per param saved) nor leave them in the cache. Then a scalar tail.
template <typename Grad, typename Out>
void update_range(float* __restrict master, const Grad* __restrict grad,
                  float* __restrict exp_avg, float* __restrict exp_avg_sq, Out* __restrict out,
                  int64_t begin, int64_t end, const AdamScalars& s) {
  int64_t i = begin;
#ifdef MEGACOMPILE_VECTOR
  if constexpr (!std::is_same_v<Out, NoOut>) {
    while (i < end && reinterpret_cast<uintptr_t>(out + i) % 64 != 0)
      update_one(master, grad, exp_avg, exp_avg_sq, out, i++, s);
  }
  const VecScalars vs(s);
  for (; i + 2 * kLanes <= end; i += 2 * kLanes) {
    if (i + kPrefetchAhead < end) {
      prefetch_lines(grad + i + kPrefetchAhead, 2 * kLanes);
      prefetch_lines(master + i + kPrefetchAhead, 2 * kLanes);
      prefetch_lines(exp_avg + i + kPrefetchAhead, 2 * kLanes);
      prefetch_lines(exp_avg_sq + i + kPrefetchAhead, 2 * kLanes);
    }
    VecF first = update_vec(master, grad, exp_avg, exp_avg_sq, i, vs);
    VecF second = update_vec(master, grad, exp_avg, exp_avg_sq, i + kLanes, vs);
    if constexpr (!std::is_same_v<Out, NoOut>) stream2(out + i, first, second);
  }
  _mm_sfence();  // streaming stores are weakly ordered: make them visible before returning
#endif
  for (; i < end; ++i) update_one(master, grad, exp_avg, exp_avg_sq, out, i, s);
}

// ---- threads ----------------------------------------------------------------------------------
//
// The calling thread works through the chunks itself; helper threads, woken when the call starts,
// take chunks from the same counter whenever they get a core. A helper that never gets a core in
// time holds no chunk and delays nothing, and one that lost its core mid-chunk delays the call by
// that chunk only. (A fork-join team instead waits at its closing barrier for every thread: on a
// busy 2-core host that is a whole scheduler tick, 4 ms, on most calls.)

constexpr int64_t kChunk = 1 << 16;  // elements: ~1.8 MB moved, tens of microseconds

class ChunkPool {
 public:
  template <typename Body>
  void run(int64_t chunks, int threads, const Body& body) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (threads <= 1 || chunks <= 1 || !busy.owns_lock()) {  // busy: another caller has the pool
      for (int64_t c = 0; c < chunks; ++c) body(c);
      return;
    }
    struct Erased {
      static void call(const void* body, int64_t c) { (*static_cast<const Body*>(body))(c); }
    };
    uint64_t epoch;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (int(helpers_.size()) < threads - 1)
        helpers_.emplace_back(&ChunkPool::help, this, int(helpers_.size()));
      epoch = ++epoch_;
      job_ = Job{&Erased::call, &body, chunks, threads - 1};
      done_.store(0, std::memory_order_relaxed);
      ticket_.store(epoch << kIndexBits, std::memory_order_release);
    }
    wake_.notify_all();
    int64_t c;
    while (claim(epoch, chunks, c)) {
      body(c);
      done_.fetch_add(1, std::memory_order_release);
    }
    while (done_.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
  }

  // After fork() the child has only the forking thread: it gets a fresh pool and leaks the old
  // one, whose mutexes may have been held by threads that no longer exist.
  static ChunkPool*& instance() {
    static ChunkPool* pool = [] {
      pthread_atfork(nullptr, nullptr, [] { instance() = new ChunkPool; });
      return new ChunkPool;
    }();
    return pool;
  }

 private:
  static constexpr int kIndexBits = 40;  // ticket = epoch << 40 | next chunk

  struct Job {
    void (*call)(const void*, int64_t);
    const void* body;
    int64_t chunks;
    int helpers;
  };

  // A chunk of this epoch's job, or false once they are all taken or the job is over.
  bool claim(uint64_t epoch, int64_t chunks, int64_t& chunk) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      if ((t >> kIndexBits) != (epoch & ((uint64_t(1) << (64 - kIndexBits)) - 1))) return false;
      chunk = int64_t(t & ((uint64_t(1) << kIndexBits) - 1));
      if (chunk >= chunks) return false;
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) return true;
    }
  }

  void help(int index) {
    uint64_t seen = 0;
    for (;;) {
      Job job;
      uint64_t epoch;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return epoch_ != seen && index < job_.helpers; });
        seen = epoch = epoch_;
        job = job_;
      }
      int64_t c;
      while (claim(epoch, job.chunks, c)) {  // a claim proves the job, and so `body`, is alive
        job.call(job.body, c);
        done_.fetch_add(1, std::memory_order_release);
      }
    }
  }

  std::mutex run_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> helpers_;
  uint64_t epoch_ = 0;
  Job job_{nullptr, nullptr, 0, 0};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
};

template <typename Body>
void for_each_chunk(int64_t n, int threads, const Body& body) {
  ChunkPool::instance()->run((n + kChunk - 1) / kChunk, threads, [&](int64_t c) {
    body(c * kChunk, c * kChunk + kChunk < n ? c * kChunk + kChunk : n);
  });
}

// ---- entry points ------------------------------------------------------------------------------

template <typename Grad, typename Out>
void update(float* master, const Grad* grad, float* exp_avg, float* exp_avg_sq, Out* out,
            int64_t n, const AdamScalars& s, int num_threads) {
  // Chunks are multiples of 64 elements: in line-aligned buffers no two threads share a line.
  for_each_chunk(n, num_threads, [&](int64_t begin, int64_t end) {
    update_range(master, grad, exp_avg, exp_avg_sq, out, begin, end, s);
  });
}

template <typename Grad>
void dispatch_out(float* master, const Grad* grad, float* exp_avg, float* exp_avg_sq, void* out,
                  int out_kind, int64_t n, const AdamScalars& s, int num_threads) {
  switch (out_kind) {
    case 1:
      update(master, grad, exp_avg, exp_avg_sq, static_cast<uint16_t*>(out), n, s, num_threads);
      break;
    case 2:
      update(master, grad, exp_avg, exp_avg_sq, static_cast<float*>(out), n, s, num_threads);
      break;
    default:
      update(master, grad, exp_avg, exp_avg_sq, static_cast<NoOut*>(nullptr), n, s, num_threads);
  }
}

// Per-chunk partial sums in float64, added in chunk order: the result does not depend on the
// thread count.
template <typename Grad>
double sq_norm(const Grad* __restrict grad, int64_t n, int num_threads) {
  std::vector<double> partial((n + kChunk - 1) / kChunk);
  for_each_chunk(n, num_threads, [&](int64_t begin, int64_t end) {
    double total = 0.0;
#pragma omp simd reduction(+ : total)
    for (int64_t i = begin; i < end; ++i) {
      double g = to_float(grad[i]);
      total += g * g;
    }
    partial[begin / kChunk] = total;
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace

extern "C" {

// grad_kind: 0 float32, 1 bfloat16. out_kind: 0 none, 1 bfloat16, 2 float32.
// The scalars arrive in double, computed by the caller with torch's Python expressions; they are
// rounded to float here, as ATen rounds a Python scalar applied to a float32 tensor.
void megacompile_adamw_update(float* master, const void* grad, int grad_kind, float* exp_avg,
                              float* exp_avg_sq, void* out, int out_kind, int64_t n,
                              double decay, double lerp_weight, double beta2,
                              double one_minus_beta2, double bias_correction2_sqrt, double eps,
                              double neg_step_size, double grad_scale, int num_threads) {
  AdamScalars s;
  float weight = float(lerp_weight);
  s.decay = float(decay);
  s.lerp_from_m = std::fabs(weight) < 0.5f;
  s.lerp_coeff = s.lerp_from_m ? weight : weight - 1.0f;
  s.beta2 = float(beta2);
  s.one_minus_beta2 = float(one_minus_beta2);
  s.bc2_sqrt = float(bias_correction2_sqrt);
  s.eps = float(eps);
  s.neg_step_size = float(neg_step_size);
  s.grad_scale = float(grad_scale);
  if (num_threads < 1) num_threads = 1;

  if (grad_kind == 1)
    dispatch_out(master, static_cast<const uint16_t*>(grad), exp_avg, exp_avg_sq, out, out_kind,
                 n, s, num_threads);
  else
    dispatch_out(master, static_cast<const float*>(grad), exp_avg, exp_avg_sq, out, out_kind, n,
                 s, num_threads);
}

double megacompile_grad_sq_norm(const void* grad, int grad_kind, int64_t n, int num_threads) {
  if (num_threads < 1) num_threads = 1;
  if (grad_kind == 1) return sq_norm(static_cast<const uint16_t*>(grad), n, num_threads);
  return sq_norm(static_cast<const float*>(grad), n, num_threads);
}

}  // extern "C"
