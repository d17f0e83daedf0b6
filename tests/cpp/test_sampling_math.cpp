// The bit-reproducible arithmetic of chain sampling (sampling_math.h, chain_sampling.h) against long double.
#include <cmath>
#include <limits>

#include "check.h"
#include "specdec/chain_sampling.h"

using namespace specdec;

namespace {
double ulp_error(float got, long double want) {
  const float w = static_cast<float>(want);
  const double ulp = std::nextafter(w, std::numeric_limits<float>::infinity()) - w;
  return static_cast<double>(std::fabs(static_cast<long double>(got) - want)) / ulp;
}
}  // namespace

TEST_CASE("det_exp2 is within 2.5 ulp of 2^d on [-123.9, 1] and exact at integers") {
  double worst = 0.0;
  // 2^22 points spread over the range, plus the neighbourhood of every half-integer (where the rounding of
  // d to an integer flips and the polynomial is evaluated at the ends of [-1/2, 1/2]).
  for (int i = 0; i <= (1 << 22); ++i) {
    const float d = -123.9f + 124.9f * static_cast<float>(i) / static_cast<float>(1 << 22);
    worst = std::fmax(worst, ulp_error(det_exp2(d), std::exp2l(d)));
  }
  for (int k = -123; k <= 0; ++k) {
    for (float d : {k - 0.5f, std::nextafter(k - 0.5f, 0.0f), std::nextafter(k - 0.5f, -200.0f)}) {
      worst = std::fmax(worst, ulp_error(det_exp2(d), std::exp2l(d)));
    }
    CHECK_EQ(det_exp2(static_cast<float>(k)), std::ldexp(1.0f, k));
  }
  CHECK(worst <= 2.5);
  CHECK(worst > 0.0);  // the comparison is live
}

TEST_CASE("det_exp2 drops what the softmax cannot use: d <= -124, -inf, NaN give 0") {
  CHECK_EQ(det_exp2(-124.0f), 0.0f);
  CHECK_EQ(det_exp2(-1000.0f), 0.0f);
  CHECK_EQ(det_exp2(kNegInf), 0.0f);
  CHECK_EQ(det_exp2(std::numeric_limits<float>::quiet_NaN()), 0.0f);
  CHECK(det_exp2(-123.5f) > 0.0f);
}

TEST_CASE("max_propagate_nan returns NaN for a NaN on either side") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(std::isnan(max_propagate_nan(nan, 1.0f)));
  CHECK(std::isnan(max_propagate_nan(1.0f, nan)));
  CHECK_EQ(max_propagate_nan(kNegInf, -3.0f), -3.0f);
  CHECK_EQ(max_propagate_nan(2.0f, -3.0f), 2.0f);
}

TEST_CASE("maxsum_push_block and maxsum_combine give the row's max and sum of 2^((x - max) * scale)") {
  // 64 lanes of 4 blocks each, with masked entries; compared with the float64 sum.
  uint32_t state = 12345;
  auto next = [&] {
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(state >> 8) / 16777216.0f;
  };
  const float scale = 1.3f * kLog2e;
  MaxSum lanes[64];
  float max_x = kNegInf;
  float x[64][4][kLaneEntries];
  for (auto& lane : x) {
    for (auto& block : lane) {
      for (float& v : block) {
        v = next() < 0.1f ? kNegInf : 20.0f * next() - 10.0f;
        max_x = std::fmax(max_x, v);
      }
    }
  }
  for (int l = 0; l < 64; ++l) {
    lanes[l] = maxsum_identity();
    for (auto& block : x[l]) lanes[l] = maxsum_push_block(lanes[l], block, block_max(block), scale);
  }
  for (int width = 1; width < 64; width *= 2) {
    for (int l = 0; l < 64; l += 2 * width) lanes[l] = maxsum_combine(lanes[l], lanes[l + width], scale);
  }
  long double want = 0;
  for (auto& lane : x) {
    for (auto& block : lane) {
      for (float v : block) {
        if (v > kNegInf) want += std::exp2l((static_cast<long double>(v) - lanes[0].m) * scale);
      }
    }
  }
  CHECK_EQ(lanes[0].m, max_x);  // the raw max, not scaled
  CHECK(std::fabs(static_cast<long double>(lanes[0].s) / want - 1) < 1e-5L);
  // A block of masked entries leaves a state unchanged, bit for bit.
  float masked[kLaneEntries];
  for (float& v : masked) v = kNegInf;
  const MaxSum same = maxsum_push_block(lanes[0], masked, block_max(masked), scale);
  CHECK_EQ(same.m, lanes[0].m);
  CHECK_EQ(same.s, lanes[0].s);
}

