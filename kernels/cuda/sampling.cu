// Next-token sampling on the device, the same rules as kernels/sampling.py, so a step needs no
// host round trip: the ids land in a device buffer that one async copy moves to the host ring.
//
// Per row s (one block each), in kernels/sampling.py's order:
//   apply_penalties  repetition over prompt + output, then frequency / presence over the output,
//                    into a copy of the row (logprobs still see the raw logits)
//   sample_tokens    temperature 0: argmax (first maximum). Otherwise x = logit / T and
//                    e = exp(x - max x) in float64, u = request_uniform(seed, counter); with no
//                    filter the first index whose running sum of e exceeds u * sum(e); with
//                    top_k / top_p / min_p the same inversion over the kept prefix of the
//                    descending order (ties: lower index first).
//   compute_logprobs log-softmax of the raw logits: the chosen token and the top N.
//
// Filtered rows avoid a full sort of the vocabulary: a histogram of distance from the maximum
// picks the fewest top tokens that must contain the kept prefix (at most SAMPLE_CAP of them);
// those are sorted in shared memory and the rule is applied exactly. If the prefix cannot be
// proven to lie inside them (a near-flat distribution), the row takes the slow path: exact
// bisection over the 64-bit sort keys, several passes over the row, same answer.
//
// Row parameters (structure of arrays, written by the host each step):
//   dparams double [S, 4]: temperature, top_p, min_p, -
//   fparams float  [S, 4]: repetition, frequency, presence penalty, -
//   iparams int    [S, 4]: top_k, logprobs N (-1: none), penalized (0/1), -
//   rng     u64    [S, 2]: seed, counter (= number of tokens generated so far)
#include "common.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_CAP 2048
#define NUM_BUCKETS 64
#define BUCKET_WIDTH 0.5
#define MAX_TOP_LOGPROBS 20

// ------------------------------------------------------------------ the request's uniform draw

__device__ __forceinline__ u64 mix64(u64 z) {
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ull;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ double request_uniform(u64 seed, u64 counter) {
    const u64 x = mix64(seed) + (counter + 1ull) * 0x9e3779b97f4a7c15ull;
    return (double)(mix64(x) >> 11) * 1.1102230246251565e-16;   // 2^-53
}

// ------------------------------------------------------------------ penalties

// grid (S), block 256. Rows with penalized == 0 are left alone (the sampler reads `logits`).
// entries int [E, 2]: (token, times it occurs in the output) for every distinct token of the
// row's prompt and output; row s owns entries row_ptr[s] .. row_ptr[s + 1].
extern "C" __global__ void apply_penalties(
    const float* __restrict__ logits, float* __restrict__ plogits, int ldl, int vocab_size,
    const float* __restrict__ fparams, const int* __restrict__ iparams,
    const int* __restrict__ row_ptr, const int* __restrict__ entries) {
    pdl_wait();
    const int s = blockIdx.x;
    if (!iparams[4 * s + 2]) return;
    const float* src = logits + (size_t)s * ldl;
    float* dst = plogits + (size_t)s * ldl;
    for (int i = threadIdx.x; i < vocab_size; i += blockDim.x) dst[i] = src[i];
    __syncthreads();
    const float rep = fparams[4 * s], freq = fparams[4 * s + 1], pres = fparams[4 * s + 2];
    for (int e = row_ptr[s] + threadIdx.x; e < row_ptr[s + 1]; e += blockDim.x) {
        const int tok = entries[2 * e];
        if (tok < 0 || tok >= vocab_size) continue;
        float v = dst[tok];
        if (rep != 1.0f) v = v > 0.0f ? __fdiv_rn(v, rep) : __fmul_rn(v, rep);
        const int count = entries[2 * e + 1];
        if (count > 0 && (freq != 0.0f || pres != 0.0f))
            v = __fsub_rn(v, __fadd_rn(__fmul_rn(freq, (float)count), __fmul_rn(pres, 1.0f)));
        dst[tok] = v;
    }
}

// ------------------------------------------------------------------ block helpers

// Exclusive prefix over the block in thread order; `total` gets the sum. Deterministic.
__device__ __forceinline__ double block_exclusive_scan(double v, double* scratch, double& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    double incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const double n = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += n;
    }
    double excl = __shfl_up_sync(FULL_MASK, incl, 1);
    if (lane == 0) excl = 0.0;
    __syncthreads();
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        double w = lane < num_warps ? scratch[lane] : 0.0, wi = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const double n = __shfl_up_sync(FULL_MASK, wi, o);
            if (lane >= o) wi += n;
        }
        scratch[32 + lane] = wi - w;       // exclusive prefix of warp totals
        if (lane == num_warps - 1) scratch[64] = wi;
    }
    __syncthreads();
    total = scratch[64];
    return scratch[32 + warp] + excl;
}