TEST_CASE("the row's max keeps its term 1 at any scale: logits up to 3e38, scale up to log2(e) / kMinTemperature") {
  // Scaling first and subtracting the scaled max lost the max once |x| * scale passed 2^31 (half an ulp of the
  // scaled max out of det_exp2's range): "no mass" at temperature 1e-9, or 1e-5 with logits of 1e5.
  const float scale = fmul(fdiv(1.0f, kMinTemperature), kLog2e);
  for (float top : {1.0f, 1e4f, 1.7e4f, 1e5f, 3.3e7f, 1e30f, 3e38f, -1e5f, -3e38f}) {
    float x[2][kLaneEntries] = {{-top, kNegInf, top, 0.0f, top * 0.5f, -3e38f, 3e38f, 2.0f},
                                {kNegInf, -3e38f, 3e38f, top * 0.25f, -1.0f, -top, 1.0f, 0.0f}};
    for (auto& block : x) {
      for (float& v : block) v = std::fmin(v, top);  // top is the max, in the first lane
    }
    const MaxSum a = maxsum_push_block(maxsum_identity(), x[0], block_max(x[0]), scale);
    const MaxSum b = maxsum_push_block(maxsum_push_block(maxsum_identity(), x[1], block_max(x[1]), scale), x[1],
                                       block_max(x[1]), scale);
    const MaxSum r = maxsum_combine(a, b, scale);
    CHECK_EQ(maxsum_combine(b, a, scale).s, r.s);
    CHECK_EQ(r.m, top);
    CHECK(r.s >= 1.0f && r.s <= 24.0f);
    CHECK_EQ(softmax_prob(top, scale, SoftmaxNorm{r.m, 0.0f, 1.0f}), 1.0f);
  }
}

TEST_CASE("a row's normaliser: lse_of_stats, norm_of_lse and the tolerance lse_matches allows") {
  // Row x_v = v / 7 - 3 (v < 50) at temperature 0.7: ln sum exp(x / t) in double is the reference.
  const float t = 0.7f, scale = fmul(fdiv(1.0f, t), kLog2e);
  float x[kLaneEntries * 8];
  double sum = 0.0;
  for (int v = 0; v < kLaneEntries * 8; ++v) {
    x[v] = v < 50 ? static_cast<float>(v) / 7.0f - 3.0f : kNegInf;
    if (v < 50) sum += std::exp(static_cast<double>(x[v]) / static_cast<double>(t));
  }
  MaxSum st = maxsum_identity();
  for (int blk = 0; blk < 8; ++blk) st = maxsum_push_block(st, x + kLaneEntries * blk, block_max(x + kLaneEntries * blk), scale);
  const float lse = lse_of_stats(st, scale);
  CHECK(std::fabs(lse - std::log(sum)) < 4e-6);
  // Probabilities from the normaliser agree with the row's own statistics within the normaliser's rounding.
  for (int v : {0, 17, 49}) {
    const float own = softmax_prob(x[v], scale, norm_of_stats(st)), from_lse = softmax_prob(x[v], scale, norm_of_lse(lse));
    CHECK(std::fabs(from_lse / own - 1.0f) < 2e-6f);
  }
  // The row's own normaliser subtracts c = 0 exactly: the bits of 2^((x - m) * scale) / sum.
  CHECK_EQ(softmax_prob(x[3], scale, norm_of_stats(st)), fmul(det_exp2(scaled_gap(x[3], st.m, scale)), fdiv(1.0f, st.s)));
  // No mass: -inf; the tolerance is 2^-14 + 2^-20 |lse|, NaN never within it.
  CHECK_EQ(lse_of_stats(maxsum_identity(), scale), kNegInf);
  CHECK(lse_matches(lse, lse));
  CHECK(lse_matches(fadd(lse, 6.0e-5f), lse));
  CHECK(!lse_matches(fadd(lse, 7.0e-5f), lse));
  CHECK(lse_matches(1000.0f + 1.0e-3f, 1000.0f));   // 2^-14 + 2^-20 * 1000 = 1.015e-3
  CHECK(!lse_matches(1000.0f + 1.1e-3f, 1000.0f));
  CHECK(lse_matches(-1000.0f - 1.0e-3f, -1000.0f));
  CHECK(!lse_matches(__builtin_nanf(""), lse));
  CHECK(!lse_matches(0.0f, kNegInf));        // a row without mass has no normaliser a caller could match
  CHECK(!lse_matches(1e30f, -kNegInf));      // nor does one whose logits / temperature overflow
}