struct RowView {
    const float* logits;
    int vocab_size;
    double temperature;
    double xmax;                     // max logit / T
    __device__ __forceinline__ double e(int i) const { return exp((double)logits[i] / temperature - xmax); }
};

__device__ int row_argmax(const float* row, int vocab_size, u64* scratch) {
    u64 best = 0;
    for (int i = threadIdx.x; i < vocab_size; i += blockDim.x) {
        const u64 k = rank_key(row[i], i);
        best = k > best ? k : best;
    }
    return key_index(block_max_u64(best, scratch));
}

// ------------------------------------------------------------------ unfiltered: index-order CDF

// Warps own contiguous stretches of the row; within a warp, 32 consecutive elements per
// iteration with a warp scan, so the running sum follows index order.
__device__ int sample_index_order(const RowView& r, double u, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    const int span = (r.vocab_size + num_warps - 1) / num_warps;
    const int begin = min(warp * span, r.vocab_size), end = min(begin + span, r.vocab_size);
    double wsum = 0.0;
    for (int base = begin; base < end; base += 32) {
        const int i = base + lane;
        wsum += warp_sum_f64(i < end ? r.e(i) : 0.0);
    }
    double total;
    const double before = block_exclusive_scan(lane == 0 ? wsum : 0.0, scratch, total);   // lane 0 carries the warp
    const double warp_before = __shfl_sync(FULL_MASK, before, 0);
    const double target = u * total;
    // the crossing lies in the last warp with weight that starts at or below the target
    __shared__ int crossing_warp, picked;
    if (threadIdx.x == 0) { crossing_warp = -1; picked = -1; }
    __syncthreads();
    if (lane == 0 && wsum > 0.0 && warp_before <= target) atomicMax(&crossing_warp, warp);
    __syncthreads();
    if (warp == crossing_warp) {
        double cum = warp_before;
        int last_weighted = -1;
        for (int base = begin; base < end; base += 32) {
            const int i = base + lane;
            const double v = i < end ? r.e(i) : 0.0;
            double incl = v;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const double n = __shfl_up_sync(FULL_MASK, incl, o);
                if (lane >= o) incl += n;
            }
            const unsigned hit = __ballot_sync(FULL_MASK, i < end && cum + incl > target);
            if (hit) {
                last_weighted = base + __ffs(hit) - 1;
                break;
            }
            const unsigned weighted = __ballot_sync(FULL_MASK, v > 0.0);
            if (weighted) last_weighted = base + 31 - __clz(weighted);
            cum += __shfl_sync(FULL_MASK, incl, 31);
        }
        // no crossing inside (u * total rounded up to the warp's end): its last token with
        // weight, as kernels/sampling.py never steps past the last token with weight
        if (lane == 0) picked = last_weighted;
    }
    __syncthreads();
    return picked;
}

// ------------------------------------------------------------------ filtered: exact slow path

// count and mass of the elements whose sort key is >= threshold
__device__ void count_mass_ge(const RowView& r, u64 threshold, int& count, double& mass, double* scratch) {
    int c = 0;
    double m = 0.0;
    for (int i = threadIdx.x; i < r.vocab_size; i += blockDim.x) {
        if (rank_key(r.logits[i], i) >= threshold) {
            ++c;
            m += r.e(i);
        }
    }
    count = block_sum_int(c, reinterpret_cast<int*>(scratch));
    mass = block_sum_f64(m, scratch);
}

// Largest key tau with count(key >= tau) >= rank (by_mass false) or mass(key >= tau) >= / > the
// target (by_mass true; strict selects >). Keys are distinct, so tau is an element's key.
__device__ u64 bisect_key(const RowView& r, bool by_mass, int rank, double target, bool strict, double* scratch) {
    u64 lo = 0, hi = ~0ull;
    while (lo < hi) {
        const u64 mid = lo + (hi - lo) / 2 + 1;
        int c;
        double m;
        count_mass_ge(r, mid, c, m, scratch);
        const bool ok = by_mass ? (strict ? m > target : m >= target) : c >= rank;
        if (ok) lo = mid; else hi = mid - 1;
    }
    return lo;
}

__device__ int sample_filtered_slow(const RowView& r, double Z, double u, int top_k, double top_p,
                                    double min_p, double* scratch) {
    const int V = r.vocab_size;
    int r_keep = top_k > 0 ? min(top_k, V) : V;
    int c;
    double m;
    if (min_p > 0.0) {
        int n = 0;
        for (int i = threadIdx.x; i < V; i += blockDim.x) n += (r.e(i) / Z >= min_p * (1.0 / Z)) ? 1 : 0;
        r_keep = min(r_keep, block_sum_int(n, reinterpret_cast<int*>(scratch)));
    }
    if (top_p < 1.0) {
        count_mass_ge(r, 0, c, m, scratch);
        if (m >= top_p * Z) {
            const u64 tau = bisect_key(r, true, 0, top_p * Z, false, scratch);
            count_mass_ge(r, tau, c, m, scratch);
            r_keep = min(r_keep, c);
        }
    }
    r_keep = max(r_keep, 1);
    const u64 tau_r = bisect_key(r, false, r_keep, 0.0, false, scratch);
    double kept_mass;
    count_mass_ge(r, tau_r, c, kept_mass, scratch);
    const double target = u * kept_mass;
    u64 tau = bisect_key(r, true, 0, target, true, scratch);
    count_mass_ge(r, tau, c, m, scratch);
    if (c > r_keep || m <= target) tau = tau_r;          // never past the kept prefix
    return key_index(tau);
}

// ------------------------------------------------------------------ filtered: candidates in shared memory

__device__ void bitonic_sort_desc(u64* keys, double* vals, int n) {
    for (int k = 2; k <= n; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const int ixj = i ^ j;
                if (ixj > i && ((keys[i] < keys[ixj]) == ((i & k) == 0))) {
                    const u64 tk = keys[i]; keys[i] = keys[ixj]; keys[ixj] = tk;
                    const double tv = vals[i]; vals[i] = vals[ixj]; vals[ixj] = tv;
                }
            }
            __syncthreads();
        }
    }
}