TEST_CASE("sampling_slices: the largest split with batch x slices <= SMs whose group of blocks the device holds") {
  const auto holds = [](int blocks) { return [=](int) { return blocks; }; };
  CHECK_EQ(sampling_slices(1, 132, holds(1 << 30)), 32);
  CHECK_EQ(sampling_slices(4, 132, holds(1 << 30)), 32);   // 128 blocks
  CHECK_EQ(sampling_slices(5, 132, holds(1 << 30)), 16);
  CHECK_EQ(sampling_slices(8, 132, holds(1 << 30)), 16);
  CHECK_EQ(sampling_slices(64, 132, holds(1 << 30)), 2);
  CHECK_EQ(sampling_slices(66, 132, holds(1 << 30)), 2);
  CHECK_EQ(sampling_slices(67, 132, holds(1 << 30)), 1);
  CHECK_EQ(sampling_slices(1, 132, holds(0)), 1);          // no cooperative launches
  CHECK_EQ(sampling_slices(1, 132, [](int s) { return s <= 8 ? 1 << 30 : s - 1; }), 8);  // 16 blocks do not fit
  CHECK_EQ(sampling_slices(1, 4, holds(1 << 30)), 4);      // the emulated device
  CHECK_EQ(sampling_slices(2, 4, holds(1 << 30)), 2);
  CHECK_EQ(sampling_slices(3, 4, holds(1 << 30)), 1);
  // Groups at once: the whole batch when it fits, else what a cooperative launch holds.
  CHECK_EQ(sampling_groups(4, 32, 4224), 4);
  CHECK_EQ(sampling_groups(300, 2, 264), 132);
  CHECK_EQ(sampling_groups(300, 1, 0), 300);
  CHECK_EQ(sampling_groups(int64_t{1} << 40, 1, 0), int64_t{1} << 28);
  CHECK_EQ(sampling_groups(1, 32, 16), 0);                 // the device cannot hold one group
}

TEST_CASE("first_crossing: the first cumulative mass above the threshold, else the last positive part") {
  const float parts[5] = {0.25f, 0.0f, 0.5f, 0.25f, 0.0f};
  float before = -1.0f;
  CHECK_EQ(first_crossing(parts, 5, 0.0f, 0.1f, &before), 0);
  CHECK_EQ(before, 0.0f);
  CHECK_EQ(first_crossing(parts, 5, 0.0f, 0.25f, &before), 2);  // 0.25 is not above 0.25; the zero part is skipped
  CHECK_EQ(before, 0.25f);
  CHECK_EQ(first_crossing(parts, 5, 0.5f, 1.0f, &before), 2);   // base 0.5: 0.5 + 0.75 > 1
  CHECK_EQ(first_crossing(parts, 5, 0.0f, 0.9f, &before), 3);
  CHECK_EQ(before, 0.75f);
  CHECK_EQ(first_crossing(parts, 5, 0.0f, 1.0f, &before), 3);   // none crosses: the last positive part
  CHECK_EQ(before, 0.75f);
  const float zeros[3] = {0.0f, 0.0f, 0.0f};
  CHECK_EQ(first_crossing(zeros, 3, 0.0f, 0.0f, &before), 2);
  CHECK_EQ(before, 0.0f);
}

TEST_CASE("det_log2 is within 4 ulp of log2(x) over the normal and subnormal range, exact at powers of 2") {
  double worst = 0.0;
  // 2^22 points log-spaced over [2^-149, 2^127], plus 2^22 points of [0.5, 2] (where log2 x is near 0) and the
  // neighbourhood of sqrt(2) (where the reduction switches ranges).
  for (int i = 0; i <= (1 << 22); ++i) {
    const float x = std::exp2f(-149.0f + 276.0f * static_cast<float>(i) / static_cast<float>(1 << 22));
    if (x > 0.0f && std::fabs(std::log2l(x)) > 1e-30L) worst = std::fmax(worst, ulp_error(det_log2(x), std::log2l(x)));
    const float y = 0.5f + 1.5f * static_cast<float>(i) / static_cast<float>(1 << 22);
    if (y != 1.0f) worst = std::fmax(worst, ulp_error(det_log2(y), std::log2l(y)));
  }
  float z = 1.41421354f;
  for (int i = 0; i < 64; ++i, z = std::nextafter(z, 2.0f)) worst = std::fmax(worst, ulp_error(det_log2(z), std::log2l(z)));
  for (int k = -149; k <= 127; ++k) CHECK_EQ(det_log2(std::ldexp(1.0f, k)), static_cast<float>(k));
  CHECK(worst <= 4.0);  // 3.8 ulp near x = 1.086, where log2 x = 0.119: a relative 2.3e-7
  CHECK(worst > 0.0);
  CHECK_EQ(det_log2(0.0f), kNegInf);
}

TEST_CASE("gumbel_noise2 of Philox's uniforms is -log2(-log2 u) within 1e-6, bounded as kGumbelReach assumes") {
  double worst = 0.0;
  const float lowest = 5.9604644775390625e-08f, highest = 1.0f - lowest;  // the uniforms' extremes (philox.h)
  for (uint32_t k = 0; k < (1u << 23); k += 97) {
    const float u = static_cast<float>(2 * k + 1) * lowest;
    const long double want = -std::log2l(-std::log2l(static_cast<long double>(u)));
    worst = std::fmax(worst, static_cast<double>(std::fabs(gumbel_noise2(u) - want)));
  }
  CHECK(worst < 1e-5);
  CHECK(gumbel_noise2(highest) < 23.6f && gumbel_noise2(highest) > 23.4f);
  CHECK(gumbel_noise2(lowest) > -4.6f && gumbel_noise2(lowest) < -4.5f);
  // A key kGumbelReach below the max can never beat the max's key: 23.6 - 32 < -4.6.
  CHECK(gumbel_noise2(highest) - kGumbelReach < gumbel_noise2(lowest));
}

int main(int argc, char** argv) { return specdec_test::run_all(argc, argv); }