// -1 when the kept prefix cannot be shown to lie among the candidates (the caller goes slow)
__device__ int sample_filtered_fast(const RowView& r, double Z, double u, int top_k, double top_p,
                                    double min_p, double* scratch, u64* cand_key, double* cand_e, double* cand_cum) {
    __shared__ int bucket_count[NUM_BUCKETS];
    __shared__ double bucket_mass[NUM_BUCKETS];
    __shared__ int chosen_bucket, num_cand;
    const int V = r.vocab_size;
    for (int b = threadIdx.x; b < NUM_BUCKETS; b += blockDim.x) { bucket_count[b] = 0; bucket_mass[b] = 0.0; }
    __syncthreads();
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const double dist = r.xmax - (double)r.logits[i] / r.temperature;
        if (dist < NUM_BUCKETS * BUCKET_WIDTH) {
            const int b = min((int)(dist / BUCKET_WIDTH), NUM_BUCKETS - 1);
            atomicAdd(&bucket_count[b], 1);
            atomicAdd(&bucket_mass[b], exp(-dist));
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        // the fewest leading buckets that hold every token any active filter could keep
        int cnt = 0, pick = -1;
        double mass = 0.0;
        for (int b = 0; b < NUM_BUCKETS && pick < 0; ++b) {
            cnt += bucket_count[b];
            mass += bucket_mass[b];
            if (cnt > SAMPLE_CAP) break;
            const bool by_k = top_k > 0 && cnt >= top_k;
            const bool by_p = top_p < 1.0 && mass >= top_p * Z;
            const bool by_min = min_p > 0.0 && exp(-(b + 1) * BUCKET_WIDTH) < min_p;
            if (by_k || by_p || by_min || cnt == V) pick = b;
        }
        chosen_bucket = pick;
        num_cand = 0;
    }
    __syncthreads();
    const int B = chosen_bucket;
    if (B < 0) return -1;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const double dist = r.xmax - (double)r.logits[i] / r.temperature;
        if (dist < (B + 1) * BUCKET_WIDTH && min((int)(dist / BUCKET_WIDTH), NUM_BUCKETS - 1) <= B) {
            const int slot = atomicAdd(&num_cand, 1);
            cand_key[slot] = rank_key(r.logits[i], i);
            cand_e[slot] = r.e(i);
        }
    }
    __syncthreads();
    const int n = num_cand;
    int n_pad = 1;
    while (n_pad < n) n_pad <<= 1;
    for (int i = n + threadIdx.x; i < n_pad; i += blockDim.x) { cand_key[i] = 0; cand_e[i] = 0.0; }
    __syncthreads();
    bitonic_sort_desc(cand_key, cand_e, n_pad);

    // running sums in descending order: thread i owns elements 2i, 2i + 1
    const int i0 = 2 * threadIdx.x, i1 = i0 + 1;
    const double e0 = i0 < n ? cand_e[i0] : 0.0, e1 = i1 < n ? cand_e[i1] : 0.0;
    double total;
    const double before = block_exclusive_scan(e0 + e1, scratch, total);
    if (i0 < n) cand_cum[i0] = before + e0;
    if (i1 < n) cand_cum[i1] = before + e0 + e1;
    __syncthreads();
    int kept = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const double e = cand_e[j], mass_before = cand_cum[j] - e;
        const bool keep = j == 0 || ((top_k <= 0 || j < top_k) && mass_before / Z < top_p
                                     && e / Z >= min_p * (1.0 / Z));
        kept += keep ? 1 : 0;
    }
    const int r_keep = block_sum_int(kept, reinterpret_cast<int*>(scratch));
    if (r_keep == n && n < V) {
        // would the first token after the candidates be kept too? then they are not enough
        const bool k_room = top_k <= 0 || n < top_k;
        const bool p_room = cand_cum[n - 1] / Z < top_p;
        const bool min_room = min_p <= 0.0 || exp(-(B + 1) * BUCKET_WIDTH) >= min_p;
        if (k_room && p_room && min_room) return -1;
    }
    const double target = u * cand_cum[r_keep - 1];
    int below = 0;
    for (int j = threadIdx.x; j < r_keep; j += blockDim.x) below += cand_cum[j] <= target ? 1 : 0;
    const int pick = min(block_sum_int(below, reinterpret_cast<int*>(scratch)), r_keep - 1);
    return key_index(cand_key[pick]);
}

// ------------------------------------------------------------------ kernels

// Greedy rows only (the decode graph's fast path). grid (S), block 1024.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) argmax_rows(
    const float* __restrict__ logits, int ldl, int vocab_size, int* __restrict__ tokens) {
    __shared__ u64 scratch[32];
    pdl_wait();
    const int tok = row_argmax(logits + (size_t)blockIdx.x * ldl, vocab_size, scratch);
    if (threadIdx.x == 0) tokens[blockIdx.x] = tok;
}

// Every sampling rule. grid (S), block 1024, dynamic shared memory SAMPLE_CAP * 24 bytes.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_tokens(
    const float* __restrict__ logits, const float* __restrict__ plogits, int ldl, int vocab_size,
    const double* __restrict__ dparams, const int* __restrict__ iparams, const u64* __restrict__ rng,
    int* __restrict__ tokens) {
    extern __shared__ double dyn[];
    u64* cand_key = reinterpret_cast<u64*>(dyn);                     // [SAMPLE_CAP]
    double* cand_e = dyn + SAMPLE_CAP;                               // [SAMPLE_CAP]
    double* cand_cum = dyn + 2 * SAMPLE_CAP;                         // [SAMPLE_CAP]
    __shared__ double scratch[72];
    pdl_wait();
    const int s = blockIdx.x;
    const float* row = (iparams[4 * s + 2] ? plogits : logits) + (size_t)s * ldl;
    const double temperature = dparams[4 * s], top_p = dparams[4 * s + 1], min_p = dparams[4 * s + 2];
    const int top_k = iparams[4 * s];
    int tok;
    if (temperature == 0.0) {
        tok = row_argmax(row, vocab_size, reinterpret_cast<u64*>(scratch));
    } else {
        float v = -TW_INF;
        for (int i = threadIdx.x; i < vocab_size; i += blockDim.x) v = fmaxf(v, row[i]);
        const float lmax = block_max(v, reinterpret_cast<float*>(scratch));
        const RowView r{row, vocab_size, temperature, (double)lmax / temperature};
        const double u = request_uniform(rng[2 * s], rng[2 * s + 1]);
        if (top_k <= 0 && top_p >= 1.0 && min_p <= 0.0) {
            tok = sample_index_order(r, u, scratch);
        } else {
            double z = 0.0;
            for (int i = threadIdx.x; i < vocab_size; i += blockDim.x) z += r.e(i);
            const double Z = block_sum_f64(z, scratch);
            tok = sample_filtered_fast(r, Z, u, top_k, top_p, min_p, scratch, cand_key, cand_e, cand_cum);
            if (tok < 0) tok = sample_filtered_slow(r, Z, u, top_k, top_p, min_p, scratch);
        }
    }
    if (threadIdx.x == 0) tokens[s] = tok;
}

// Rows with logprobs N >= 0: log-softmax of the raw logits (float64), the chosen token's
// value and the N best, best first (ties: lower index first). grid (S), block 1024.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) compute_logprobs(
    const float* __restrict__ logits, int ldl, int vocab_size, const int* __restrict__ iparams,
    const int* __restrict__ tokens, double* __restrict__ token_logprob,
    int* __restrict__ top_ids, double* __restrict__ top_logprobs) {
    __shared__ double scratch[72];
    pdl_wait();
    const int s = blockIdx.x, n = iparams[4 * s + 1];
    if (n < 0) return;
    const float* row = logits + (size_t)s * ldl;
    float lmax = -TW_INF;
    for (int i = threadIdx.x; i < vocab_size; i += blockDim.x) lmax = fmaxf(lmax, row[i]);
    const double xmax = (double)block_max(lmax, reinterpret_cast<float*>(scratch));
    double z = 0.0;
    for (int i = threadIdx.x; i < vocab_size; i += blockDim.x) z += exp((double)row[i] - xmax);
    const double lse = log(block_sum_f64(z, scratch)) + xmax;
    if (threadIdx.x == 0) token_logprob[s] = (double)row[tokens[s]] - lse;
    u64 prev = ~0ull;
    for (int j = 0; j < n && j < MAX_TOP_LOGPROBS; ++j) {
        u64 best = 0;
        for (int i = threadIdx.x; i < vocab_size; i += blockDim.x) {
            const u64 k = rank_key(row[i], i);
            if (k < prev && k > best) best = k;
        }
        prev = block_max_u64(best, reinterpret_cast<u64*>(scratch));
        if (threadIdx.x == 0) {
            const int id = key_index(prev);
            top_ids[s * MAX_TOP_LOGPROBS + j] = id;
            top_logprobs[s * MAX_TOP_LOGPROBS + j] = (double)row[id] - lse;
        }
    }
}
